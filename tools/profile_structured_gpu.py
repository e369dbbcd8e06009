"""GPU timeline of `photon bench structured`'s batches under torch.profiler: per step, the compute
stream's kernel time by class and by kernel name, and its idle gaps, each gap charged to the kernel
that ended it (a gap before the grammar-mask apply is the GPU waiting for the host's grammar job;
before the first kernel of a forward, for plan and launch).

Usage: python tools/profile_structured_gpu.py [--batches 32 128] [--schema records] [--out DIR]
Prints one JSON object per (batch, run); with --out, also writes them to DIR/profile_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from typing import Any

import torch

from photon.bench.profile import classify
from photon.bench.shapes import materialize_shape
from photon.bench.structured import SCHEMAS, grammar_batch, run_batch, warm_up
from photon.engine.engine_core import EngineCore
from photon.llm import LLM
from photon.sampling_params import SamplingParams

GAP_US = 5.0  # shorter gaps are launch latency inside a graph, not waiting


def _kernel_class(name: str) -> str:
    return "bitmask" if "bitmask" in name else classify(name)


def _compute_stream_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    events = [e for e in trace["traceEvents"]
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    streams = Counter(e["args"].get("stream") for e in events if e.get("cat") == "kernel")
    compute = streams.most_common(1)[0][0]
    return sorted((e for e in events if e["args"].get("stream") == compute), key=lambda e: e["ts"])


def _timeline(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    by_class: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    gap_before: Counter[str] = Counter()
    idle, end = 0.0, events[0]["ts"]
    for e in events:
        gap = e["ts"] - end
        if gap > GAP_US:
            idle += gap
            gap_before[e["name"][:70]] += gap
        by_class[_kernel_class(e["name"]) if e["cat"] == "kernel" else e["cat"]] += e["dur"]
        by_name[e["name"][:70]] += e["dur"]
        end = max(end, e["ts"] + e["dur"])
    span = end - events[0]["ts"]
    per = 1e-3 / steps
    return {"steps": steps, "span_ms_per_step": span * per, "idle_ms_per_step": idle * per,
            "busy_ms_per_step": {k: v * per for k, v in by_class.most_common()},
            "top_kernels_ms_per_step": {k: v * per for k, v in by_name.most_common(15)},
            "idle_before_ms_per_step": {k: v * per for k, v in gap_before.most_common(12)}}


def profile_run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
                depth: int) -> dict[str, Any]:
    core.pipeline.depth = depth
    steps0 = core.scheduler.num_steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        lengths, wall, _ = run_batch(core, prompts, params)
    steps = core.scheduler.num_steps - steps0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    return {"wall_ms_per_step": 1e3 * wall / steps, "tok_per_s": sum(lengths) / wall,
            **_timeline(_compute_stream_events(trace), steps)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--schema", default="records", choices=sorted(SCHEMAS))
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=materialize_shape(ns.shape, tmp), load_format="dummy",
                  max_num_seqs=max(ns.batches), max_model_len=1200)
    core = llm.engine
    results = []
    for batch in ns.batches:
        prompts, grammar = grammar_batch(batch, SCHEMAS[ns.schema], 64, 1024)
        warm_up(core, prompts, grammar)
        lengths, _, _ = run_batch(core, prompts, grammar)
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                 for i, n in enumerate(lengths)]
        for name, params, depth in (("json_pipelined", grammar, 2), ("json_blocking", grammar, 1),
                                    ("plain_pipelined", plain, 2)):
            row = {"batch": batch, "run": name, **profile_run(core, prompts, params, depth)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if ns.out:
        with open(os.path.join(ns.out, "profile_gpu.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
