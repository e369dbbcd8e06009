"""Random-weight checkpoints of the built-in dense shapes, for what needs real files (`photon
quantize` reads a checkpoint; `--load-format dummy` never writes one).

`write_random_checkpoint(name, out_dir)` materializes the shape (config.json and tokenizer) and
adds a bfloat16 model.safetensors with the HF tensor names of a Llama / Qwen3 decoder: linears
drawn N(0, 1/in_features) (activations stay O(1) through the layers), norms ones. Deterministic
for a seed. Mixture-of-experts shapes are refused (nothing needs their files yet).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from photon.bench.shapes import SHAPES, materialize_shape

WEIGHTS_FILE = "model.safetensors"


def write_random_checkpoint(name: str, out_dir: str, seed: int = 0) -> str:
    """The shape's model directory under out_dir, with random bf16 weights; its path."""
    from safetensors.torch import save_file

    if name in SHAPES and "num_experts" in SHAPES[name]:
        raise ValueError(f"model shape {name!r} is a mixture of experts; random checkpoints "
                         f"are written for the dense shapes only")
    path = materialize_shape(name, out_dir)
    save_file(random_tensors(SHAPES[name], seed), os.path.join(path, WEIGHTS_FILE),
              metadata={"format": "pt"})
    return path


def random_tensors(c: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors of a Llama / Qwen3 dense decoder of config `c`."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
        return w.to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": linear(c["vocab_size"], h) * h ** 0.5 / 4}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": linear(q, h),
                    p + "self_attn.k_proj.weight": linear(kv, h),
                    p + "self_attn.v_proj.weight": linear(kv, h),
                    p + "self_attn.o_proj.weight": linear(h, q),
                    p + "mlp.gate_proj.weight": linear(inter, h),
                    p + "mlp.up_proj.weight": linear(inter, h),
                    p + "mlp.down_proj.weight": linear(h, inter),
                    p + "input_layernorm.weight": ones(h),
                    p + "post_attention_layernorm.weight": ones(h)})
        if c["model_type"] == "qwen3":
            out.update({p + "self_attn.q_norm.weight": ones(hd),
                        p + "self_attn.k_norm.weight": ones(hd)})
    out["model.norm.weight"] = ones(h)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = linear(c["vocab_size"], h)
    return out
