"""Built-in model shapes for benchmarks: real architectures' configs with random weights.

`materialize_shape()` writes a model directory holding only config.json and tokenizer files; the
engine loads it with load_format="dummy" (no checkpoint is read or written). The large shapes get
the benchmark BPE tokenizer (~120k tokens, photon.bench.tokenizer), so detokenization and grammar
masks cost what a real vocabulary costs; `tiny` gets photon-tiny's. Ids past the tokenizer's
vocabulary (the model's padding) detokenize to nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from photon.bench.tokenizer import ensure_bench_tokenizer
from photon.model.tiny import ensure_photon_tiny_random

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 128009,
    },
    "qwen3-30b-a3b": {  # MoE: 128 experts, 8 routed per token, every layer sparse
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645,
    },
    "tiny": {  # for CPU runs of the benchmarks in CI
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
        "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 2,
    },
}


def materialize_shape(name: str, out_dir: str) -> str:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; available: {', '.join(SHAPES)}")
    path = os.path.join(out_dir, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**SHAPES[name], "photon_random_weights": True}, f, indent=2)
    return attach_tokenizer(path, small=name == "tiny")


def attach_tokenizer(model_dir: str, small: bool = False) -> str:
    """Give a tokenizer-less model dir (e.g. a peer benchmark's saved weights) the benchmark
    BPE tokenizer (`small`: photon-tiny's), so the engine can load it and detokenize."""
    source = ensure_photon_tiny_random() if small else ensure_bench_tokenizer()
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        if not os.path.exists(os.path.join(model_dir, fname)):
            shutil.copy(os.path.join(source, fname), os.path.join(model_dir, fname))
    return model_dir


def param_count(name: str, active: bool = False) -> int:
    """Parameters of a shape (embedding counted once when tied). `active`: only those one token
    uses (an MoE layer's router and its top-k experts instead of all experts)."""
    c = SHAPES[name]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + _mlp_params(c, active) + 2 * h + 2 * c["head_dim"]
    emb = c["vocab_size"] * h
    return layers * per_layer + emb * (1 if c["tie_word_embeddings"] else 2) + h


def _mlp_params(c: dict[str, Any], active: bool) -> int:
    h = c["hidden_size"]
    if "num_experts" not in c:
        return 3 * h * c["intermediate_size"]
    experts = c["num_experts_per_tok"] if active else c["num_experts"]
    return experts * 3 * h * c["moe_intermediate_size"] + h * c["num_experts"]
