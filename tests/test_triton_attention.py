"""Triton paged attention vs the torch reference backend.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before anything imports a kernel), in float32 with tight tolerances and small shapes. The GPU
cases (bf16/fp16, long contexts, big batches, CUDA-graph replay) need a CUDA GPU (marked `gpu`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from photon.attention import triton_paged
from photon.attention.backend import AttentionMetadata, create_backend
from photon.attention.torch_ref import TorchReferenceBackend
from photon.attention.triton_paged import TritonPagedBackend, decode_split_plan

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
CPU_TOL = 1e-4
GPU_TOL = 2e-2

# (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1/2/4/8, head dims 32/64/128,
# block sizes 4/8/16/32 (the tiny model's shape is 4/2/32 with block_size 4 in some tests).
# MHA / GQA / MQA, head dims 128 / 64 / 32, block sizes 8 / 32 / 4 (the interpreter is slow)
CPU_SHAPES = [(4, 4, 128, 8), (8, 2, 64, 32), (8, 1, 32, 4)]


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, *, dtype: torch.dtype = torch.float32, device: str = DEVICE,
              width: int | None = None, pad_rows: int = 0, seed: int = 0) -> Case:
    """specs: (context length after the step, query length) per sequence, then `pad_rows` graph
    padding rows (seq_len 1, table of zeros, slot 0 of the null block). Pages are shuffled."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-ctx // block_size) for ctx, _ in specs]
    width = width or max(pages + [1])
    num_blocks = sum(pages) + 4  # + the null block and a few never-used blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(specs) + pad_rows, width, dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for i, ((ctx, q_len), n) in enumerate(zip(specs, pages)):
        tables[i, :n] = torch.tensor(ids[used:used + n], dtype=torch.int32)
        used += n
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]
    seq_lens = [ctx for ctx, _ in specs] + [1] * pad_rows
    q_lens = [q_len for _, q_len in specs] + [1] * pad_rows
    slots += [0] * pad_rows
    tokens = sum(q_lens)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rand(tokens, num_heads, head_dim), rand(tokens, num_kv_heads, head_dim), rand(
        tokens, num_kv_heads, head_dim)
    if pad_rows:  # padding rows all write slot 0: same values, so the cache stays deterministic
        k[-pad_rows:], v[-pad_rows:] = k[-pad_rows].clone(), v[-pad_rows].clone()
    cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                              device=device),
        query_start_loc=starts.to(device), seq_lens_host=seq_lens, query_lens_host=q_lens,
        decode_only=all(n == 1 for n in q_lens))
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return Case(cast(q), cast(k), cast(v), cast(cache), meta, head_dim ** -0.5)


def check(case: Case, tol: float) -> None:
    ref_cache, out_cache = case.cache.clone(), case.cache.clone()
    ref = TorchReferenceBackend().forward(case.q, case.k, case.v, ref_cache, case.meta, case.scale)
    out = TritonPagedBackend().forward(case.q, case.k, case.v, out_cache, case.meta, case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out_cache, ref_cache)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _contexts(block_size: int) -> list[int]:
    bs = block_size
    return [1, 2, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 5, 300]


def test_kernels_are_interpreted_without_cuda() -> None:
    if CUDA:
        pytest.skip("with CUDA present the kernels are compiled, not interpreted: nothing to check")
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(triton_paged._decode_split_kernel, InterpretedFunction)


def test_registry_and_auto() -> None:
    assert isinstance(create_backend("triton", DEVICE), TritonPagedBackend)
    assert create_backend("auto", "cpu").name == "torch"
    assert create_backend("auto", "cuda").name == "triton"
    assert TritonPagedBackend.decode_cost_depends_on_width is False


@pytest.mark.parametrize("num_seqs", [1, 3, 8, 64, 256])
@pytest.mark.parametrize("max_ctx", [1, 16, 300, 4096, 131072])
def test_decode_split_plan(num_seqs: int, max_ctx: int) -> None:
    splits, per_split = decode_split_plan(num_seqs, 8, max_ctx, 132, 64)
    assert 1 <= splits <= triton_paged.MAX_SPLITS and per_split % 64 == 0
    assert (splits - 1) * per_split < max_ctx <= splits * per_split
    if num_seqs * 8 >= 2 * 132:
        assert splits == 1


@pytest.mark.parametrize("num_sms", [1, 32], ids=["one_split", "split_k"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_decode(shape: tuple[int, int, int, int], num_sms: int,
                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_paged, "_num_sms", lambda device: num_sms)
    h, kv, d, bs = shape
    check(make_case([(c, 1) for c in _contexts(bs)], h, kv, d, bs), CPU_TOL)


@pytest.mark.parametrize("num_sms", [1, 32], ids=["one_split", "split_k"])
def test_decode_wide_table_and_padded_rows(num_sms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph-style step: full-width tables (most pages unused) and padding rows at the end."""
    monkeypatch.setattr(triton_paged, "_num_sms", lambda device: num_sms)
    check(make_case([(5, 1), (70, 1), (129, 1)], 8, 2, 64, 16, width=40, pad_rows=3), CPU_TOL)


def test_decode_rows_through_the_varlen_kernel() -> None:
    case = make_case([(c, 1) for c in _contexts(16)], 4, 2, 64, 16, pad_rows=2)
    case.meta.decode_only = False
    check(case, CPU_TOL)


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_prefill(shape: tuple[int, int, int, int]) -> None:
    h, kv, d, bs = shape
    check(make_case([(1, 1), (bs, bs), (37, 37), (130, 130)], h, kv, d, bs), CPU_TOL)


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_chunked_prefill_with_cached_prefix(shape: tuple[int, int, int, int]) -> None:
    """Part of each context is already in the cache (prefix hit or an earlier chunk)."""
    h, kv, d, bs = shape
    specs = [(300, 40), (2 * bs, bs), (bs + 3, 2), (100, 99), (70, 64)]
    check(make_case(specs, h, kv, d, bs), CPU_TOL)


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_mixed_prefill_and_decode(shape: tuple[int, int, int, int]) -> None:
    h, kv, d, bs = shape
    specs = [(1, 1), (45, 1), (200, 33), (bs, 1), (20, 20), (bs + 1, 1)]
    check(make_case(specs, h, kv, d, bs), CPU_TOL)


def test_head_dim_not_a_power_of_two() -> None:
    check(make_case([(1, 1), (50, 1), (99, 1)], 4, 2, 48, 16), CPU_TOL)
    check(make_case([(50, 20), (33, 33), (9, 1)], 4, 2, 48, 16), CPU_TOL)


def test_noncontiguous_q_k_v() -> None:
    """q/k/v as head views of one fused qkv projection, as the model hands them over."""
    case = make_case([(40, 10), (17, 1)], 4, 2, 64, 8)
    qkv = torch.cat([case.q, case.k, case.v], dim=1)
    case.q, case.k, case.v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    check(case, CPU_TOL)


# ---- GPU: half precision, long contexts, big batches, CUDA graphs --------------------------------

GPU_SHAPES = [(32, 8, 128, 16), (16, 2, 64, 32), (16, 16, 128, 16), (32, 4, 128, 32)]


def _gpu_contexts(num: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    fixed = [1, 2, 15, 16, 17, 4095, 4096]
    rand = torch.randint(1, 4097, (max(num - len(fixed), 0),), generator=gen).tolist()
    return (fixed + rand)[:num]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_gpu_decode(shape: tuple[int, int, int, int], num_seqs: int, dtype: torch.dtype) -> None:
    h, kv, d, bs = shape
    ctx = [4096] if num_seqs == 1 else _gpu_contexts(num_seqs, num_seqs)
    case = make_case([(c, 1) for c in ctx], h, kv, d, bs, dtype=dtype, width=4096 // bs,
                     pad_rows=3)
    check(case, GPU_TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "h{}_kv{}_d{}_bs{}".format(*s))
def test_gpu_prefill_chunked_and_mixed(shape: tuple[int, int, int, int], dtype: torch.dtype
                                       ) -> None:
    h, kv, d, bs = shape
    specs = [(4096, 512), (1000, 1000), (3000, 1), (17, 1), (2048, 100), (1, 1), (777, 777),
             (4096, 1), (600, 64)]
    check(make_case(specs, h, kv, d, bs, dtype=dtype), GPU_TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [1, 16, 64])
def test_gpu_decode_cuda_graph_replay(num_seqs: int) -> None:
    """Capture once at full table width; replay with new lengths/inputs == eager on the same."""
    h, kv, d, bs, width = 32, 8, 128, 16, 256
    case = make_case([(width * bs, 1)] * num_seqs, h, kv, d, bs, dtype=torch.bfloat16,
                     width=width)
    backend = TritonPagedBackend()
    graph_cache, eager_cache = case.cache.clone(), case.cache.clone()
    static_q, static_k, static_v = case.q.clone(), case.k.clone(), case.v.clone()
    meta = case.meta
    for cache in (graph_cache, eager_cache):  # compiles the kernels; keeps the caches equal
        backend.forward(static_q, static_k, static_v, cache, meta, case.scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, graph_cache, meta, case.scale)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        seq_lens = torch.randint(1, width * bs + 1, (num_seqs,), generator=gen)
        seq_lens[0] = 1 if step == 0 else width * bs
        pos = seq_lens - 1
        blocks = meta.block_tables.cpu().gather(1, (pos // bs)[:, None].int()).view(-1)
        slots = blocks.long() * bs + pos % bs
        q, k, v = (torch.randn_like(t) for t in (static_q, static_k, static_v))
        meta.seq_lens.copy_(seq_lens.to(torch.int32))
        meta.slot_mapping.copy_(slots)
        for dst, src in ((static_q, q), (static_k, k), (static_v, v)):
            dst.copy_(src)
        graph.replay()
        eager_meta = AttentionMetadata(meta.slot_mapping.clone(), meta.block_tables,
                                       meta.seq_lens.clone(), meta.query_start_loc,
                                       seq_lens.tolist(), [1] * num_seqs, True)
        eager = backend.forward(q, k, v, eager_cache, eager_meta, case.scale)
        ref = TorchReferenceBackend().forward(q, k, v, eager_cache.clone(), eager_meta,
                                              case.scale)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        assert torch.equal(graph_cache, eager_cache)
        torch.testing.assert_close(eager.float(), ref.float(), atol=GPU_TOL, rtol=GPU_TOL)
