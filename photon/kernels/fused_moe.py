"""Fused MoE: routed token slots sorted and aligned by expert, then two grouped GEMMs.

1. `moe_align`: the T*k routed (token, slot) pairs are sorted by local expert, each expert's run
   padded to a multiple of BLOCK_M, so every BLOCK_M rows of the sorted list belong to one
   expert. Pure torch ops on the device, sized by upper bounds (no host sync, graph-capturable).
   Slots routed to experts outside this layer's range go to an extra bucket that produces zeros.
2. gate_up GEMM with SiLU-and-mul fused in its epilogue: each program computes a tile of the gate
   and of the up projection for BLOCK_M sorted rows of one expert and stores silu(gate) * up
   [T*k, I] (rounded to the activation dtype, as the torch path rounds each op).
3. down GEMM over the same sorted rows, each row scaled by its routing weight: [T*k, H].
4. The k slots of each token are summed in float32 (torch), then cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon.model.layers.moe import ExpertRange


def moe_align(topk_ids: torch.Tensor, experts: ExpertRange,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_rows], block_expert [max_blocks], rows_used [1]).

    sorted_ids holds flat slot indices (token * k + slot) grouped by local expert, each group
    padded to a multiple of block_m with the sentinel T*k; block_expert[b] is the local expert of
    rows [b*block_m, (b+1)*block_m) (num_local = the out-of-range bucket); rows_used counts the
    padded rows in use. Blocks past rows_used are to be skipped.
    """
    flat = topk_ids.reshape(-1)
    n, buckets = flat.numel(), experts.num_local + 1
    in_range = (flat >= experts.first) & (flat < experts.last)
    local = torch.where(in_range, flat - experts.first, experts.num_local)
    counts = torch.zeros(buckets, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end, count_end = torch.cumsum(padded, 0), torch.cumsum(counts, 0)
    order = torch.argsort(local, stable=True)
    sorted_bucket = local[order]
    rank = torch.arange(n, device=flat.device) - (count_end - counts)[sorted_bucket]
    dest = (padded_end - padded)[sorted_bucket] + rank
    max_rows = n + buckets * (block_m - 1)
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int64, device=flat.device)
    sorted_ids[dest] = order
    blocks = torch.arange(max_rows // block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end // block_m, blocks, right=True)
    block_expert = block_expert.clamp_(max=experts.num_local)
    return sorted_ids, block_expert, padded_end[-1:]


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
                     rows_used_ptr, num_slots, num_local, N, K, stride_am, stride_be, stride_bn,
                     stride_cm, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                     MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[slot, n] = A[slot // A_ROW_DIV] . B[expert, n] over BLOCK_M sorted slots of one expert;
    GATED: B holds [gate; up] (N rows each) and C = silu(gate) * up."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n_lim = tl.where(expert < num_local, N, 0)  # out-of-range bucket: B reads as zeros
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        b_mask = (kk[:, None] < K) & (offs_n[None, :] < n_lim)
        b = tl.load(b_base + kk[:, None], mask=b_mask, other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_base + N * stride_bn + kk[:, None], mask=b_mask, other=0.0)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    out_ty = c_ptr.dtype.element_ty
    if GATED:  # round like the torch path: gate, up, silu(gate) and the product each rounded
        gate = acc.to(out_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = silu * acc_up.to(out_ty).to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + slots, mask=valid, other=0.0)
        acc = acc.to(out_ty).to(tl.float32) * w[:, None]
    c_mask = valid[:, None] & (offs_n[None, :] < N)
    tl.store(c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(out_ty), mask=c_mask)


def _block_m(num_slots: int) -> int:
    return 16 if num_slots <= 256 else 64


def _block(dim: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(dim)))


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                  align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], experts: ExpertRange,
                  block_m: int, *, a_row_div: int, gated: bool) -> None:
    sorted_ids, block_expert, rows_used = align
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    block_n, block_k = _block(n, 64), _block(k, 64)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, out, weights, sorted_ids, block_expert, rows_used, out.shape[0],
        experts.num_local, n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, experts: ExpertRange) -> torch.Tensor:
    """x [T, H], w13 [E_local, 2I, H], w2 [E_local, H, I], topk_weights float32 [T, k],
    topk_ids [T, k] global expert ids -> [T, H] (as photon.model.layers.moe.fused_moe_torch)."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    block_m = _block_m(tokens * top_k)
    align = moe_align(topk_ids, experts, block_m)
    inter = torch.empty(tokens * top_k, w2.shape[2], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter, weights, align, experts, block_m, a_row_div=top_k, gated=True)
    down = torch.empty(tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(inter, w2, down, weights, align, experts, block_m, a_row_div=1, gated=False)
    return down.view(tokens, top_k, -1).float().sum(dim=1).to(x.dtype)
