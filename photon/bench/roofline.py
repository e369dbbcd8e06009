"""Memory-bandwidth roofline of a workload's decode, plus GPU ceiling measurements.

Model (`simulate_decode`): all requests arrive together; each step runs
`batch = min(running, max_num_seqs)` requests (FIFO admission as others finish), and every running
request produces one token per step until its output length is reached. A step must read

    weight_bytes + sum(context lengths of the batch) * kv_bytes_per_token

from HBM, with `kv_bytes_per_token = 2 (K, V) * layers * kv_heads * head_dim * dtype_bytes` and the
context of the step that produces output token k (1-based) = prompt_len + k - 1 tokens already in
the KV cache. Every output token (the first one included) is counted as one such decode step.
Prefill is NOT a bandwidth cost here, and attention FLOPs, activations, sampling and launch
overheads are ignored.

Prefill compute (optional, `peak_flops`): `2 * params * prompt_tokens / peak_flops` seconds is
added (tests/test_bench_throughput.py checks the resulting ceilings of the built-in shapes).
Weight bytes are `param_count * dtype_bytes` (`photon.bench.shapes.param_count`: a tied embedding
counted once; an untied one counted twice, embedding + lm_head, although decode only gathers a
few embedding rows). For an MoE shape the weight bytes count every expert (an upper bound: a
decode step reads only the experts its batch routes to, most of them once the batch is a few
dozen requests) and prefill FLOPs count the active parameters (router + top-k experts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelCosts:
    weight_bytes: int  # read once per decode step
    kv_bytes_per_token: int  # K and V of one token, all layers
    param_count: int  # for prefill FLOPs (2 per active parameter per token)


@dataclass(frozen=True)
class DecodeTraffic:
    steps: int  # decode steps (weight reads)
    kv_token_reads: int  # sum over steps of the batch's context lengths


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def shape_costs(name: str, dtype_bytes: int = 2) -> ModelCosts:
    """Costs of a built-in shape (photon.bench.shapes) in a dtype of `dtype_bytes` (bf16: 2)."""
    from photon.bench.shapes import SHAPES, param_count

    c = SHAPES[name]
    kv = kv_bytes_per_token(c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"],
                            dtype_bytes)
    return ModelCosts(param_count(name) * dtype_bytes, kv, param_count(name, active=True))


def simulate_decode(requests: Sequence[tuple[int, int]], max_num_seqs: int) -> DecodeTraffic:
    """Decode steps and KV token reads for (prompt_len, output_len) requests (see module doc)."""
    waiting = deque((p, o) for p, o in requests if o > 0)
    running: list[list[int]] = []  # [context length, tokens left]
    steps = reads = 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            prompt_len, out_len = waiting.popleft()
            running.append([prompt_len, out_len])
        steps += 1
        reads += sum(ctx for ctx, _ in running)
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return DecodeTraffic(steps, reads)


def roofline_time(requests: Sequence[tuple[int, int]], costs: ModelCosts, bandwidth: float,
                  max_num_seqs: int, peak_flops: float | None = None) -> float:
    """Lower bound in seconds: decode bytes / bandwidth (+ prefill FLOPs / peak_flops if given)."""
    traffic = simulate_decode(requests, max_num_seqs)
    weights = traffic.steps * costs.weight_bytes
    seconds = (weights + traffic.kv_token_reads * costs.kv_bytes_per_token) / bandwidth
    if peak_flops:
        seconds += 2 * costs.param_count * sum(p for p, _ in requests) / peak_flops
    return seconds


def roofline_tok_per_s(requests: Sequence[tuple[int, int]], costs: ModelCosts, bandwidth: float,
                       max_num_seqs: int, peak_flops: float | None = None) -> float:
    """Output tokens per second at the roofline (see module doc for what is counted)."""
    output_tokens = sum(o for _, o in requests)
    return output_tokens / roofline_time(requests, costs, bandwidth, max_num_seqs, peak_flops)


def median_cuda_ms(fn: Any, runs: int) -> float:
    import torch

    fn()  # warm-up
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def median_graph_ms(fn: Any, runs: int, calls: int = 10) -> float:
    """Milliseconds per call of `fn`: the median over `runs` replays of one CUDA graph holding
    `calls` calls (a single call timed by events varies by +-20% for microsecond kernels)."""
    import torch

    fn()  # compiles and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_cuda_ms(graph.replay, runs) / calls


def measure_hbm_bandwidth(device: Any = "cuda", nbytes: int = 4 << 30, runs: int = 7) -> float:
    """HBM read bandwidth in bytes/s: median time of a sum over `nbytes` (CUDA only)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_hbm_bandwidth needs a CUDA device, got {device}")
    ms = median_cuda_ms(torch.ones(nbytes // 4, dtype=torch.float32, device=device).sum, runs)
    torch.cuda.empty_cache()  # the 4 GiB buffer is gone: give it back before the engine runs
    return nbytes / (ms / 1e3)


def measure_matmul_flops(device: Any = "cuda", n: int = 8192, runs: int = 7) -> float:
    """Dense bf16 matmul FLOP/s: median time of an n x n x n matmul (CUDA only)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_matmul_flops needs a CUDA device, got {device}")
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = median_cuda_ms(lambda: a @ b, runs)
    return 2 * n**3 / (ms / 1e3)
