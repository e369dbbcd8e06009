"""`photon bench serve`: online serving benchmark against an OpenAI-compatible server.

Prompts come from --dataset-name: random token ids (default), sharegpt (--dataset-path, read as
vLLM reads ShareGPT JSON), standard, or multiturn (chats whose turns carry their history, with
the servers' prefix hit rate; photon.bench.serve_multiturn). On the chat endpoint a random prompt of N tokens is a
message whose prompt after the chat template is exactly N tokens (sized with the server's
/tokenize, or --tokenizer DIR); the report gives the input tokens the server counted.
Requests arrive by --request-rate (Poisson, or gamma with --burstiness; inf = all at once) and/or
are capped by --max-concurrency; each streams with EOS ignored so output lengths are controlled.
Reports TTFT, TPOT, ITL and E2E latency (mean/std/median/p90/p99, ms), request/token throughput
and goodput under --goodput SLOs. --sweep R1 R2 ... (or --sweep-concurrency C1 C2 ...) runs a
ladder and plots the latency-throughput frontier; --plot-from draws several runs on one plot.
With a speculative server, the run's mean acceptance length and per-position acceptance come from
its /metrics counters read before and after the run (photon.bench.serve_spec).
A human summary goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from photon.bench.cli import add_cost_args, check_cost_args, cost_fields, require
from photon.bench.datasets import add_dataset_args, check_dataset_args
from photon.bench.serve_metrics import aggregate, arrival_offsets, parse_goodput
from photon.bench.serve_multiturn import add_multiturn_args, check_multiturn_args, run_multiturn
from photon.bench.serve_report import emit, file_stem, print_human, sweep_obj
from photon.bench.serve_report import log as _log

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
WARMUP_MAX_TOKENS = 16
DEFAULT_VOCAB_SIZE = 10000  # random token ids when the server does not report its vocabulary


def add_parser(bench_sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = bench_sub.add_parser("serve", help="Online serving benchmark "
                             "(TTFT/TPOT/ITL, goodput, frontier sweeps) against a server.",
                             description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    _add_server_args(p)
    _add_workload_args(p)
    add_multiturn_args(p)
    _add_load_args(p)
    _add_report_args(p)
    p.set_defaults(func=run_serve)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=os.environ.get("PHOTON_BASE_URL", DEFAULT_BASE_URL),
                   help=f"Server URL (env PHOTON_BASE_URL, default {DEFAULT_BASE_URL}).")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default; token-id prompts) or /v1/chat/completions.")
    g.add_argument("--api-key", default=None,
                   help="Bearer token (default: env PHOTON_API_KEY, then OPENAI_API_KEY).")
    g.add_argument("--model", default=None, help="Model name (default: first of GET /v1/models).")
    g.add_argument("--wait-server", type=float, default=0.0, metavar="S",
                   help="Retry GET /v1/models for up to S seconds until the server is up.")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, metavar="S",
                   help="Per-request timeout in seconds (default 6 h).")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="Requests per run (default 200; 256 for standard; a --dataset "
                        "JSONL's rows).")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="Prompt tokens of a random request.")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="Output tokens of a random request (EOS is ignored).")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [len*(1-r), len*(1+r)] (0 <= r < 1; default 0).")
    g.add_argument("--random-vocab-size", type=int, default=None,
                   help="Random token ids are in [0, this). Default: the vocab_size the server "
                        f"reports in GET /v1/models (photon does), else {DEFAULT_VOCAB_SIZE}.")
    add_dataset_args(g)
    g.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrivals.")
    g.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature.")
    g.add_argument("--warmup-requests", type=int, default=1,
                   help=f"Untimed requests first (up to {WARMUP_MAX_TOKENS} tokens; default 1): "
                        "one alone, then the rest at once, so batched shapes get compiled too.")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests/s (default inf: all at once).")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of inter-arrival times (1 = Poisson; <1 burstier).")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight (default: no cap).")
    sweep = g.add_mutually_exclusive_group()
    sweep.add_argument("--sweep", "--sweep-rates", dest="sweep", type=float, nargs="+",
                       default=None, metavar="RATE", help="Run a ladder of request rates.")
    sweep.add_argument("--sweep-concurrency", type=int, nargs="+", default=None, metavar="C",
                       help="Run a ladder of --max-concurrency values (request rate inf).")


def _add_report_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (ms).")
    g.add_argument("--label", default=None, help="Name of this series (default: the model).")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write the last JSON line to PATH.")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="Write LABEL.json (all points) and, for sweeps, LABEL.png here.")
    g.add_argument("--save-requests", action="store_true",
                   help="Keep per-request records in the JSON (under 'requests').")
    g.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                   help="Only plot: merge these runs' series into --plot-output.")
    g.add_argument("--plot-output", default="serve_frontier.png", metavar="PNG",
                   help="Where --plot-from draws.")
    g.add_argument("--plot-panels", nargs="+", default=None, metavar="METRIC",
                   help="Y metrics, one panel each (default median_tpot_ms p99_ttft_ms).")
    add_cost_args(g, num_gpus_flag=True)


def run_serve(ns: argparse.Namespace) -> int:
    if ns.plot_from:
        return _plot_only(ns)
    _check_args(ns)
    slos = parse_goodput(ns.goodput)
    pairs = _load_pairs(ns)  # a bad --dataset-path fails before the server is asked anything
    try:
        cfg, served = asyncio.run(_client_config(ns))
    except Exception as e:  # unreachable server, bad /v1/models: a message, not a traceback
        _log(f"cannot use {ns.base_url}/v1/models: {type(e).__name__}: {e} "
             "(is the server up? --wait-server S waits for it)")
        return 1
    if ns.dataset_name == "multiturn":
        return run_multiturn(ns, cfg, served, slos)
    ns.random_vocab_size = _vocab_size(ns, served)
    specs = _requests(ns, cfg, pairs)
    _check_fits(specs, served, ns.dataset_name)
    if not asyncio.run(warmup(cfg, specs, ns.warmup_requests)):
        return 1
    loads = _loads(ns)
    points = [_run_point(ns, cfg, specs, rate, conc, slos) for rate, conc in loads]
    if ns.sweep or ns.sweep_concurrency:
        return _finish_sweep(ns, points)
    emit(ns, points[0], points)
    return 0


def _check_args(ns: argparse.Namespace) -> None:
    if ns.num_prompts is not None and ns.num_prompts <= 0:
        raise ValueError(f"--num-prompts must be positive, got {ns.num_prompts}")
    for rate in [ns.request_rate, *(ns.sweep or [])]:
        if not rate > 0:
            raise ValueError(f"request rates must be positive (or inf), got {rate}")
    for conc in [ns.max_concurrency, *(ns.sweep_concurrency or [])]:
        if conc is not None and conc <= 0:
            raise ValueError(f"concurrency must be positive, got {conc}")
    if not ns.burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {ns.burstiness}")
    if ns.random_vocab_size is not None and ns.random_vocab_size < 1:
        raise ValueError(f"--random-vocab-size must be positive, got {ns.random_vocab_size}")
    check_dataset_args(ns)
    check_multiturn_args(ns)  # before the server is asked anything
    check_cost_args(ns)
    require("aiohttp", "photon bench serve")
    if (ns.sweep or ns.sweep_concurrency) and ns.output_dir:
        require("matplotlib", "plotting the sweep (--output-dir)")


async def _client_config(ns: argparse.Namespace) -> tuple[Any, Any]:
    """The client's settings, and the served model's card (None when not fetched: --model and
    --random-vocab-size given, nothing to wait for)."""
    from photon.bench.serve_client import ClientConfig, wait_for_models

    key = ns.api_key or os.environ.get("PHOTON_API_KEY") or os.environ.get("OPENAI_API_KEY")
    cfg = ClientConfig(ns.base_url, ns.endpoint, ns.model or "", key, ns.temperature,
                       ns.request_timeout)
    served = None
    if ns.wait_server > 0 or not ns.model or ns.random_vocab_size is None:
        models = await wait_for_models(cfg, ns.wait_server)
        if not models:
            raise RuntimeError(f"{cfg.base_url}/v1/models lists no model; pass --model")
        cfg.model = cfg.model or models[0].id
        served = next((m for m in models if m.id == cfg.model), models[0])
    _log(f"server {cfg.url}, model {cfg.model}")
    return cfg, served


def _vocab_size(ns: argparse.Namespace, served: Any) -> int:
    """--random-vocab-size, else the server's vocabulary, else DEFAULT_VOCAB_SIZE."""
    if ns.random_vocab_size is not None:
        return int(ns.random_vocab_size)
    if served is not None and served.vocab_size:
        _log(f"random token ids in [0, {served.vocab_size}): the server's vocab_size")
        return int(served.vocab_size)
    return DEFAULT_VOCAB_SIZE


def _load_pairs(ns: argparse.Namespace) -> list[Any] | None:
    from photon.bench.datasets import load_sharegpt

    if ns.dataset_name != "sharegpt":
        return None
    pairs = load_sharegpt(ns.dataset_path, ns.seed)
    _log(f"{ns.dataset_path}: {len(pairs)} ShareGPT conversations")
    return pairs


_FIT_HINTS = {"random": "lower --random-input-len / --random-output-len",
              "sharegpt": "lower --sharegpt-output-len or serve a longer --max-model-len"}


def _check_fits(specs: list[Any], served: Any, dataset: str) -> None:
    """Every request with a known prompt length fits the server's max_model_len (else each
    would fail with 400 after the warm-up)."""
    limit = served.max_model_len if served is not None else None
    if limit is None:
        return
    too_long = [s for s in specs if s.prompt_len is not None
                and s.prompt_len + s.output_len > limit]
    if too_long:
        worst = max(too_long, key=lambda s: s.prompt_len + s.output_len)
        raise ValueError(
            f"{len(too_long)} of {len(specs)} requests do not fit the server's max_model_len of "
            f"{limit} tokens (the longest: {worst.prompt_len} prompt + {worst.output_len} output "
            f"tokens); {_FIT_HINTS.get(dataset, 'serve a longer --max-model-len')}")


def _requests(ns: argparse.Namespace, cfg: Any, pairs: list[Any] | None) -> list[Any]:
    from photon.bench.datasets import DatasetOptions, build_requests

    opts = DatasetOptions(ns.dataset_name, ns.dataset_path, ns.num_prompts, ns.random_input_len,
                          ns.random_output_len, ns.random_range_ratio, ns.random_vocab_size,
                          ns.seed, ns.sharegpt_output_len, ns.tokenizer)
    specs = asyncio.run(build_requests(opts, cfg, pairs, _log))
    known = [s.prompt_len for s in specs if s.prompt_len is not None]
    _log(f"{len(specs)} requests: {sum(known)} prompt tokens (known), "
         f"{sum(s.output_len for s in specs)} output tokens")
    return specs


async def warmup(cfg: Any, specs: list[Any], count: int) -> bool:
    """Untimed short requests, the first alone and the rest concurrently (a server's first
    batched prefills may compile kernels); False (after logging why) when any fails."""
    from dataclasses import replace

    from photon.bench.serve_client import make_session, send_request

    if count <= 0:
        return True
    shorts = [replace(s, output_len=min(s.output_len, WARMUP_MAX_TOKENS))
              for s in (specs[i % len(specs)] for i in range(count))]
    async with make_session(cfg, len(shorts)) as session:
        records = [await send_request(session, cfg, shorts[0], 0.0)]
        if records[0].success:
            records += await asyncio.gather(*(send_request(session, cfg, s, 0.0)
                                              for s in shorts[1:]))
    failed = [r for r in records if not r.success]
    if failed:
        _log(f"warm-up request failed: {failed[0].error}")
        return False
    _log(f"warm-up: {len(records)} request(s) ok")
    return True


def _loads(ns: argparse.Namespace) -> list[tuple[float, int | None]]:
    """(request rate, max concurrency) of every run."""
    if ns.sweep:
        return [(rate, ns.max_concurrency) for rate in ns.sweep]
    if ns.sweep_concurrency:
        return [(ns.request_rate, conc) for conc in ns.sweep_concurrency]
    return [(ns.request_rate, ns.max_concurrency)]


def _run_point(ns: argparse.Namespace, cfg: Any, specs: list[Any], rate: float,
               conc: int | None, slos: dict[str, float]) -> dict[str, Any]:
    from photon.bench.serve_client import run_requests
    from photon.bench.serve_spec import (
        fetch_settled_spec_counters,
        fetch_spec_counters,
        spec_delta_fields,
    )

    _log(f"run: request rate {rate}, burstiness {ns.burstiness}, max concurrency {conc}")
    offsets = arrival_offsets(len(specs), rate, ns.burstiness, ns.seed)
    spec_before = asyncio.run(fetch_spec_counters(cfg))
    records, duration = asyncio.run(run_requests(cfg, specs, offsets, conc))
    spec = spec_delta_fields(spec_before, asyncio.run(fetch_settled_spec_counters(cfg)))
    metrics = aggregate(records, duration, slos)
    summary = {"benchmark": "serve", **metrics, **spec,
               **cost_fields(ns.gpu_cost_per_hour, ns.num_gpus, metrics["output_throughput"]),
               **_params(ns, cfg, rate, conc, slos, len(specs))}
    if ns.save_requests:
        from dataclasses import asdict

        summary["requests"] = [asdict(r) for r in records]
    print_human(summary)
    if ns.sweep or ns.sweep_concurrency:
        print(json.dumps(summary), flush=True)
    return summary


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _params(ns: argparse.Namespace, cfg: Any, rate: float, conc: int | None,
            slos: dict[str, float], num: int) -> dict[str, Any]:
    sweep = "request_rate" if ns.sweep else "max_concurrency" if ns.sweep_concurrency else None
    return {
        "label": ns.label or cfg.model, "model": cfg.model, "base_url": cfg.base_url,
        "endpoint": cfg.endpoint, "request_rate": _json_rate(rate), "burstiness": ns.burstiness,
        "max_concurrency": conc, "num_prompts": num, "seed": ns.seed, "sweep": sweep,
        "dataset": ns.dataset, "dataset_name": ns.dataset_name, "dataset_path": ns.dataset_path,
        "sharegpt_output_len": ns.sharegpt_output_len, "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len, "random_range_ratio": ns.random_range_ratio,
        "random_vocab_size": ns.random_vocab_size, "temperature": ns.temperature,
        "goodput_slos_ms": slos or None,
    }


def _finish_sweep(ns: argparse.Namespace, points: list[dict[str, Any]]) -> int:
    from photon.bench.frontier import DEFAULT_PANELS, plot_frontier

    obj = sweep_obj(points)
    if ns.output_dir:
        png = Path(ns.output_dir) / f"{file_stem(obj['label'])}.png"
        obj["plot"] = plot_frontier({obj["label"]: points}, str(png),
                                    ns.plot_panels or DEFAULT_PANELS)
        _log(f"wrote {png}")
    emit(ns, obj, points)
    return 0


def _plot_only(ns: argparse.Namespace) -> int:
    from photon.bench.frontier import DEFAULT_PANELS, load_series, plot_frontier

    require("matplotlib", "plotting the latency-throughput frontier (--plot-from)")
    missing = [path for path in ns.plot_from if not Path(path).is_file()]
    if missing:
        raise ValueError(f"--plot-from: no such file: {', '.join(missing)}")
    series = load_series(ns.plot_from)
    path = plot_frontier(series, ns.plot_output, ns.plot_panels or DEFAULT_PANELS)
    _log(f"wrote {path}: " + ", ".join(f"{k} ({len(v)} points)" for k, v in series.items()))
    print(json.dumps({"benchmark": "serve_plot", "plot": path, "inputs": ns.plot_from,
                      "series": {k: len(v) for k, v in series.items()}}), flush=True)
    return 0
