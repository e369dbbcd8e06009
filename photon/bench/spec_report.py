"""Pure parts of `photon bench spec`: settings, step times, cells, speedups, the table.

A cell is one (method, K, adaptive, B) run. Its speedup is its output tokens/s over no
speculation's at the same B: over the baseline runs timed right before and after it when the
cell has them (`Cell.baseline_tokens_per_s`, `photon bench spec --paired`), else over the no
speculation cell's of the same run. Its predicted speedup is the cost model's
(photon/spec/adaptive.py) from the cell's measured acceptance and the run's measured step times:

    fixed K:   E'(K) / T(B, K)  over  1 / T(B, 0)
    adaptive:  max over k in 0..K of E'(k) / T(B, k)  over  1 / T(B, 0)

E'(k) = p E(k) + (1 - p): a share p of the row-steps had drafts (`draft_share`; an ngram row
without a match emits one token) and emit E(k) = 1 + a_0 + ... + a_{k-1} tokens, with a_j the
cell's acceptance rate at draft position j (the engine's definition: accepted at j / draft
runs). T(B, k) the median time between consecutive
committed decode steps of B rows: T(B, 0) from the cell's baseline runs (else the
no-speculation cell), T(B, k) from the fixed
K = k cell of the same method (the adaptive cell's own steps at K_eff = k when that cell is
missing). The adaptive prediction is what its switch would get if it always picked the best k.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from photon.bench.serve_workload import length_bounds
from photon.spec.adaptive import timed_step

NO_SPEC = "none"
# A second no-speculation engine timed like a speculative one (`photon bench spec --control`):
# its speedup over the paired baseline is 1 but for the machine's noise, which it measures.
CONTROL = "control"
STEP_KINDS = ("full", "partial", "mixed")


@dataclass(frozen=True)
class SpecSetting:
    """One engine of the matrix: a method (NO_SPEC: no speculation), K and the adaptive switch."""

    method: str
    k: int = 0
    adaptive: bool = False
    lookup: tuple[int, int] | None = None  # ngram: (prompt_lookup_min, prompt_lookup_max)

    @property
    def label(self) -> str:
        if self.method in (NO_SPEC, CONTROL):
            return self.method
        return f"{self.method} K={self.k}{' adaptive' if self.adaptive else ''}"

    def speculative_config(self, draft: str | None) -> dict[str, Any] | None:
        if self.method in (NO_SPEC, CONTROL):
            return None
        config: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.k,
                                  "adaptive": self.adaptive}
        if self.method == "draft_model":
            config["model"] = draft
        if self.method == "ngram" and self.lookup is not None:
            config["prompt_lookup_min"], config["prompt_lookup_max"] = self.lookup
        return config


def settings(methods: Sequence[str], fixed_ks: Sequence[int], adaptive_ks: Sequence[int],
             control: bool = False, lookup: tuple[int, int] | None = None
             ) -> list[SpecSetting]:
    """The matrix: no speculation first (then its control twin when asked), then per method
    each K with the adaptive switch off (`fixed_ks`) and on (`adaptive_ks`); `lookup`: the
    ngram settings' (prompt_lookup_min, prompt_lookup_max)."""
    ks = sorted(set(fixed_ks) | set(adaptive_ks))
    head = [SpecSetting(NO_SPEC)] + ([SpecSetting(CONTROL)] if control else [])
    return head + [SpecSetting(m, k, a, lookup if m == "ngram" else None)
                   for m in methods for k in ks for a in (False, True)
                   if k in (adaptive_ks if a else fixed_ks)]


@dataclass(frozen=True)
class Commit:
    step: int
    batch_size: int
    k: int  # K_eff the step's speculative rows verified (0 without speculation)
    decode_only: bool
    time: float


@dataclass
class StepRecorder:
    """A scheduler spec policy that records each committed step's time and shape, delegating the
    choice of K_eff to the engine's own policy (adaptive), else verifying K (fixed)."""

    k: int
    inner: Any = None  # the engine's SpecPolicy, or None
    clock: Callable[[], float] = time.perf_counter
    commits: list[Commit] = field(default_factory=list)

    def choose(self, batch_size: int) -> int:
        return self.k if self.inner is None else self.inner.choose(batch_size)

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool,
                  tokens: int) -> None:
        self.commits.append(Commit(step, batch_size, k, decode_only, self.clock()))
        if self.inner is not None:
            self.inner.committed(step, batch_size, k, decode_only, tokens)

    def guard_verdicts(self) -> dict[int, bool | None] | None:
        """The engine's guard's verdicts by bucket (None: no guard)."""
        guard = getattr(self.inner, "guard", None)
        return None if guard is None else guard.verdicts()

    def step_times(self, batch_size: int) -> dict[int, list[float]]:
        """Seconds between consecutive committed decode steps of `batch_size` rows, by K_eff:
        the steps the engine's cost model times (`timed_step`)."""
        out: dict[int, list[float]] = {}
        for prev, cur in zip(self.commits, self.commits[1:]):
            if cur.batch_size == batch_size and timed_step(prev.step, prev.k, cur.step, cur.k,
                                                           cur.decode_only):
                out.setdefault(cur.k, []).append(cur.time - prev.time)
        return out

    def time_by_kind(self, batch_size: int) -> tuple[dict[str, float], dict[str, int]]:
        """Seconds and count of the committed steps by kind, each step's time the time since
        the commit before it (the first commit's own time is not counted): `full` decode steps
        of `batch_size` rows, `partial` decode steps of fewer rows (a batch not yet full, or
        its tail), `mixed` steps carrying a prompt chunk."""
        seconds = dict.fromkeys(STEP_KINDS, 0.0)
        counts = dict.fromkeys(STEP_KINDS, 0)
        for prev, cur in zip(self.commits, self.commits[1:]):
            kind = ("mixed" if not cur.decode_only
                    else "full" if cur.batch_size == batch_size else "partial")
            seconds[kind] += cur.time - prev.time
            counts[kind] += 1
        return seconds, counts


@dataclass
class Cell:
    method: str
    k: int
    adaptive: bool
    batch_size: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    step_time_s: dict[int, float]  # K_eff -> median decode step time at B rows
    steps: dict[int, int]  # K_eff -> decode steps measured at B rows
    mean_acceptance_length: float | None = None  # None without speculation
    acceptance_rate_per_pos: list[float] | None = None
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    speedup: float | None = None  # over no speculation at the same B
    predicted_speedup: float | None = None
    prediction_error: float | None = None  # speedup / predicted_speedup - 1
    # Where the cell's time went (StepRecorder.time_by_kind): seconds and steps by step kind
    step_kind_s: dict[str, float] = field(default_factory=dict)
    step_kind_count: dict[str, int] = field(default_factory=dict)
    # No speculation timed right before and after this cell (paired runs; None: not paired):
    # output tokens/s of the two runs together and their median decode step time at B rows.
    baseline_tokens_per_s: float | None = None
    baseline_step_time_s: float | None = None
    # Paired: each timed call's speedup over the two baseline calls around it (--repeats of
    # them); the cell's speedup is their median.
    speedup_rounds: list[float] | None = None
    # The adaptive switch's realized-rate guard after the cell, by batch-size bucket: True
    # speculation allowed, False vetoed, None not yet decided (None: no guard).
    guard_verdicts: dict[int, bool | None] | None = None

    @property
    def setting(self) -> SpecSetting:
        return SpecSetting(self.method, self.k, self.adaptive)


@dataclass
class Timed:
    """One timed generate call: its output tokens, seconds, the times of its decode steps of
    B rows by K_eff, and its steps' seconds and counts by kind."""

    tokens: int
    seconds: float
    step_times: dict[int, list[float]]
    kind_s: dict[str, float]
    kind_count: dict[str, int]


def merged_step_times(runs: list[Timed]) -> dict[int, list[float]]:
    """The decode step times of several timed calls together, by K_eff."""
    out: dict[int, list[float]] = {}
    for run in runs:
        for k, times in run.step_times.items():
            out.setdefault(k, []).extend(times)
    return out


def cell_of(setting: SpecSetting, b: int, runs: list[Timed]) -> Cell:
    """A cell from its timed calls: their tokens and seconds summed, the median decode step by
    K_eff over all of them, their steps by kind summed."""
    tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    times = merged_step_times(runs)
    cell = Cell(setting.method, setting.k, setting.adaptive, b, tokens, seconds,
                tokens / seconds, {k: statistics.median(v) for k, v in sorted(times.items())},
                {k: len(v) for k, v in sorted(times.items())})
    for run in runs:
        for kind, sec in run.kind_s.items():
            cell.step_kind_s[kind] = cell.step_kind_s.get(kind, 0.0) + sec
            cell.step_kind_count[kind] = cell.step_kind_count.get(kind, 0) + run.kind_count[kind]
    return cell


def pair_cell(cell: Cell, runs: list[Timed], base: list[Timed]) -> None:
    """The paired baseline of a cell: base[i] and base[i + 1] frame runs[i]. Each round's
    speedup is the mean time of the two baseline calls over the cell's call (the same
    requests, so the same tokens)."""
    cell.baseline_tokens_per_s = sum(r.tokens for r in base) / sum(r.seconds for r in base)
    times = merged_step_times(base).get(0, [])
    cell.baseline_step_time_s = statistics.median(times) if times else None
    cell.speedup_rounds = [(base[i].seconds + base[i + 1].seconds) / 2 / run.seconds
                           for i, run in enumerate(runs)]


def output_lengths(count: int, output_len: int, ratio: float, seed: int) -> list[int]:
    """Each request's output length: `output_len`, or (ratio > 0) drawn uniformly from the
    bounds `photon bench serve --random-range-ratio` uses (serve_workload.length_bounds) by a
    seeded generator."""
    if ratio == 0:
        return [output_len] * count
    rng = random.Random(seed)
    low, high = length_bounds(output_len, ratio)
    return [rng.randint(low, high) for _ in range(count)]


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """E(k): tokens a row emits verifying k drafts, from per-position acceptance rates."""
    return 1.0 + sum(rates[:k])


def _step_time(cells: dict[tuple[SpecSetting, int], Cell], cell: Cell, k: int) -> float | None:
    if k == 0:
        if cell.baseline_step_time_s is not None:
            return cell.baseline_step_time_s
        base = cells.get((SpecSetting(NO_SPEC), cell.batch_size))
        return None if base is None else base.step_time_s.get(0)
    fixed = cells.get((SpecSetting(cell.method, k, False), cell.batch_size))
    if fixed is not None and k in fixed.step_time_s:
        return fixed.step_time_s[k]
    return cell.step_time_s.get(k)


def draft_share(cell: Cell) -> float:
    """The share of the cell's row-steps that had drafts to verify (an ngram row without a
    match emits one token): each row-step emits 1 + its accepted drafts, so the row-steps are
    the output tokens minus the accepted ones."""
    if cell.num_drafts is None:  # not counted: every row-step had drafts
        return 1.0
    if cell.num_drafts == 0:
        return 0.0
    row_steps = cell.output_tokens - (cell.num_accepted_tokens or 0)
    return min(1.0, cell.num_drafts / row_steps) if row_steps > 0 else 1.0


def predicted_speedup(cells: dict[tuple[SpecSetting, int], Cell], cell: Cell) -> float | None:
    """The cost model's speedup for `cell` (module doc); None when a step time is missing."""
    t0 = _step_time(cells, cell, 0)
    rates = cell.acceptance_rate_per_pos
    if t0 is None or rates is None:
        return None
    p = draft_share(cell)
    ks = range(cell.k + 1) if cell.adaptive else (cell.k,)
    pairs = [(p * expected_tokens(rates, k) + 1.0 - p, _step_time(cells, cell, k)) for k in ks]
    known = [e * t0 / t for e, t in pairs if t]
    return max(known) if known else None


def fill_speedups(cells: list[Cell]) -> None:
    """Set each cell's measured and predicted speedup over no speculation at its B."""
    by_key = {(c.setting, c.batch_size): c for c in cells}
    for c in cells:
        base = by_key.get((SpecSetting(NO_SPEC), c.batch_size))
        base_rate = (c.baseline_tokens_per_s if c.baseline_tokens_per_s is not None
                     else base.output_tokens_per_s if base is not None else 0.0)
        if c.speedup_rounds:
            c.speedup = statistics.median(c.speedup_rounds)
        elif base_rate > 0:
            c.speedup = c.output_tokens_per_s / base_rate
        if c.method not in (NO_SPEC, CONTROL):
            c.predicted_speedup = predicted_speedup(by_key, c)
        if c.speedup is not None and c.predicted_speedup:
            c.prediction_error = c.speedup / c.predicted_speedup - 1.0


def full_step_share(cell: Cell) -> float | None:
    """The share of the cell's elapsed time spent in full-batch decode steps (None before the
    steps were recorded)."""
    if not cell.step_kind_s or cell.elapsed_s <= 0:
        return None
    return cell.step_kind_s.get("full", 0.0) / cell.elapsed_s


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(rounds: list[float] | None) -> str:
    """The lowest and highest round's speedup of a repeated cell (`--repeats`)."""
    return "-" if not rounds or len(rounds) < 2 else f"{min(rounds):.2f}-{max(rounds):.2f}"


def table(cells: Sequence[Cell]) -> str:
    """The human-readable table (one line per cell)."""
    head = (f"{'method':<12}{'K':>3} {'adaptive':<9}{'B':>5}{'tok/s':>11}{'base tok/s':>11}"
            f"{'speedup':>9}{'rounds':>13}"
            f"{'predicted':>10}{'accept len':>11}{'full steps':>11}  per-position acceptance")
    lines = [head, "-" * len(head)]
    for c in cells:
        rates = "-" if c.acceptance_rate_per_pos is None else \
            " ".join(f"{r:.2f}" for r in c.acceptance_rate_per_pos)
        lines.append(f"{c.method:<12}{c.k:>3} {('on' if c.adaptive else 'off'):<9}"
                     f"{c.batch_size:>5}{c.output_tokens_per_s:>11.1f}"
                     f"{_fmt(c.baseline_tokens_per_s, '.1f'):>11}"
                     f"{_fmt(c.speedup, '.3f'):>9}{_spread(c.speedup_rounds):>13}"
                     f"{_fmt(c.predicted_speedup, '.3f'):>10}"
                     f"{_fmt(c.mean_acceptance_length, '.3f'):>11}"
                     f"{_fmt(full_step_share(c), '.0%'):>11}  {rates}")
    return "\n".join(lines)
