"""The output of `photon bench serve`: the human summary (stderr), the JSON files and the last
stdout line."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def print_human(s: dict[str, Any], extra: Sequence[tuple[str, Any]] = ()) -> None:
    """The run's summary for people (stderr); `extra` rows go before the latencies."""
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration_s"]),
            ("Total input tokens", s["total_input_tokens"]),
            ("Mean / median input tokens", f"{_fmt(s['mean_input_tokens'])} / "
                                           f"{_fmt(s['median_input_tokens'])}"),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", s["request_goodput"]))
    if s["dollars_per_million_output_tokens"] is not None:
        rows.append(("Cost ($ per 1M output tokens)", s["dollars_per_million_output_tokens"]))
    if s["spec_mean_acceptance_length"] is not None:
        rows.append(("Mean acceptance length", s["spec_mean_acceptance_length"]))
        rows.append(("Acceptance per draft position", " ".join(
            f"{r:.3f}" for r in s["spec_acceptance_rate_per_pos"])))
    rows += list(extra)
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows += [(f"{stat.capitalize()} {name.upper()} (ms)", s[f"{stat}_{name}_ms"])
                 for stat in ("mean", "median", "p90", "p99")]
    lines = [f"{'=' * 20} serve: {s['label']} {'=' * 20}"]
    lines += [f"{k:<36}{_fmt(v)}" for k, v in rows]
    lines += [f"error x{e['count']}: {e['error']}" for e in s["errors"]]
    print("\n".join(lines), file=sys.stderr, flush=True)


def file_stem(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "serve"


def emit(ns: argparse.Namespace, last: dict[str, Any], points: list[dict[str, Any]]) -> None:
    """Files, then the last stdout line."""
    line = json.dumps(last)
    if ns.output_json:
        Path(ns.output_json).write_text(line + "\n", encoding="utf-8")
    if ns.output_dir:
        out = Path(ns.output_dir) / f"{file_stem(points[0]['label'])}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(last if "points" in last else sweep_obj(points), indent=1),
                       encoding="utf-8")
        log(f"wrote {out}")
    print(line, flush=True)


def sweep_obj(points: list[dict[str, Any]]) -> dict[str, Any]:
    first = points[0]
    return {"benchmark": "serve_sweep", "label": first["label"], "model": first["model"],
            "sweep": first["sweep"], "points": points}
