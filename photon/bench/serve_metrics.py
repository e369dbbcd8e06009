"""Pure parts of `photon bench serve`: per-request records, aggregate metrics, goodput, arrivals.

Definitions (the usual serving-benchmark ones, as in vLLM's `bench serve`):
- TTFT: request sent -> first streamed chunk carrying text.
- ITL: gaps between consecutive text chunks (pooled over all requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token.
- E2E: request sent -> stream finished.
- throughput: completed requests, output tokens, prompt + output tokens per second of the run.
- goodput: completed requests per second meeting every given SLO (ttft, tpot, e2el; in ms).
No network here: everything is unit-testable.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
MAX_ERRORS_REPORTED = 5


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds, `start` relative to the run's start."""

    success: bool
    output_len: int  # requested (max_tokens)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    error: str = ""
    text: str = ""  # the generated text, as streamed

    def tpot(self) -> float:
        """Seconds per output token after the first; 0 with at most one output token."""
        if self.output_tokens <= 1 or self.ttft is None:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def slo_values_ms(self) -> dict[str, float]:
        ttft = self.ttft if self.ttft is not None else self.latency
        return {"ttft": ttft * 1e3, "tpot": self.tpot() * 1e3, "e2el": self.latency * 1e3}


# ---------------------------------------------------------------- goodput


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"--goodput {name} must be a positive number of ms, got {value!r}")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request whose every SLO'd metric is <= its bound (ms)."""
    if not record.success:
        return False
    values = record.slo_values_ms()
    return all(values[name] <= bound for name, bound in slos.items())


def count_good(records: Sequence[RequestRecord], slos: dict[str, float]) -> int:
    return sum(meets_slos(r, slos) for r in records)


# ---------------------------------------------------------------- aggregation


def latency_stats(name: str, values_ms: Sequence[float]) -> dict[str, float | None]:
    """mean/std/median/p90/p99 of `values_ms` as `{stat}_{name}_ms`; None when there are none."""
    keys = ["mean", "std"] + ["median" if p == 50 else f"p{p}" for p in PERCENTILES]
    if not values_ms:
        return {f"{k}_{name}_ms": None for k in keys}
    arr = np.asarray(values_ms, dtype=np.float64)
    stats = [float(arr.mean()), float(arr.std())]
    stats += [float(np.percentile(arr, p)) for p in PERCENTILES]
    return {f"{k}_{name}_ms": v for k, v in zip(keys, stats)}


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (a request ending when another starts doesn't overlap)."""
    events = sorted([(r.start, 1) for r in records] + [(r.start + r.latency, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = live = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def error_summary(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    counts = Counter(r.error[:300] for r in records if not r.success)
    return [{"error": e, "count": n} for e, n in counts.most_common(MAX_ERRORS_REPORTED)]


def aggregate(records: Sequence[RequestRecord], duration: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's metrics from its records and wall time (seconds)."""
    ok = [r for r in records if r.success]
    inputs = [r.prompt_tokens for r in ok]
    prompt_tokens = sum(inputs)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else math.nan
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s, "output_throughput": output_tokens * per_s,
        "total_token_throughput": (prompt_tokens + output_tokens) * per_s,
        "request_goodput": count_good(records, slos) * per_s if slos else None,
        "good_requests": count_good(records, slos) if slos else None,
        # The prompt lengths the server counted (its usage), e.g. after a chat template.
        "mean_input_tokens": float(np.mean(inputs)) if ok else None,
        "median_input_tokens": float(np.median(inputs)) if ok else None,
        "output_len_mismatches": sum(r.output_tokens != r.output_len for r in ok),
        "peak_concurrency": peak_concurrency(records),
    }
    out.update(latency_stats("ttft", [r.ttft * 1e3 for r in ok if r.ttft is not None]))
    out.update(latency_stats("tpot", [r.tpot() * 1e3 for r in ok if r.output_tokens > 1]))
    out.update(latency_stats("itl", [g * 1e3 for r in ok for g in r.itl]))
    out.update(latency_stats("e2el", [r.latency * 1e3 for r in ok]))
    out["errors"] = error_summary(records)
    return out


# ---------------------------------------------------------------- arrivals


def arrival_intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gaps (s) between n arrivals: gamma(shape=B, mean 1/rate); B=1 is Poisson; inf rate = 0s."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start): the first request at 0, then the gaps accumulate."""
    gaps = arrival_intervals(n, rate, burstiness, seed)
    offsets, t = [], 0.0
    for gap in gaps:
        offsets.append(t)
        t += gap
    return offsets
