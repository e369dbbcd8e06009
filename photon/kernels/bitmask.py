"""Grammar-mask apply in one pass: logits[r, v] = -inf where bit v % 32 of word v // 32 of row r is
clear. The torch path (photon.structured.bitmask.apply_token_bitmask) expands every word into 32
int32 lanes first ([R, V] int32 plus a bool copy): four passes over a vocabulary-sized
intermediate. Here each program reads one block of a row's logits and the words covering it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, vocab, logits_stride, mask_stride,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(mask_ptr + row * mask_stride + offs // 32, mask=inside, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place on float logits [R, V] (unit stride in V) with an int32 bitmask [R, >= V/32]."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.shape[0] == rows
    if rows:
        grid = (rows, triton.cdiv(vocab, BLOCK))
        _apply_bitmask_kernel[grid](logits, bitmask, vocab, logits.stride(0), bitmask.stride(0),
                                    BLOCK=BLOCK, num_warps=4)
    return logits
