"""Triton paged attention: the launchers and the backend (the kernels, their layout and their
FP8 handling: photon/attention/triton_paged_kernels.py).

decode_attention picks its launch (DecodeTuning) from Python ints and dtypes only, and its split
plan likewise, so one CUDA graph per batch size stays valid for every step; varlen_attention runs
prefill, chunked prefill and mixed steps.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton

from photon.attention.backend import AttentionBackend, AttentionMetadata
from photon.attention.kv_quant import LayerKVScales, fp8_scales
from photon.attention.triton_paged_kernels import (
    _decode_reduce_kernel,
    _decode_split_kernel,
    _prefill_kernel,
    _write_kv_kernel,
)
from photon.quant.numerics import FP8_MAX

MAX_SPLITS = 64
MIN_GROUP_PAD = 16  # tl.dot needs every dimension >= 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_ctx: int, num_sms: int,
                      block_n: int) -> tuple[int, int]:
    """(num_splits, tokens_per_split) from Python ints only: about two waves of programs.

    Splits cover the block table's full width (max_ctx positions) in multiples of block_n;
    splits past a sequence's length do no work and weigh zero in the reduce.
    """
    max_ctx = max(max_ctx, 1)
    max_splits = min(MAX_SPLITS, triton.cdiv(max_ctx, block_n))
    want = triton.cdiv(2 * num_sms, max(num_seqs * num_kv_heads, 1))
    splits = max(1, min(want, max_splits))
    tokens_per_split = triton.cdiv(triton.cdiv(max_ctx, splits), block_n) * block_n
    return triton.cdiv(max_ctx, tokens_per_split), tokens_per_split


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 (the default) only affects fp32


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _scale_args(kv_cache: torch.Tensor, kv_scales: LayerKVScales | None
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(K scales, V scales, FP8) kernel arguments; an unquantized cache passes itself as the
    never-read scale pointers."""
    scales = fp8_scales(kv_cache, kv_scales)
    if scales is None:
        return kv_cache, kv_cache, False
    return scales.k, scales.v, True


def _compute_dtype(q: torch.Tensor, kv_cache: torch.Tensor) -> torch.dtype:
    """The dots' operand dtype: the cache's, or q's for an FP8 cache (its tiles are converted)."""
    return q.dtype if kv_cache.element_size() == 1 else kv_cache.dtype


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: LayerKVScales | None = None) -> None:
    """Store k, v [T, Hkv, D] into the cache at slot_mapping (every slot valid; padding -> block 0)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    k_scale, v_scale, fp8 = _scale_args(kv_cache, kv_scales)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, kv_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *_cache_strides(kv_cache), BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), FP8=fp8, FP8_MAX=FP8_MAX,
        ROUND_FIRST=fp8 and _interpreting())


def _block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def _num_stages(dtype: torch.dtype) -> int:
    # K and V tiles are double/triple buffered in shared memory: keep fp32 tiles within budget.
    return 2 if dtype == torch.float32 else 3


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Launch choices of the decode kernel (tools/bench_decode_attention.py sweeps them)."""

    block_n: int
    num_warps: int
    num_stages: int
    fp8_f16: bool  # an FP8 cache's tiles are converted to float16 (else to q's dtype)


def decode_tuning(head_dim: int, kv_cache: torch.Tensor, q: torch.Tensor) -> DecodeTuning:
    dtype = _compute_dtype(q, kv_cache)
    if kv_cache.element_size() == 1 and q.element_size() == 2 and head_dim <= 128:
        # FP8 tiles as float16, 128 positions a tile: the fastest launch on the H200 for both
        # benchmark head layouts (docs/benchmarks.md, "Decode attention kernel")
        return DecodeTuning(block_n=128, num_warps=4, num_stages=3, fp8_f16=True)
    return DecodeTuning(block_n=_block_n(head_dim), num_warps=4, num_stages=_num_stages(dtype),
                        fp8_f16=False)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float,
                     kv_scales: LayerKVScales | None = None,
                     tuning: DecodeTuning | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; one query per sequence at position seq_len - 1."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = _last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    max_ctx = block_tables.shape[1] * block_size
    tune = tuning or decode_tuning(head_dim, kv_cache, q)
    d_pad, block_n = triton.next_power_of_2(head_dim), tune.block_n
    splits, per_split = decode_split_plan(num_seqs, num_kv_heads, max_ctx, _num_sms(q.device),
                                          block_n)
    part_acc = torch.empty((num_seqs, num_heads, splits, d_pad), dtype=torch.float32,
                           device=q.device)
    part_m = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    k_scale, v_scale, fp8 = _scale_args(kv_cache, kv_scales)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, kv_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, k_scale, v_scale,
        scale, max_ctx, per_split, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(kv_cache),
        GROUP=group, GROUP_PAD=max(MIN_GROUP_PAD, triton.next_power_of_2(group)),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, DIRECT=splits == 1, DOT_PREC=_dot_precision(_compute_dtype(q, kv_cache)),
        FP8=fp8, FP8_F16=fp8 and tune.fp8_f16, num_warps=tune.num_warps,
        num_stages=tune.num_stages)
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out, splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
            SPLITS_PAD=triton.next_power_of_2(splits), num_warps=4)
    return out


def varlen_attention(q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                     scale: float, kv_scales: LayerKVScales | None = None) -> torch.Tensor:
    """Causal paged attention for prefill, chunked prefill and mixed steps (eager path)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    max_q_len = max(metadata.query_lens_host, default=0)
    if num_tokens == 0 or max_q_len == 0:
        return out
    q = _last_dim_contiguous(q)
    block_m = min(64, max(16, triton.next_power_of_2(max_q_len)))
    block_tables = metadata.block_tables
    grid = (metadata.num_seqs, triton.cdiv(max_q_len, block_m), num_heads)
    k_scale, v_scale, fp8 = _scale_args(kv_cache, kv_scales)
    dtype = _compute_dtype(q, kv_cache)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, metadata.seq_lens, metadata.query_start_loc, out, k_scale,
        v_scale, scale, block_tables.shape[1] * block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(kv_cache),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=_block_n(head_dim), DOT_PREC=_dot_precision(dtype), FP8=fp8, num_warps=4,
        num_stages=_num_stages(dtype))
    return out


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    # Decode cost follows seq_lens, not the block-table width: one graph per batch size suffices.
    decode_cost_depends_on_width = False
    # varlen_attention's grid comes from the host's query lengths and the block table's shape;
    # lengths and offsets are read on the device (a graph captures bounds: max_q_len = K + 1).
    varlen_capturable = True

    write_kv = staticmethod(write_kv)
    decode = staticmethod(decode_attention)
    prefill = staticmethod(varlen_attention)

    def supports(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda" or _interpreting()
