"""Tiny PEFT LoRA adapters for tests (written with peft next to a tiny HF model)."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, path: str, rank: int, seed: int, *, alpha: float | None = None,
                 rslora: bool = False, targets: list[str] | None = None) -> str:
    """A random LoRA adapter of `model_dir`'s model (B non-zero, so it changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=targets or ALL_TARGETS, use_rslora=rslora,
                        lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def peft_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of the base model with the adapter merged (None: the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(prompt):])
    return outs
