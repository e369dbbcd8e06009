"""`photon bench bubble`: where a decode step's time goes, pipelined vs blocking, same run.

For each batch size: B requests are prefilled, warmed up, then N decode steps are timed with a
StepProbe attached. Per step we report GPU time (forward + sampling, CUDA events), host time (the
iteration's wall time minus its commit wait), wall time, GPU-busy fraction and decode tokens/s,
for blocking (depth 1) and pipelined (depth 2) on the same engine and weights. The cost model
predicts blocking = host + GPU and pipelined = max(host, GPU); we print its predicted gain next to
the measured one. Without a GPU the columns say "device" (the CPU) instead of "gpu", and the
defaults are CPU-sized: the tiny shape, fewer and smaller batches, fewer steps.
A progress bar on stderr counts the timed runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch
from tqdm.auto import tqdm

from photon.bench.cli import (
    add_model_source_args,
    bench_engine_args,
    device_label,
    gpu_info,
    on_cuda,
)
from photon.engine.engine_core import EngineCore
from photon.sampling_params import SamplingParams
from photon.worker.probe import StepProbe

# (CUDA, CPU) defaults
BATCH_SIZES = ([1, 8, 32, 128, 256], [1, 8, 32])
STEPS = (64, 32)
WARMUP_STEPS = (8, 4)
MODEL_SHAPES = ("qwen3-0.6b", "tiny")


def _both(values: tuple[Any, Any]) -> str:
    return f"{_show(values[0])} on CUDA, {_show(values[1])} on CPU"


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def add_parser(sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = sub.add_parser("bubble", help="Pipeline bubble: per-step GPU/host/wall time, "
                       "pipelined vs blocking.", description=__doc__,
                       formatter_class=RawDescriptionHelpFormatter)
    add_model_source_args(p, default_shape=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help=f"Batch sizes B to time (default {_both(BATCH_SIZES)}).")
    p.add_argument("--prompt-len", type=int, default=128, help="Prompt tokens per request.")
    p.add_argument("--steps", type=int, default=None,
                   help=f"Timed decode steps per run (default {_both(STEPS)}).")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help=f"Untimed decode steps before each run (default {_both(WARMUP_STEPS)}).")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy sampling.")
    p.add_argument("--output-mode", choices=("final", "delta"), default="final",
                   help="final: outputs only at the end (offline LLM.generate); delta: every "
                        "step streams new tokens and text per request (as the server does).")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write all rows to this file.")
    from photon.cli import add_engine_args

    add_engine_args(p)
    p.set_defaults(func=run_bubble, max_model_len=None)
    p.epilog = f"Default --model-shape when no --model is given: {_both(MODEL_SHAPES)}."


def _cpu_sized_defaults(ns: argparse.Namespace) -> None:
    side = 0 if on_cuda(ns.device) else 1
    if ns.model is None and ns.model_shape is None:
        ns.model_shape = MODEL_SHAPES[side]
    for name, values in (("batch_sizes", BATCH_SIZES), ("steps", STEPS),
                         ("warmup_steps", WARMUP_STEPS)):
        if getattr(ns, name) is None:
            setattr(ns, name, values[side])


def decode_len_needed(ns: argparse.Namespace, batch: int) -> int:
    """max_model_len that fits a prompt plus every token _start_batch may generate."""
    prefill_steps = -(-batch * ns.prompt_len // ns.max_num_batched_tokens)
    return ns.prompt_len + prefill_steps + ns.warmup_steps + ns.steps + 16


def _sync(core: EngineCore) -> None:
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()


def _start_batch(core: EngineCore, batch: int, ns: argparse.Namespace,
                 loras: list[Any] | None = None) -> list[str]:
    """`batch` requests prefilled until each decodes, then the warm-up steps; request i runs
    with adapter loras[i] (None: the base model)."""
    rng = random.Random(batch)
    # Early requests decode while later ones prefill: leave room so that none finishes early.
    budget = core.config.scheduler.max_num_batched_tokens
    prefill_steps = -(-batch * ns.prompt_len // budget)
    max_tokens = prefill_steps + ns.warmup_steps + ns.steps + 8
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(3, 1000) for _ in range(ns.prompt_len)]
        params = SamplingParams(temperature=ns.temperature, seed=i, max_tokens=max_tokens,
                                ignore_eos=True, detokenize=True)
        delta = ns.output_mode == "delta"
        ids.append(core.add_request(prompt, params, stream=delta, delta=delta,
                                    lora_request=loras[i] if loras else None))
    while any(not r.output_token_ids for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill until every request decodes
    for _ in range(ns.warmup_steps):
        core.step()
    return ids


def measure(core: EngineCore, batch: int, depth: int, ns: argparse.Namespace,
            label: str = "gpu") -> dict[str, Any]:
    """One timed run; `label` names the accelerator's columns ("gpu", or "device" on CPU)."""
    assert core.pipeline.idle and not core.scheduler.has_unfinished()
    core.pipeline.depth = depth  # same engine and weights for both modes (only while idle)
    ids = _start_batch(core, batch, ns)
    _sync(core)
    probe = StepProbe(core.runner.device)
    core.runner.probe = probe
    t0 = time.perf_counter()
    for _ in range(ns.steps):
        core.step()
    loop_s = time.perf_counter() - t0
    _sync(core)
    wall_s = time.perf_counter() - t0
    core.runner.probe = None
    gpu_s = probe.gpu_seconds()
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    n = ns.steps
    host_s = loop_s - probe.wait_s
    if core.runner.device.type != "cuda":
        host_s -= gpu_s  # on CPU the forward and sampling run inline in the host thread
    return {f"{label}_ms": 1e3 * gpu_s / n, "host_ms": 1e3 * host_s / n,
            "wall_ms": 1e3 * wall_s / n, f"{label}_busy": gpu_s / wall_s,
            "decode_tok_per_s": batch * n / wall_s}


def _row(batch: int, blocking: dict[str, Any], pipelined: dict[str, Any],
         label: str) -> dict[str, Any]:
    host, gpu = blocking["host_ms"], blocking[f"{label}_ms"]
    return {
        "batch_size": batch,
        "blocking": blocking,
        "pipelined": pipelined,
        "predicted_gain": (host + gpu) / max(host, gpu),
        "measured_gain": blocking["wall_ms"] / pipelined["wall_ms"],
    }


def run_bubble(ns: argparse.Namespace) -> int:
    from photon.llm import LLM

    _cpu_sized_defaults(ns)
    if ns.max_model_len is None:
        ns.max_model_len = decode_len_needed(ns, max(ns.batch_sizes))
    ns.max_num_seqs = max(ns.max_num_seqs, *ns.batch_sizes)
    with tempfile.TemporaryDirectory() as tmp:
        args = bench_engine_args(ns, tmp)
        llm = LLM(**asdict(args))
    core = llm.engine
    label = device_label(llm.config.device)
    rows = []
    bar = tqdm(total=2 * len(ns.batch_sizes), desc="bench bubble runs", file=sys.stderr,
               dynamic_ncols=True)
    try:
        for batch in ns.batch_sizes:
            rows.append(_measure_batch(core, batch, ns, label, bar))
    finally:
        bar.close()
    summary = {"benchmark": "bubble", "model_shape": ns.model_shape, "model": args.model,
               "output_mode": ns.output_mode,
               "prompt_len": ns.prompt_len, "steps": ns.steps,
               "enforce_eager": args.enforce_eager, "rows": rows, **gpu_info(llm.config.device)}
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0


def _measure_batch(core: EngineCore, batch: int, ns: argparse.Namespace, label: str,
                   bar: Any) -> dict[str, Any]:
    """Blocking then pipelined at batch size `batch`; prints the row (JSON) and a summary."""
    blocking = measure(core, batch, 1, ns, label)
    bar.update(1)
    pipelined = measure(core, batch, 2, ns, label)
    bar.update(1)
    row = _row(batch, blocking, pipelined, label)
    print(json.dumps(row), flush=True)
    bar.write(f"B={batch}: blocking {blocking['wall_ms']:.2f} ms/step, pipelined "
              f"{pipelined['wall_ms']:.2f} ms/step ({label} busy {pipelined[f'{label}_busy']:.1%}), "
              f"gain {row['measured_gain']:.2f}x vs predicted {row['predicted_gain']:.2f}x",
              file=sys.stderr)
    return row
