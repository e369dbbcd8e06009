"""Batched LoRA for a batch mixing adapters (and the base model): shrink and expand kernels
grouped by slot (the SGMV idea, as vLLM's lora_shrink / lora_expand).

The tokens are sorted by slot once per step (`LoRAMeta`) and cut into blocks of BLOCK_M tokens
of one slot each; slot 0 (the base model) gets no blocks. BLOCK_M is 16 for decode-sized batches
and 64 from LARGE_BATCH tokens on (prompt steps): each block reads its slot's A and B once, so
larger blocks read them fewer times per token (a 16-token block of an 8,192-token prompt step
re-reads them 512 times per layer). Every layer then launches:
  shrink: h[s, t, :] = x[t, Ks] @ A[slot(t)][:, Ks].T    grid (block, K split s, rank block)
  expand: out[t, n] += (sum_s h[s, t, :]) @ B[slot(t)][n].T   grid (block, N block)
The shrink splits K into fixed chunks of SPLIT_K columns so a decode batch fills the GPU; each
split writes its own partial sums and the expand adds them in a fixed order, so no atomics are
needed and a token's delta does not depend on the batch it is in (CUDA graphs, which pad the
batch, give the eager forward's bits). Every token belongs to one slot, so the expand's
read-modify-write of `out` never races. The grids depend only on the token count, the slot count
and the shapes, and every index is read on the device: the launches are graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per block below LARGE_BATCH tokens (tl.dot's smallest tile)
LARGE_BLOCK_M = 64  # tokens per block from LARGE_BATCH tokens on
LARGE_BATCH = 1024
BLOCK_K = 64
BLOCK_N = 128
MAX_BLOCK_R = 64  # rank columns per program: bounds the accumulator's registers
SPLIT_K = 512  # input columns per shrink program


@dataclass
class LoRAMeta:
    """The step's tokens grouped by slot (device tensors)."""

    order: torch.Tensor  # [T] token indices sorted by slot (stable)
    starts: torch.Tensor  # [S] each slot's first position in `order`
    counts: torch.Tensor  # [S] tokens of each slot
    block_slot: torch.Tensor  # [B] each block's slot (S past the last block)
    block_pos: torch.Tensor  # [B] each block's first position in `order`
    block_m: int  # tokens per block


def block_m_for(num_tokens: int) -> int:
    """Tokens per block for a forward of `num_tokens` (a function of the token count alone, so
    a CUDA graph of a fixed token count keeps its grids)."""
    return LARGE_BLOCK_M if num_tokens >= LARGE_BATCH else BLOCK_M


def num_blocks(num_tokens: int, num_slots: int, block_m: int = BLOCK_M) -> int:
    """Blocks the grids cover: every slot's count rounded up to block_m, at most."""
    return triton.cdiv(num_tokens, block_m) + num_slots - 1


def lora_meta(token_slots: torch.Tensor, num_slots: int, block_m: int | None = None
              ) -> LoRAMeta:
    """Group the tokens by slot and cut them into blocks on the device (no host sync); blocks
    of `block_m` tokens (default: `block_m_for` the token count)."""
    bm = block_m_for(token_slots.shape[0]) if block_m is None else block_m
    dev = token_slots.device
    order = torch.argsort(token_slots, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, token_slots, torch.ones_like(token_slots))
    starts = torch.cumsum(counts, 0) - counts
    per_slot = (counts + bm - 1) // bm
    per_slot[:1].zero_()  # the base model's tokens need no delta (a device op: graph-safe)
    ends = torch.cumsum(per_slot, 0)
    block = torch.arange(num_blocks(token_slots.shape[0], num_slots, bm), device=dev)
    slot = torch.searchsorted(ends, block, right=True)
    first = (ends - per_slot)[slot.clamp(max=num_slots - 1)]
    pos = starts[slot.clamp(max=num_slots - 1)] + (block - first) * bm
    return LoRAMeta(order, starts, counts, slot, pos, bm)


@triton.jit
def _block_tokens(order_ptr, starts_ptr, counts_ptr, block_slot_ptr, block_pos_ptr, pid, S,
                  BLOCK_M: tl.constexpr):
    """The block's slot, token indices and row mask (slot == S: no block)."""
    slot = tl.load(block_slot_ptr + pid)
    slot_c = tl.minimum(slot, S - 1)
    end = tl.load(starts_ptr + slot_c) + tl.load(counts_ptr + slot_c)
    end = tl.where(slot < S, end, 0)
    rows = tl.load(block_pos_ptr + pid) + tl.arange(0, BLOCK_M)
    valid = rows < end
    tok = tl.load(order_ptr + rows, mask=valid, other=0)
    return slot, tok, valid


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr, counts_ptr, block_slot_ptr,
                   block_pos_ptr, S, K, R, stride_x, stride_as, stride_ar, stride_hs, stride_h,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    pid, split, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, tok, valid = _block_tokens(order_ptr, starts_ptr, counts_ptr, block_slot_ptr,
                                     block_pos_ptr, pid, S, BLOCK_M)
    if slot >= S:
        return
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(split * SPLIT_K, tl.minimum(split * SPLIT_K + SPLIT_K, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :],
                    mask=valid[:, None] & (k[None, :] < K), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=PRECISION)
    tl.store(h_ptr + split * stride_hs + tok[:, None] * stride_h + r[None, :], acc,
             mask=valid[:, None] & (r[None, :] < R))


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr, block_slot_ptr,
                   block_pos_ptr, S, N, R, num_splits, stride_hs, stride_h, stride_bs, stride_bn,
                   stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    pid, nb = tl.program_id(0), tl.program_id(1)
    slot, tok, valid = _block_tokens(order_ptr, starts_ptr, counts_ptr, block_slot_ptr,
                                     block_pos_ptr, pid, S, BLOCK_M)
    if slot >= S:
        return
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        h_mask = valid[:, None] & (r[None, :] < R)
        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for s in range(0, num_splits):  # the shrink's partial sums, in a fixed order
            h += tl.load(h_ptr + s * stride_hs + tok[:, None] * stride_h + r[None, :],
                         mask=h_mask, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                    mask=(n[None, :] < N) & (r[:, None] < R), other=0.0)
        acc = tl.dot(h.to(b.dtype), b, acc, input_precision=PRECISION)
    mask = valid[:, None] & (n[None, :] < N)
    ptrs = out_ptr + tok[:, None] * stride_out + n[None, :]
    cur = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (cur.to(tl.float32) + acc).to(cur.dtype), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 weights get fp32 products (tl.dot rounds fp32 inputs to TF32 by default); the
    # half-precision dtypes the engine serves in are exact in either mode
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(rank: int) -> int:
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))


def _meta_args(meta: LoRAMeta) -> tuple[torch.Tensor, ...]:
    return meta.order, meta.starts, meta.counts, meta.block_slot, meta.block_pos


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
    """h [splits, T, R] float32: each K split's part of x @ A[slot].T per token (rows of
    slot-0 tokens are left unset)."""
    num_tokens, k = x.shape
    slots, rank, _ = a.shape
    splits, block_r = triton.cdiv(k, SPLIT_K), _block_r(rank)
    h = torch.empty(splits, num_tokens, rank, dtype=torch.float32, device=x.device)
    grid = (meta.block_slot.shape[0], splits, triton.cdiv(rank, block_r))
    _shrink_kernel[grid](x, a, h, *_meta_args(meta), slots, k, rank,
                         x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
                         BLOCK_M=meta.block_m, BLOCK_K=BLOCK_K, BLOCK_R=block_r, SPLIT_K=SPLIT_K,
                         PRECISION=_precision(x.dtype))
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, meta: LoRAMeta, out: torch.Tensor) -> None:
    """out[t] += (the sum of h's splits)[t] @ B[slot].T for every token of a slot > 0 (in
    place)."""
    splits = h.shape[0]
    slots, n, rank = b.shape
    grid = (meta.block_slot.shape[0], triton.cdiv(n, BLOCK_N))
    _expand_kernel[grid](h, b, out, *_meta_args(meta), slots, n, rank, splits,
                         h.stride(0), h.stride(1), b.stride(0), b.stride(1), out.stride(0),
                         BLOCK_M=meta.block_m, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(rank),
                         PRECISION=_precision(b.dtype))
