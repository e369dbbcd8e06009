"""Batched LoRA for a batch mixing adapters (and the base model): shrink and expand kernels
grouped by slot (the SGMV idea, as vLLM's lora_shrink / lora_expand).

The tokens are sorted by slot once per step (`LoRAMeta`: the order, each slot's first sorted
position and count); every layer then launches a grid of (token block, slot) programs:
  shrink: h[t, :R] = x[t] @ A[slot(t)].T          A [S, R, in], h [T, R] float32
  expand: out[t, n] += h[t, :R] @ B[slot(t)][n].T  B [S, out, R]
Slot 0 is the base model: its programs return at once. Every token belongs to one slot, so the
expand's read-modify-write of `out` never races. The grid depends only on the token count and
the slot count, and every index is read on the device: the launches are graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_K = 32
BLOCK_N = 32


@dataclass
class LoRAMeta:
    """The step's tokens grouped by slot (device tensors)."""

    order: torch.Tensor  # [T] token indices sorted by slot (stable)
    starts: torch.Tensor  # [S] each slot's first position in `order`
    counts: torch.Tensor  # [S] tokens of each slot


def lora_meta(token_slots: torch.Tensor, num_slots: int) -> LoRAMeta:
    """Group the tokens by slot on the device (no host sync: argsort and a scatter-add)."""
    order = torch.argsort(token_slots, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=token_slots.device)
    counts.scatter_add_(0, token_slots, torch.ones_like(token_slots))
    return LoRAMeta(order, torch.cumsum(counts, 0) - counts, counts)


@triton.jit
def _tokens(order_ptr, starts_ptr, counts_ptr, slot, m, BLOCK_M: tl.constexpr):
    count = tl.load(counts_ptr + slot)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < count
    tok = tl.load(order_ptr + tl.load(starts_ptr + slot) + rows, mask=valid, other=0)
    return tok, valid, m * BLOCK_M < count


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr, counts_ptr, K, R,
                   stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    m, slot = tl.program_id(0), tl.program_id(1)
    if slot == 0:
        return
    tok, valid, any_rows = _tokens(order_ptr, starts_ptr, counts_ptr, slot, m, BLOCK_M)
    if not any_rows:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :],
                    mask=valid[:, None] & (k[None, :] < K), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(h_ptr + tok[:, None] * stride_h + r[None, :], acc,
             mask=valid[:, None] & (r[None, :] < R))


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr, N, R,
                   stride_h, stride_bs, stride_bn, stride_out, num_n_blocks,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid, slot = tl.program_id(0), tl.program_id(1)
    if slot == 0:
        return
    m, nb = pid // num_n_blocks, pid % num_n_blocks
    tok, valid, any_rows = _tokens(order_ptr, starts_ptr, counts_ptr, slot, m, BLOCK_M)
    if not any_rows:
        return
    r = tl.arange(0, BLOCK_R)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + tok[:, None] * stride_h + r[None, :],
                mask=valid[:, None] & (r[None, :] < R), other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                mask=(n[None, :] < N) & (r[:, None] < R), other=0.0)
    delta = tl.dot(h, b.to(tl.float32))
    mask = valid[:, None] & (n[None, :] < N)
    ptrs = out_ptr + tok[:, None] * stride_out + n[None, :]
    cur = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (cur.to(tl.float32) + delta).to(cur.dtype), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
    """h [T, R] float32 = x @ A[slot].T per token (rows of slot-0 tokens are left unset)."""
    num_tokens, k = x.shape
    slots, rank, _ = a.shape
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, BLOCK_M), slots)
    _shrink_kernel[grid](x, a, h, meta.order, meta.starts, meta.counts, k, rank,
                         x.stride(0), a.stride(0), a.stride(1), h.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=_block_r(rank))
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, meta: LoRAMeta, out: torch.Tensor) -> None:
    """out[t] += h[t] @ B[slot].T for every token of a slot > 0 (in place)."""
    num_tokens = h.shape[0]
    slots, n, rank = b.shape
    num_n = triton.cdiv(n, BLOCK_N)
    grid = (triton.cdiv(num_tokens, BLOCK_M) * num_n, slots)
    _expand_kernel[grid](h, b, out, meta.order, meta.starts, meta.counts, n, rank,
                         h.stride(0), b.stride(0), b.stride(1), out.stride(0), num_n,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(rank))
