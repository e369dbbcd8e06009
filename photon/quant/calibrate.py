"""A photon model run on whole texts outside the engine: static activation scales for
`photon quantize --scheme fp8-static`, and next-token logits for quality checks.

Each text is one prefill through the torch reference attention over a private paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from photon.attention.backend import AttentionMetadata, ForwardContext
from photon.attention.torch_ref import TorchReferenceBackend
from photon.config import ModelConfig
from photon.model.hf_config import architecture, load_hf_config
from photon.model.layers.linear import QuantizableLinear
from photon.model.loader import load_model

BLOCK_SIZE = 16
# The checkpoint modules each photon linear packs (photon name suffix -> checkpoint suffixes).
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def float_model(model_dir: str, quantization: str | None = None) -> nn.Module:
    """The model on CPU in float32 (quantization: as --quantization, None: unquantized unless
    the checkpoint is)."""
    from photon.quant.config import resolve_quant_config

    hf = load_hf_config(model_dir)
    arch = architecture(hf)
    config = ModelConfig(model=model_dir, hf_config=hf, architecture=arch, dtype=torch.float32,
                         max_model_len=int(hf.get("max_position_embeddings") or 2048),
                         vocab_size=int(hf["vocab_size"]), seed=0, served_model_name="calibration",
                         quant_config=resolve_quant_config(quantization, hf, arch, "cpu", False))
    return load_model(config, "cpu")


@torch.no_grad()
def prefill_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """Next-token logits [len(ids), vocab] of `ids` run as one prefill."""
    return model.compute_logits(_prefill(model, ids))


def _prefill(model: nn.Module, ids: list[int]) -> torch.Tensor:
    cfg = model.hf_config
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    n, blocks = len(ids), -(-len(ids) // BLOCK_SIZE)
    # Block 0 is the engine's reserved dummy block; the text owns blocks 1..blocks.
    caches = [torch.zeros(2, blocks + 1, BLOCK_SIZE, kv_heads, head_dim)
              for _ in range(int(cfg["num_hidden_layers"]))]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(BLOCK_SIZE, BLOCK_SIZE + n, dtype=torch.int64),
        block_tables=torch.arange(1, blocks + 1, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens_host=[n], query_lens_host=[n], decode_only=False)
    ctx = ForwardContext(metadata=meta, kv_caches=caches, backend=TorchReferenceBackend())
    return model(torch.tensor(ids), torch.arange(n), ctx)


@torch.no_grad()
def input_amax(model: nn.Module, texts: list[list[int]]) -> dict[str, float]:
    """Checkpoint module name (model.layers.0.self_attn.q_proj) -> the largest |input| its
    linear saw over the token-id lists `texts`."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear):
            continue
        prefix, _, packed = name.rpartition(".")
        members = [f"{prefix}.{m}" for m in PACKED[packed]]

        def record(_m: nn.Module, args: tuple[torch.Tensor, ...],
                   members: list[str] = members) -> None:
            value = float(args[0].abs().max())
            for m in members:
                amax[m] = max(amax.get(m, 0.0), value)

        hooks.append(module.register_forward_pre_hook(record))
    try:
        for ids in texts:
            _prefill(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return amax
