"""Pure-PyTorch paged attention: the correctness oracle for every other backend.

Two paths:
  * decode-only steps: fully vectorized, reads no device tensor on the host, so it can be captured
    in a CUDA graph;
  * everything else (prefill, chunked prefill, mixed steps): a per-sequence loop driven by the host
    mirrors in AttentionMetadata. Slow but obviously correct.
Attention math runs in float32 in both paths; the result is cast back to q's dtype. An FP8 cache
is dequantized (times the layer's per-head scales) as its pages are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from photon.attention.backend import AttentionBackend, AttentionMetadata
from photon.attention.kv_quant import LayerKVScales, fp8_scales
from photon.quant.numerics import to_fp8


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: LayerKVScales | None = None) -> None:
    """Scatter the step's K/V into the paged cache. Every slot is valid (padding hits block 0)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    scales = fp8_scales(kv_cache, kv_scales)
    if scales is not None:
        # index_copy_ has no float8 kernel on every device: copy the bytes.
        k = to_fp8(k, scales.k[:, None]).view(torch.uint8)
        v = to_fp8(v, scales.v[:, None]).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    # kv_cache[i] is a contiguous slice of a contiguous tensor, so view() aliases the cache.
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _float_pages(pages: torch.Tensor, kv_scales: LayerKVScales | None) -> torch.Tensor:
    """Gathered pages [2, ..., Hkv, D] in float32, dequantized when the cache is FP8."""
    out = pages.float()
    if kv_scales is not None:
        out[0] *= kv_scales.k[:, None]
        out[1] *= kv_scales.v[:, None]
    return out


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float,
                     kv_scales: LayerKVScales | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] -> [B, H, D]. No host syncs (graph-capturable)."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    # [2, B, W, block_size, Hkv, D] -> [2, B, Hkv, W*block_size, D]
    pages = kv_cache[:, block_tables.long()].reshape(2, num_seqs, -1, num_kv_heads, head_dim)
    pages = _float_pages(pages, fp8_scales(kv_cache, kv_scales)).transpose(2, 3)
    key_pos = torch.arange(pages.shape[3], device=q.device)
    # clamp(min=1): a padded (seq_len 0) row still sees one key and so never yields NaN.
    valid = key_pos[None, :] < seq_lens.clamp(min=1)[:, None].to(key_pos.dtype)  # [B, L]
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], pages[0], pages[1],
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[:, :, 0, :].to(q.dtype)


def varlen_attention(q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                     scale: float, kv_scales: LayerKVScales | None = None) -> torch.Tensor:
    """Per-sequence causal attention over the paged cache, using only host ints for control flow.
    Device-resolved lengths (speculative rows) are read from `seq_lens`: free for CPU tensors, a
    sync on CUDA (this is the reference backend)."""
    out = torch.empty_like(q)
    start = 0
    seq_lens = (metadata.seq_lens_host if metadata.seq_lens_exact
                else metadata.seq_lens.tolist())
    kv_scales = fp8_scales(kv_cache, kv_scales)
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, seq_lens, strict=True)):
        if q_len > 0:
            out[start:start + q_len] = _sequence_attention(
                q[start:start + q_len], kv_cache, metadata.block_tables[i], seq_len, scale,
                kv_scales)
        start += q_len
    return out


def _sequence_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_len: int, scale: float,
                        kv_scales: LayerKVScales | None) -> torch.Tensor:
    """q [q_len, H, D]: the last q_len tokens of a sequence whose context is seq_len long."""
    q_len, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    pages = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, block_size, Hkv, D]
    pages = _float_pages(pages.reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len], kv_scales)
    keys, values = pages[0].transpose(0, 1), pages[1].transpose(0, 1)  # [Hkv, S, D]
    # Query i sits at absolute position seq_len - q_len + i and sees keys 0..that position.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, S]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads)  # [H, q_len, D]
    return out.transpose(0, 1).to(q.dtype)


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    write_kv = staticmethod(write_kv)
    decode = staticmethod(decode_attention)
    prefill = staticmethod(varlen_attention)
