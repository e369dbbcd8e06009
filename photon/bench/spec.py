"""`photon bench spec`: speculative decoding against no speculation, by batch size, K and method.

For each engine setting (no speculation; each method x K x adaptive off/on) one engine is built
and reused for every batch size B, smallest first: N x B greedy requests (EOS ignored,
`--output-len` tokens each, or lengths drawn around it with `--output-len-range-ratio`, the same
for every setting; N = `--requests-per-slot`, at least `--min-requests` in all) in one
`LLM.generate` call with at most B
running at once, after a warm-up generate of 2 x B requests (B at a time, `--warmup-tokens`
tokens and half as many, alternately, so that it refills too). Requests finish at different
steps when speculating (their acceptance differs); refilling the batch keeps it at B, as a
server's would be, instead of ending every cell with a tail of a few slow rows. Reusing the
engine across B does not change what is measured: prefix caching is off (the same prompts
return at every B and in the warm-up, and a cache hit would skip their prefill), and greedy
tokens do not depend on the engine's history. The one state that carries over is the adaptive
switch's (its measured step times per batch-size bucket and running acceptance counts), as in a
server that has been running; its warm-up at each B lets it measure that B.

Paired runs (`--paired`, the default): the no-speculation engine, built first, stays alive
beside each speculative engine, and each speculative cell's timed call is framed by a timed call
of the same requests on it, right before and right after. The cell's speedup and T(B, 0) come
from those two runs, so a machine whose speed drifts from one minute to the next (host clocks,
other tenants) shifts both sides of the ratio alike; the no-speculation cells of the table are
its own cells, measured first. `--repeats N` times each paired cell N times, alternating with
N + 1 baseline calls: each call's speedup is over the two around it, and the cell's is the
median of those, for a comparison whose noise must be below a single pair's (the adaptive
switch's 3%).

Each cell reports output tokens/s (output tokens / wall time of the generate call, prefill
included), the speculative counters of the timed call (mean acceptance length, per-position
acceptance), the median decode step time by K_eff, the speedup over no speculation at the same
B, and the speedup the cost model predicts (photon.bench.spec_report). Stdout: a table, then one
JSON line (also written to `--output-json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from photon.bench.serve_workload import length_bounds
from photon.bench.spec_report import (
    NO_SPEC,
    Cell,
    SpecSetting,
    StepRecorder,
    Timed,
    cell_of,
    fill_speedups,
    output_lengths,
    pair_cell,
    settings,
    table,
)

DEFAULT_BATCH_SIZES = (1, 4, 16, 64, 256)
DEFAULT_KS = (1, 2, 3, 4, 5)


def add_parser(bench_sub: Any) -> None:
    from photon.bench.cli import add_model_source_args
    from photon.cli import add_engine_args

    p = bench_sub.add_parser(
        "spec", help="Speculative decoding vs none, by batch size, K and method.",
        description="Run B concurrent greedy requests (EOS ignored) for each batch size, with "
                    "no speculation and with each method (ngram; draft_model with --draft) and "
                    "K, adaptive switch off and on; report output tokens/s, acceptance, the "
                    "speedup over no speculation at the same B and the cost model's predicted "
                    "speedup. One engine per setting, reused for every batch size, prefix "
                    "caching off. Stdout: a table, then one JSON line.")
    g = p.add_argument_group("matrix and workload")
    g.add_argument("--draft", default=None, metavar="DIR",
                   help="Draft model for method draft_model (default: ngram only).")
    g.add_argument("--methods", nargs="+", default=None, choices=("ngram", "draft_model"),
                   help="Methods to run (default: ngram, and draft_model when --draft is given).")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES),
                   metavar="B", help="Concurrent requests per cell (default 1 4 16 64 256).")
    g.add_argument("--num-speculative-tokens", type=int, nargs="*", default=list(DEFAULT_KS),
                   metavar="K", help="K values with the adaptive switch off: every step verifies "
                                     "K drafts (default 1 2 3 4 5; none: no such cells).")
    g.add_argument("--adaptive-num-speculative-tokens", type=int, nargs="*", default=None,
                   metavar="K", help="K values with the adaptive switch on (default: those of "
                                     "--num-speculative-tokens; none: no such cells).")
    g.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                   help="The ngram cells' prompt_lookup_min (default: the engine's, 5, or "
                        "--prompt-lookup-max when only that is given).")
    g.add_argument("--prompt-lookup-max", type=int, default=None, metavar="M",
                   help="The ngram cells' prompt_lookup_max (default: the engine's, 5, or "
                        "--prompt-lookup-min when only that is given).")
    g.add_argument("--data", default=None, metavar="DIR",
                   help="A `python -m photon.train prepare` directory: prompts are windows of "
                        "its held-out code (default: random token ids).")
    g.add_argument("--input-len", type=int, default=128, help="Prompt tokens (default 128).")
    g.add_argument("--output-len", type=int, default=128,
                   help="Output tokens per request (default 128).")
    g.add_argument("--output-len-range-ratio", type=float, default=0.0, metavar="R",
                   help="Draw each request's output length uniformly from [output_len x (1 - R), "
                        "output_len x (1 + R)] (seeded by --prompt-seed; default 0: every request "
                        "--output-len tokens). With equal lengths the requests without "
                        "speculation finish on the same step and their batch refills at once; "
                        "speculative ones finish apart.")
    g.add_argument("--requests-per-slot", type=int, default=4, metavar="N",
                   help="Each cell runs N x B requests, at most B at a time: a finished request's "
                        "place is taken by the next, so the batch stays at B until the last B "
                        "(default 4; 1: one batch of B that ends with its slowest request).")
    g.add_argument("--min-requests", type=int, default=16, metavar="M",
                   help="Each cell runs at least M requests (default 16): at B = 1 and 4 the "
                        "N x B of --requests-per-slot are a few requests, and how much a "
                        "request's output repeats its prompt (ngram's acceptance) differs from "
                        "one to the next.")
    g.add_argument("--warmup-tokens", type=int, default=16,
                   help="Output tokens of the longer warm-up requests (0: no warm-up; default "
                        "16).")
    g.add_argument("--paired", action=argparse.BooleanOptionalAction, default=True,
                   help="Time the no-speculation engine right before and after each "
                        "speculative cell (it stays alive beside the cell's engine) and take "
                        "the cell's speedup and T(B, 0) from those runs (default on; "
                        "--no-paired: from the no-speculation cells, measured first).")
    g.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="Time each cell N times, alternating with the paired no-speculation "
                        "runs (N + 1 of them, needs --paired): the cell's speedup is the median "
                        "of the N ratios, each over the two runs around it (`speedup_rounds` in "
                        "the JSON; default 1).")
    g.add_argument("--control", action="store_true",
                   help="Also run a second no-speculation engine as a setting (`control`), "
                        "paired like the speculative ones: its speedup is 1 but for the "
                        "machine's run-to-run noise, which it shows beside the other cells.")
    g.add_argument("--prompt-seed", type=int, default=0,
                   help="Seed of the random prompts (default 0).")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write the JSON summary to PATH.")
    add_model_source_args(p, default_shape=None)
    add_engine_args(p)
    p.set_defaults(func=run_spec)


def _log(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def _methods(ns: argparse.Namespace) -> list[str]:
    methods = ns.methods or (["ngram"] + (["draft_model"] if ns.draft else []))
    if "draft_model" in methods and not ns.draft:
        raise ValueError("--methods draft_model needs --draft DIR (the draft model)")
    return list(dict.fromkeys(methods))


def _lookup(ns: argparse.Namespace) -> tuple[int, int]:
    """The ngram cells' (prompt_lookup_min, prompt_lookup_max), checked and defaulted by the
    engine's own speculative config."""
    from photon.spec.config import SpeculativeConfig

    config = SpeculativeConfig("ngram", 1, prompt_lookup_min=ns.prompt_lookup_min,
                               prompt_lookup_max=ns.prompt_lookup_max)
    assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
    return config.prompt_lookup_min, config.prompt_lookup_max


def _check_args(ns: argparse.Namespace) -> None:
    if ns.speculative_config is not None:
        raise ValueError("--speculative-config is set by the benchmark per cell; use --methods, "
                         "--num-speculative-tokens, --draft and --adaptive")
    if ns.adaptive_num_speculative_tokens is None:
        ns.adaptive_num_speculative_tokens = list(ns.num_speculative_tokens)
    _lookup(ns)  # the engine's own checks of the prompt-lookup bounds
    for flag, values in (("--batch-sizes", ns.batch_sizes),
                         ("--num-speculative-tokens", ns.num_speculative_tokens),
                         ("--adaptive-num-speculative-tokens",
                          ns.adaptive_num_speculative_tokens)):
        if values and min(values) < 1:
            raise ValueError(f"{flag} must be at least 1, got {values}")
    if not ns.batch_sizes:
        raise ValueError("--batch-sizes needs at least one batch size")
    if ns.repeats < 1 or (ns.repeats > 1 and not ns.paired):
        raise ValueError(f"--repeats must be at least 1, and above 1 only with --paired, got "
                         f"{ns.repeats}")
    for flag, value in (("--requests-per-slot", ns.requests_per_slot),
                        ("--min-requests", ns.min_requests)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if max(ns.batch_sizes) > ns.max_num_seqs:
        raise ValueError(f"--batch-sizes {max(ns.batch_sizes)} exceeds --max-num-seqs "
                         f"{ns.max_num_seqs}: raise --max-num-seqs")
    if not 0.0 <= ns.output_len_range_ratio < 1.0:
        raise ValueError(f"--output-len-range-ratio must be in [0, 1), got "
                         f"{ns.output_len_range_ratio}")
    for flag, value, low in (("--input-len", ns.input_len, 1), ("--output-len", ns.output_len, 1),
                             ("--warmup-tokens", ns.warmup_tokens, 0)):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")


def run_spec(ns: argparse.Namespace) -> int:
    from photon.bench.cli import bench_engine_args

    _check_args(ns)
    matrix = settings(_methods(ns), sorted(set(ns.num_speculative_tokens)),
                      sorted(set(ns.adaptive_num_speculative_tokens)), ns.control,
                      _lookup(ns))
    batch_sizes = sorted(set(ns.batch_sizes))
    cells: list[Cell] = []
    errors: list[dict[str, str]] = []
    baseline: _Engine | None = None
    with tempfile.TemporaryDirectory(prefix="photon-bench-") as workdir:
        args = _engine_args(bench_engine_args(ns, workdir), ns)
        count = _cell_requests(ns, max(batch_sizes))
        prompts, source = _prompts(ns, args, count)
        lengths = output_lengths(count, ns.output_len, ns.output_len_range_ratio, ns.prompt_seed)
        work = _Workload(prompts, lengths, batch_sizes, ns)
        for setting in matrix:
            try:
                got, kept = _run_setting(args, setting, work, baseline)
                cells += got
                baseline = kept or baseline
            except Exception as e:  # noqa: BLE001 - the other settings still run and report
                errors.append({"setting": setting.label, "error": f"{type(e).__name__}: {e}"})
                _log(f"{setting.label} failed: {errors[-1]['error']}")
            # Written after every setting, so a run stopped part-way keeps what it measured.
            _summary_line(ns, args, source, cells, errors, complete=False)
        del baseline
        _free_memory()
    line = _summary_line(ns, args, source, cells, errors, complete=True)
    print(table(cells), flush=True)
    print(line, flush=True)
    return 1 if errors else 0


def _summary_line(ns: argparse.Namespace, args: Any, source: str, cells: list[Cell],
                  errors: list[dict[str, str]], complete: bool) -> str:
    """The JSON summary (also written to --output-json)."""
    from photon.bench.cli import gpu_info

    fill_speedups(cells)
    summary = {"benchmark": "spec", "date": time.strftime("%Y-%m-%d"), "complete": complete,
               "model": args.model, "draft": ns.draft, "prompts": source,
               "input_len": ns.input_len, "output_len": ns.output_len,
               "output_len_range_ratio": ns.output_len_range_ratio,
               "requests_per_slot": ns.requests_per_slot, "min_requests": ns.min_requests,
               "warmup_tokens": ns.warmup_tokens, "batch_sizes": sorted(set(ns.batch_sizes)),
               "num_speculative_tokens": sorted(set(ns.num_speculative_tokens)),
               "adaptive_num_speculative_tokens": sorted(set(ns.adaptive_num_speculative_tokens)),
               "methods": _methods(ns), **gpu_info(args.device), "errors": errors,
               **dict(zip(("prompt_lookup_min", "prompt_lookup_max"), _lookup(ns))),
               "cells": [dataclasses.asdict(c) for c in cells]}
    line = json.dumps(summary)
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return line


def _engine_args(args: Any, ns: argparse.Namespace) -> Any:
    """Prefix caching off (see the module doc); max_model_len fits the requests by default."""
    args.enable_prefix_caching = False
    if args.max_model_len is None:
        longest = length_bounds(ns.output_len, ns.output_len_range_ratio)[1]
        args.max_model_len = ns.input_len + longest + ns.warmup_tokens
    return args


def _prompts(ns: argparse.Namespace, args: Any, count: int) -> tuple[list[list[int]], str]:
    from photon.bench.spec_prompts import (
        heldout_code_prompts,
        random_prompts,
        trained_tokenizer_sha,
    )
    from photon.model.hf_config import load_hf_config
    from photon.model.tiny import resolve_model_path

    model_dir = resolve_model_path(args.model)
    if ns.data:
        return heldout_code_prompts(ns.data, count, ns.input_len, model_dir), "heldout"
    if trained_tokenizer_sha(model_dir) is not None:
        _log("the model is photon-trained: --data DIR (its prepared data) gives held-out code "
             "prompts; using random token ids")
    vocab = int(load_hf_config(model_dir)["vocab_size"])
    return random_prompts(count, ns.input_len, vocab, ns.prompt_seed), "random"


@dataclass
class _Workload:
    prompts: list[list[int]]
    lengths: list[int]
    batch_sizes: list[int]
    ns: argparse.Namespace

    def at(self, b: int) -> tuple[list[list[int]], list[int]]:
        """The requests of a cell of batch size `b`."""
        n = _cell_requests(self.ns, b)
        return self.prompts[:n], self.lengths[:n]


def _cell_requests(ns: argparse.Namespace, b: int) -> int:
    """Requests of a cell of batch size `b`: N x B, at least --min-requests."""
    return max(ns.requests_per_slot * b, ns.min_requests)


@dataclass
class _Engine:
    llm: Any
    recorder: StepRecorder

    def timed(self, prompts: list[list[int]], lengths: list[int], b: int) -> Timed:
        """One timed generate call at most `b` requests at a time. The commits recorded are
        the call's alone."""
        self.llm.engine.scheduler.max_running = b
        self.recorder.commits.clear()
        _sync(self.llm)
        start = time.perf_counter()
        got = _generate(self.llm, prompts, lengths)
        _sync(self.llm)
        elapsed = time.perf_counter() - start
        if got != sum(lengths):
            raise RuntimeError(f"generated {got} output tokens, the cell asked for "
                               f"{sum(lengths)}")
        return Timed(got, elapsed, self.recorder.step_times(b),
                      *self.recorder.time_by_kind(b))


def _build(args: Any, setting: SpecSetting, draft: str | None) -> _Engine:
    from photon.llm import LLM

    kwargs = dataclasses.asdict(args)
    kwargs["speculative_config"] = setting.speculative_config(draft)
    llm = LLM(**kwargs)
    scheduler = llm.engine.scheduler
    recorder = StepRecorder(setting.k, scheduler.spec_policy)
    scheduler.spec_policy = recorder
    return _Engine(llm, recorder)


def _run_setting(args: Any, setting: SpecSetting, work: _Workload, baseline: _Engine | None
                 ) -> tuple[list[Cell], _Engine | None]:
    """The setting's cells, and its engine when it is the paired runs' baseline (no
    speculation with --paired: kept alive for the settings after it)."""
    start = time.perf_counter()
    engine = _build(args, setting, work.ns.draft)
    _log(f"engine {setting.label}: built in {time.perf_counter() - start:.1f} s")
    keep = work.ns.paired and setting.method == NO_SPEC
    try:
        pair = None if setting.method == NO_SPEC else baseline
        cells = [_run_cell(engine, setting, work, b, pair) for b in work.batch_sizes]
    except BaseException:
        keep = False
        raise
    finally:
        if not keep:
            del engine
            _free_memory()
    return cells, engine if keep else None


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # The next engine sizes its KV cache from the free memory: a leak would shrink it.
        _log(f"engine freed: {torch.cuda.memory_allocated() / 2**20:.0f} MiB still allocated")


def _sync(llm: Any) -> None:
    import torch

    if llm.config.device == "cuda":
        torch.cuda.synchronize()


def _generate(llm: Any, prompts: list[list[int]], lengths: list[int]) -> int:
    """Greedy outputs of lengths[i] tokens (EOS ignored) for prompts[i]; the tokens generated."""
    from photon.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


def _warm_up(llm: Any, prompts: list[list[int]], b: int, tokens: int) -> None:
    """2 x B requests, B at a time, every other one half as long: the short ones' places are
    refilled while the others decode, so the warm-up runs the mixed prefill + decode steps of a
    timed cell too, and compiles their kernels' variants for this B before the clock starts (a
    cell with refills would otherwise pay them, the first engine of a run most)."""
    count = 2 * b
    _generate(llm, [prompts[i % len(prompts)] for i in range(count)],
              [tokens if i % 2 == 0 else max(1, tokens // 2) for i in range(count)])


def _run_cell(engine: _Engine, setting: SpecSetting, work: _Workload, b: int,
              baseline: _Engine | None) -> Cell:
    """One cell: the warm-up, then its timed call (paired: `--repeats` of them, each framed by
    the baseline's)."""
    llm, ns = engine.llm, work.ns
    prompts, lengths = work.at(b)
    if ns.warmup_tokens:
        llm.engine.scheduler.max_running = b
        _warm_up(llm, prompts, b, ns.warmup_tokens)
    base = [baseline.timed(prompts, lengths, b)] if baseline is not None else []
    before = llm.engine.spec_stats()
    runs = []
    for _ in range(ns.repeats if baseline is not None else 1):
        runs.append(engine.timed(prompts, lengths, b))
        if baseline is not None:
            base.append(baseline.timed(prompts, lengths, b))
    cell = cell_of(setting, b, runs)
    cell.guard_verdicts = engine.recorder.guard_verdicts()
    if base:
        pair_cell(cell, runs, base)
    after = llm.engine.spec_stats()
    if after is not None:
        stats = after.since(before)
        cell.mean_acceptance_length = stats.mean_acceptance_length
        cell.acceptance_rate_per_pos = stats.acceptance_rate_per_pos
        cell.num_drafts, cell.num_draft_tokens = stats.num_drafts, stats.num_draft_tokens
        cell.num_accepted_tokens = stats.num_accepted_tokens
    _log(f"{setting.label} B={b}: {cell.output_tokens_per_s:.1f} tok/s"
         + (f", mean acceptance length {cell.mean_acceptance_length:.3f}" if after else "")
         + (f", baseline {cell.baseline_tokens_per_s:.1f} tok/s"
            if cell.baseline_tokens_per_s else ""))
    return cell
