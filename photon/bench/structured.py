"""`photon bench structured`: decode speed of JSON-schema requests vs the same batch unconstrained.

For each batch size B: B requests under a JSON schema (seeded sampling, so the grammar, not EOS,
ends them) run to completion, pipelined and blocking on the same engine; then the same prompts run
without a grammar, with each request's max_tokens set to the length its constrained twin produced
(EOS ignored), so both batches generate the same number of tokens. Pipelined JSON and plain run
in alternation --repeats times; the pair with the median ratio is reported (and every ratio). Decode tokens/s = generated
tokens / wall time of the batch. Grammars are compiled (and cached) before timing. Each run also
reports its steps and, per step, the wall time, the GPU time (forward + sampling, CUDA events), the
commit's wait for the GPU, the grammar job (accepts and mask fill, in the grammar worker unless
--structured-outputs-worker inline; also its median, 90th percentile and longest), the engine
thread's wait for it and its own work (the rest); and the median and longest iteration
(when it ran, how many requests were running), the time spent in iterations over 10 ms and in
garbage-collector pauses: what makes outliers.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

import torch

from photon.bench.cli import add_model_source_args, bench_engine_args, gpu_info
from photon.engine.engine_core import EngineCore
from photon.sampling_params import SamplingParams
from photon.structured.params import StructuredOutputsParams
from photon.worker.probe import StepProbe

# Long, bounded JSON: an array of up to 12 small records (a few hundred tokens each request).
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 4, "maxItems": 12,
    "items": {"type": "object", "required": ["id", "name", "tags", "score"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}},
}

# The same records without numeric ranges: xgrammar's masks inside a ranged number are far dearer
# per row with a ~120k vocabulary than without the range, so the two schemas bracket the cost.
_NO_RANGES = json.loads(json.dumps(DEFAULT_SCHEMA))
for _key in ("id", "score"):
    for _bound in ("minimum", "maximum"):
        del _NO_RANGES["items"]["properties"][_key][_bound]
SCHEMAS: dict[str, dict[str, Any]] = {"records": DEFAULT_SCHEMA, "records-no-ranges": _NO_RANGES}


def add_parser(sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = sub.add_parser("structured", description=__doc__,
                       help="JSON-schema decode tok/s, pipelined vs blocking vs unconstrained.",
                       formatter_class=RawDescriptionHelpFormatter)
    add_model_source_args(p, default_shape=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128],
                   help="Batch sizes B to time.")
    p.add_argument("--prompt-len", type=int, default=64, help="Prompt tokens per request.")
    p.add_argument("--max-output-tokens", type=int, default=1024,
                   help="Cap on a request's output (the schema should end it first).")
    p.add_argument("--schema", default="records", metavar="NAME|FILE",
                   help=f"JSON schema: a built-in ({', '.join(SCHEMAS)}) or a file.")
    p.add_argument("--repeats", type=_positive_int, default=3,
                   help="Pipelined JSON / plain pairs per batch size (the median is reported).")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write all rows to this file.")
    from photon.cli import add_engine_args

    add_engine_args(p)
    p.set_defaults(func=run_structured)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class StepLog:
    """Iteration times of a run and the collector's pauses during it (both explain outliers)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []  # (start, seconds, rows in flight)
        self.gc_s = 0.0
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start

    def __enter__(self) -> StepLog:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def summary(self, prefix: str) -> dict[str, Any]:
        times = sorted(t for _, t, _ in self.steps)
        start, slowest, rows = max(self.steps, key=lambda s: s[1])
        return {f"{prefix}_step_ms_p50": 1e3 * times[len(times) // 2],
                f"{prefix}_step_ms_max": 1e3 * slowest,
                f"{prefix}_slowest_step": {"index": [s[0] for s in self.steps].index(start),
                                           "running": rows, "unix_time": start},
                f"{prefix}_ms_in_steps_over_10ms": 1e3 * sum(t for t in times if t > 0.01),
                f"{prefix}_gc_ms": 1e3 * self.gc_s}


def run_batch(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
               log: StepLog | None = None) -> tuple[list[int], float, Counter[str]]:
    """Run to completion; return each request's output length, the wall time and the count of
    each finish reason (a grammar request must end with "stop" or "length", never "abort").
    `log` receives every iteration's time."""
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = [core.add_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
    lengths: dict[str, int] = {}
    reasons: Counter[str] = Counter()
    while core.has_unfinished():
        t_step, unix = time.perf_counter(), time.time()
        outs = core.step()
        if log is not None:
            log.steps.append((unix, time.perf_counter() - t_step, len(core.scheduler.running)))
        for out in outs:
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
                reasons[str(out.outputs[0].finish_reason)] += 1
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return [lengths[i] for i in ids], time.perf_counter() - t0, reasons


def _timed_run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
               depth: int, prefix: str) -> tuple[list[int], dict[str, Any]]:
    """One timed batch with a StepProbe attached: tok/s and where a step's time goes (GPU forward
    + sampling, the commit's wait for the GPU, the grammar-mask fill on the host)."""
    runner = core.runner
    core.pipeline.depth = depth
    probe = StepProbe(runner.device)
    runner.probe = probe
    clock = core.structured.executor.clock
    clock.recent.clear()
    job_s, wait_s, steps = clock.total_s, core.grammar.wait_s, core.scheduler.num_steps
    try:
        with StepLog() as log:
            lengths, wall, reasons = run_batch(core, prompts, params, log)
    finally:
        runner.probe = None
    n = max(1, core.scheduler.num_steps - steps)
    ms = 1e3 / n
    mask_wait_s = core.grammar.wait_s - wait_s
    row = {f"{prefix}_tok_per_s": sum(lengths) / wall, f"{prefix}_steps": n,
           f"{prefix}_ms_per_step": wall * ms, f"{prefix}_gpu_ms_per_step": probe.gpu_seconds() * ms,
           f"{prefix}_wait_ms_per_step": probe.wait_s * ms,
           # the engine thread's own work: the iteration minus its waits (GPU, grammar job)
           f"{prefix}_host_ms_per_step": (wall - probe.wait_s - mask_wait_s) * ms,
           f"{prefix}_mask_fill_ms_per_step": (clock.total_s - job_s) * ms,
           f"{prefix}_mask_wait_ms_per_step": mask_wait_s * ms,
           **_job_tail(prefix, sorted(clock.recent)), **log.summary(prefix)}
    if params[0].structured_outputs is not None:
        row[f"{prefix}_finish_reasons"] = dict(reasons)
    return lengths, row


def _job_tail(prefix: str, jobs: list[float]) -> dict[str, float]:
    """Median, 90th percentile and longest grammar job of a run (sorted seconds), in ms."""
    if not jobs:
        return {}
    return {f"{prefix}_job_ms_p50": 1e3 * jobs[len(jobs) // 2],
            f"{prefix}_job_ms_p90": 1e3 * jobs[(9 * len(jobs)) // 10],
            f"{prefix}_job_ms_max": 1e3 * jobs[-1]}


def grammar_batch(batch: int, schema: dict[str, Any], prompt_len: int, max_tokens: int
                  ) -> tuple[list[list[int]], list[SamplingParams]]:
    """The benchmark's B seeded random prompts, each under `schema` (temperature 1)."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(batch)]
    spec = StructuredOutputsParams(json=schema)
    return prompts, [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                    structured_outputs=spec) for i in range(batch)]


def warm_up(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Compile the grammar and the kernels outside the timing; twice, because the timed runs
    repeat prompts and a prefix-cache hit gives prefill a shape (a Triton variant) of its own.
    The grammar worker's boot and the compile are waited for first: stepping meanwhile would
    only poll them (and take a core from them on a small machine)."""
    timeout_s = core.config.structured_outputs.timeout_s
    core.structured.start(wait_s=timeout_s)
    spec = params[0].structured_outputs
    if spec is not None:
        core.structured.compile(spec).result(timeout=timeout_s)
    for _ in range(2):
        run_batch(core, prompts[:2], params[:2])


def measure(core: EngineCore, batch: int, schema: dict[str, Any], ns: argparse.Namespace
            ) -> dict[str, Any]:
    """Blocking JSON and plain once; pipelined JSON and plain alternately `ns.repeats` times
    (a run's host and GPU speed drift between runs: one pair alone is a noisy ratio). The row
    reports the pair with the median ratio, and every pair's ratio."""
    prompts, grammar = grammar_batch(batch, schema, ns.prompt_len, ns.max_output_tokens)
    warm_up(core, prompts, grammar)
    lengths, row = _timed_run(core, prompts, grammar, 1, "json_blocking")
    row = {"batch_size": batch} | row
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
             for i, n in enumerate(lengths)]
    row |= _timed_run(core, prompts, plain, 1, "plain_blocking")[1]
    pairs = []
    for _ in range(ns.repeats):
        pair = _timed_run(core, prompts, grammar, 2, "json_pipelined")[1]
        pair |= _timed_run(core, prompts, plain, 2, "plain_pipelined")[1]
        pair["pipelined_json_vs_plain"] = \
            pair["json_pipelined_tok_per_s"] / pair["plain_pipelined_tok_per_s"]
        pairs.append(pair)
    ratios = [p["pipelined_json_vs_plain"] for p in pairs]
    row |= sorted(pairs, key=lambda p: p["pipelined_json_vs_plain"])[len(pairs) // 2]
    row["pipelined_json_vs_plain_each"] = ratios
    row["mean_output_tokens"] = sum(lengths) / len(lengths)
    return row


def run_structured(ns: argparse.Namespace) -> int:
    from photon.llm import LLM

    if ns.model is None and ns.model_shape is None:
        ns.model_shape = "qwen3-0.6b" if torch.cuda.is_available() else "tiny"
    if ns.max_model_len is None:
        ns.max_model_len = ns.prompt_len + ns.max_output_tokens + 8
    ns.max_num_seqs = max(ns.max_num_seqs, *ns.batch_sizes)
    schema = SCHEMAS.get(ns.schema)
    if schema is None:
        with open(ns.schema, encoding="utf-8") as f:
            schema = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**asdict(bench_engine_args(ns, tmp)))
    rows = []
    for batch in ns.batch_sizes:
        row = measure(llm.engine, batch, schema, ns)
        rows.append(row)
        print(json.dumps(row), flush=True)
        each = ", ".join(f"{r:.0%}" for r in row["pipelined_json_vs_plain_each"])
        print(f"B={batch}: json pipelined {row['json_pipelined_tok_per_s']:.0f} tok/s "
              f"({row['pipelined_json_vs_plain']:.0%} of unconstrained, median of {each})",
              file=sys.stderr)
    summary = {"benchmark": "structured", "model_shape": ns.model_shape, "schema": ns.schema,
               "rows": rows,
               **gpu_info(ns.device)}
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0
