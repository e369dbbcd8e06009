"""Tiny random Hugging Face checkpoints for tests (config + safetensors; no tokenizer)."""

from __future__ import annotations

import torch

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

# Small MoE settings: 4-8 experts, top-2; Qwen3-MoE with one dense layer (mlp_only_layers) and
# the router's top-k renormalized.
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}

# Small original context so that llama3 scaling touches low, medium and high frequencies.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def build_hf_model(arch: str, *, tied: bool = False, vocab_size: int = 512,
                   hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                   num_kv_heads: int = 2, head_dim: int | None = None,
                   rope_scaling_llama3: bool = False, max_position_embeddings: int = 512,
                   seed: int = 0, extra: dict[str, object] | None = None) -> torch.nn.Module:
    """A random float32 HF model (eager attention) with weights scaled for varied outputs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied, eos_token_id=vocab_size - 1, bos_token_id=0,
        architectures=[arch])
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    kwargs.update(extra or {})
    if rope_scaling_llama3:
        kwargs["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=10000.0)
    config = AutoConfig.for_model(_MODEL_TYPES[arch], **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _perturb(model, seed)
    return model.eval()


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random init (std 0.02) gives near-constant greedy output, and norms = 1 / biases = 0
    would hide loading mistakes; so scale matrices x6 and jitter every vector."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.mul_(6.0)
        elif name.endswith("bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        else:  # norm weights
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))


def make_hf_model(path: str, arch: str, *, tied: bool = False,
                  dtype: torch.dtype = torch.float32, vocab_size: int = 512,
                  hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                  num_kv_heads: int = 2, head_dim: int | None = None,
                  rope_scaling_llama3: bool = False, max_position_embeddings: int = 512,
                  shard_size: str | None = None, seed: int = 0,
                  extra: dict[str, object] | None = None) -> str:
    """Write a random HF checkpoint (config.json + *.safetensors) to `path`; returns `path`."""
    model = build_hf_model(
        arch, tied=tied, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rope_scaling_llama3=rope_scaling_llama3,
        max_position_embeddings=max_position_embeddings, seed=seed, extra=extra)
    model = model.to(dtype)
    # transformers 5 always writes safetensors (the safe_serialization flag is gone).
    model.save_pretrained(path, max_shard_size=shard_size or "50GB")
    return path


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`, by name (all its safetensors files)."""
    import glob

    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        tensors.update(load_file(file))
    return tensors


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_engine_model(path: str, arch: str, vocab_size: int = 1024, **kwargs: object) -> str:
    """A random HF checkpoint plus photon-tiny's byte-level tokenizer: loadable by the engine
    (`vocab_size` covers the tokenizer's 1000 ids)."""
    import os
    import shutil

    from photon.model.tiny import ensure_photon_tiny_random

    make_hf_model(path, arch, vocab_size=vocab_size, **kwargs)
    tiny = ensure_photon_tiny_random()
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tiny, name), os.path.join(path, name))
    return path


@torch.no_grad()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation by full-sequence HF forwards (no KV cache, no EOS): the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    outs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        outs.append(ids[len(prompt):])
    return outs


@torch.no_grad()
def hf_log_softmax(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 log-softmax of HF's logits at every position of `ids`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_tensor(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The HF tensor(s) behind a photon parameter (photon packs q/k/v and gate/up)."""
    packs = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for packed, parts in packs.items():
        if f".{packed}." in name:
            return torch.cat([hf[name.replace(packed, part)] for part in parts])
    return hf[name]
