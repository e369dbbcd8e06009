"""Latency-throughput frontier plots of `photon bench serve` runs (matplotlib, Agg backend).

x: output token throughput (tok/s); one panel per latency metric (default median TPOT and p99
TTFT, in ms); one line per labelled series, each point marked with its request rate or
concurrency. Inputs are the JSON files `bench serve` writes: a sweep object with "points", a single
run's summary, or JSON lines of summaries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_PANELS = ("median_tpot_ms", "p99_ttft_ms")
_LOG_PANELS = ("ttft", "e2el")  # queueing makes these span orders of magnitude


def read_points(path: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the file's label, its run summaries) from a sweep object, a summary or JSON lines."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        objs = [json.loads(text)]
    except json.JSONDecodeError:
        objs = [json.loads(line) for line in text.splitlines() if line.strip()]
    label, points = None, []
    for obj in objs:
        if "points" in obj:
            label = obj.get("label") or label
            points.extend(obj["points"])
        elif obj.get("benchmark") == "serve":
            points.append(obj)
    return label, points


def load_series(paths: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """label -> points, merged over files (a file's label, else its points', else its name)."""
    series: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        label, points = read_points(path)
        if not points:
            raise ValueError(f"{path}: no `bench serve` results in it")
        for p in points:
            name = label or p.get("label") or Path(path).stem
            series.setdefault(name, []).append(p)
    return series


def point_tag(point: dict[str, Any]) -> str:
    """'c=8' for a concurrency sweep point, else 'r=4' (request rate), 'r=inf'."""
    if point.get("sweep") == "max_concurrency" and point.get("max_concurrency"):
        return f"c={point['max_concurrency']}"
    rate = point.get("request_rate")
    return f"r={rate:g}" if isinstance(rate, (int, float)) else f"r={rate}"


def _xy(points: list[dict[str, Any]], metric: str) -> list[tuple[float, float, str]]:
    rows = [(p.get("output_throughput"), p.get(metric), point_tag(p)) for p in points]
    good = [(x, y, t) for x, y, t in rows if _finite(x) and _finite(y)]
    return sorted(good)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _axis_label(metric: str) -> str:
    """'median_tpot_ms' -> 'median TPOT (ms)'."""
    words = metric.removesuffix("_ms").split("_")
    unit = " (ms)" if metric.endswith("_ms") else ""
    return " ".join(w.upper() if w in ("ttft", "tpot", "itl", "e2el") else w for w in words) + unit


def _draw_panel(ax: Any, series: dict[str, list[dict[str, Any]]], metric: str) -> None:
    for label, points in series.items():
        xyt = _xy(points, metric)
        if not xyt:
            continue
        xs, ys, tags = zip(*xyt)
        ax.plot(xs, ys, marker="o", label=label)
        for x, y, tag in xyt:
            ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if any(k in metric for k in _LOG_PANELS):
        ax.set_yscale("log")
    ax.set_xlabel("output token throughput (tok/s)")
    ax.set_ylabel(_axis_label(metric))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_frontier(series: dict[str, list[dict[str, Any]]], out_path: str,
                  panels: Sequence[str] = DEFAULT_PANELS, title: str | None = None) -> str:
    """Draw the series into a PNG at out_path; returns the path."""
    from photon.bench.cli import require

    require("matplotlib", "plotting the latency-throughput frontier").use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, metric in zip(axes[0], panels):
        _draw_panel(ax, series, metric)
    fig.suptitle(title or "latency vs throughput: " + ", ".join(series))
    fig.tight_layout()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
