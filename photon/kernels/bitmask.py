"""Grammar-mask apply in one pass (layout: photon.structured.bitmask): logits[r, v] = -inf where
bit v % 32 of word v // 32 of row r is clear, and for ids past the row's words where the row's tail
flag is 0. The torch path (photon.structured.bitmask.apply_token_bitmask) expands every word into
32 int32 lanes first ([R, V] int32 plus a bool copy): four passes over a vocabulary-sized
intermediate. Here each program reads one block of a row's logits and the words covering it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon.structured.bitmask import TokenMask

BLOCK = 2048


@triton.jit
def allowed(bits_row_ptr, tail, cols, covered):
    """Whether the grammar mask of one row allows token ids `cols`: bit `cols % 32` of word
    `cols // 32` for ids below `covered`, the row's `tail` flag for the ids past them."""
    in_bits = cols < covered
    w = tl.load(bits_row_ptr + cols // 32, mask=in_bits, other=0)
    tail_ok = (cols * 0 + tail) != 0
    return (in_bits & (((w >> (cols % 32)) & 1) != 0)) | (~in_bits & tail_ok)


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bits_ptr, tail_ptr, vocab, covered, logits_stride,
                          words, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    ok = allowed(bits_ptr + row * words, tl.load(tail_ptr + row), offs, covered)
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & ~ok)


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """In place on float logits [R, V] (unit stride in V); mask.bits contiguous [R, W] int32."""
    rows, vocab = logits.shape
    bits, tail = mask.bits, mask.tail
    assert logits.stride(1) == 1 and bits.dtype == torch.int32 and bits.is_contiguous()
    assert bits.shape[0] == rows and tail.shape == (rows,)
    if rows:
        grid = (rows, triton.cdiv(vocab, BLOCK))
        covered = min(vocab, 32 * bits.shape[1])
        _apply_bitmask_kernel[grid](logits, bits, tail, vocab, covered, logits.stride(0),
                                    bits.shape[1], BLOCK=BLOCK, num_warps=4)
    return logits
