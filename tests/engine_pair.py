"""Run the same requests through the in-process engine (`AsyncEngine` over an `EngineCore`) and
the engine-core process (`AsyncLLM`), and fold each request's delta outputs into one comparable
record: whatever the front end rebuilds from the core's token ids (text, stop strings, logprob
texts) must equal what the in-process engine produced."""

from __future__ import annotations

import asyncio
import copy
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from photon.config import EngineConfig
from photon.engine.async_engine import AsyncEngine
from photon.engine.async_llm import AsyncLLM
from photon.engine.engine_core import EngineCore
from photon.outputs import CompletionOutput, Logprob, RequestOutput
from photon.sampling_params import SamplingParams

LP_TOL = 1e-4
WAIT_S = 120.0  # bound on one batch of requests: a hang fails the test instead of the suite

Engine = AsyncEngine | AsyncLLM
# A logprob entry as compared: (token id, logprob, rank, decoded text) in the entry's order.
Entry = tuple[tuple[int, float, int | None, str | None], ...]


@dataclass(frozen=True)
class Case:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class SeqResult:
    """One sequence's deltas, concatenated."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Entry] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_finishes: int = 0  # outputs that carried a finish_reason (exactly one is right)

    def add(self, out: CompletionOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + [_entry(e) for e in out.logprobs]
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = out.cumulative_logprob
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.num_finishes += 1


@dataclass
class Result:
    """One request's stream, folded."""

    sequences: dict[int, SeqResult] = field(default_factory=dict)
    prompt_logprobs: list[Entry | None] | None = None
    num_prompt_logprobs_outputs: int = 0  # delta mode sends them once
    num_cached_tokens: int | None = None
    error: str | None = None
    finished: bool = False

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.sequences.setdefault(c.index, SeqResult()).add(c)
        if out.prompt_logprobs is not None:
            self.num_prompt_logprobs_outputs += 1
            self.prompt_logprobs = [None if e is None else _entry(e)
                                    for e in out.prompt_logprobs]
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        self.error = out.error if out.error is not None else self.error
        self.finished = out.finished

    def seq(self, index: int = 0) -> SeqResult:
        return self.sequences[index]


def _close(a: float | None, b: float | None) -> bool:
    """Logprobs agree to float32 rounding: the two engines batch requests differently, and a
    batch's composition moves a row's logits by a few ulps (token choices never differ)."""
    return a == b or (a is not None and b is not None and math.isclose(a, b, abs_tol=LP_TOL))


def _entry_diff(want: Entry | None, got: Entry | None) -> bool:
    if want is None or got is None:
        return want != got
    return [(t, r, s) for t, _, r, s in want] != [(t, r, s) for t, _, r, s in got] or \
        not all(_close(a[1], b[1]) for a, b in zip(want, got))


def _entries_diff(name: str, want: list[Entry | None] | None, got: list[Entry | None] | None
                  ) -> list[str]:
    if want is None or got is None or len(want) != len(got):
        return [] if want == got else [f"{name}: {want!r:.200} != {got!r:.200}"]
    return [f"{name}[{j}]: {x} != {y}" for j, (x, y) in enumerate(zip(want, got))
            if _entry_diff(x, y)][:1]


def _seq_diff(index: int, want: SeqResult, got: SeqResult) -> list[str]:
    out = [f"[{index}].{f}: {getattr(want, f)!r} != {getattr(got, f)!r}"
           for f in ("token_ids", "text", "finish_reason", "stop_reason", "num_finishes")
           if getattr(want, f) != getattr(got, f)]
    if not _close(want.cumulative_logprob, got.cumulative_logprob):
        out.append(f"[{index}].cumulative_logprob: {want.cumulative_logprob} != "
                   f"{got.cumulative_logprob}")
    return out + _entries_diff(f"[{index}].logprobs", want.logprobs, got.logprobs)


def differences(want: Result, got: Result) -> list[str]:
    """Where `got` differs from `want` (empty: the same); floats compared to `LP_TOL`."""
    out = [f"{f}: {getattr(want, f)!r} != {getattr(got, f)!r}"
           for f in ("num_prompt_logprobs_outputs", "num_cached_tokens", "error", "finished")
           if getattr(want, f) != getattr(got, f)]
    out += _entries_diff("prompt_logprobs", want.prompt_logprobs, got.prompt_logprobs)
    if sorted(want.sequences) != sorted(got.sequences):
        out.append(f"sequences {sorted(want.sequences)} != {sorted(got.sequences)}")
    for index in sorted(set(want.sequences) & set(got.sequences)):
        out += _seq_diff(index, want.sequences[index], got.sequences[index])
    return out


def wait_drained(engine: Engine, tries: int = 500) -> None:
    """The engine's drain check passes within a bounded poll. A request whose last output the
    caller has seen may still hold the core for a step or two: a stop string found by the
    front end is aborted in the core afterwards, and zombie rows finish their steps."""
    for _ in range(tries - 1):
        try:
            engine.call_utility("check_drained")
            return
        except AssertionError:
            time.sleep(0.01)
    engine.call_utility("check_drained")


def _entry(entry: dict[int, Logprob]) -> Entry:
    return tuple((tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in entry.items())


async def _collect(engine: Engine, case: Case) -> Result:
    result = Result()
    params = copy.deepcopy(case.params)  # neither engine sees the other's object
    async for out in engine.generate(list(case.prompt_ids), params, case.request_id):
        result.add(out)
    return result


async def _run(engine: Engine, cases: Sequence[Case]) -> dict[str, Result]:
    results = await asyncio.wait_for(
        asyncio.gather(*(_collect(engine, c) for c in cases)), WAIT_S)
    return {c.request_id: r for c, r in zip(cases, results)}


def run_cases(engine: Engine, cases: Sequence[Case]) -> dict[str, Result]:
    """Every case's folded stream, all requests in flight together."""
    return asyncio.run(_run(engine, cases))


def run_pair(pair: tuple[Engine, Engine], cases: Sequence[Case]
             ) -> tuple[dict[str, Result], dict[str, Result]]:
    """The same cases through both engines, one after the other (the in-process one first)."""
    return run_cases(pair[0], cases), run_cases(pair[1], cases)


@contextmanager
def engine_pair(local: EngineConfig, remote: EngineConfig
                ) -> Iterator[tuple[AsyncEngine, AsyncLLM]]:
    """An in-process engine on `local` and an engine-core process front end on `remote`,
    started; both shut down on exit."""
    in_process = AsyncEngine(EngineCore(local))
    try:
        front = AsyncLLM(remote)
    except BaseException:
        in_process.shutdown()
        raise
    in_process.start()
    front.start()
    try:
        yield in_process, front
    finally:
        front.shutdown()
        in_process.shutdown()


def spy_core_assignment(llm: AsyncLLM, monkeypatch: object) -> dict[str, int]:
    """The core index each request of a multi-core `llm` is sent to, by caller's id, recorded
    from now on (`monkeypatch` undoes the spy)."""
    cores = llm.cores
    seen: dict[str, int] = {}
    real = cores.assign

    def spy(core_id: str) -> object:
        client = real(core_id)
        seen[core_id.rsplit("#", 1)[0]] = cores.clients.index(client)
        return client

    monkeypatch.setattr(cores, "assign", spy)
    return seen
