"""The engine-core process (`AsyncLLM`) gives the in-process engine's outputs token for token.

Every case runs through `AsyncEngine(EngineCore(config))` and then through `AsyncLLM(config)` with
the same requests; each stream's deltas are folded (tests/engine_pair.py) and must be equal:
token ids, text, finish and stop reasons, cumulative logprob, logprob entries with their texts,
prompt logprobs, cached-token counts, errors. Both engines see the same request history, so their
prefix caches agree too. After every batch both engines pass their drain check.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest

from photon.engine.async_engine import AsyncEngine, RequestSink
from photon.engine.async_llm import AsyncLLM
from photon.engine_args import EngineArgs
from photon.outputs import RequestOutput
from photon.sampling_params import SamplingParams
from photon.structured.params import StructuredOutputsParams as SO
from tests.engine_pair import (
    WAIT_S,
    Case,
    Engine,
    Result,
    differences,
    engine_pair,
    run_cases,
    wait_drained,
)
from tests.server_util import TINY_ARGS

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time", "In the beginning",
           "def main():", "Dear diary, today", "Roses are red", "Q: what is 2+2? A:"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}


def _engines() -> AbstractContextManager[tuple[AsyncEngine, AsyncLLM]]:
    config = EngineArgs(**TINY_ARGS).create_config()
    return engine_pair(config, config)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[AsyncEngine, AsyncLLM]]:
    with _engines() as engines:
        yield engines


def _ids(pair: tuple[AsyncEngine, AsyncLLM], text: str) -> list[int]:
    return pair[1].frontend.tokenizer.encode(text)


def _check_same(pair: tuple[AsyncEngine, AsyncLLM], cases: list[Case]) -> dict[str, Result]:
    """Run `cases` through both engines, assert equal results; the in-process ones returned."""
    local = run_cases(pair[0], cases)
    remote = run_cases(pair[1], cases)
    for engine in pair:
        wait_drained(engine)
    for case in cases:
        want, got = local[case.request_id], remote[case.request_id]
        assert not differences(want, got), f"{case.request_id}: {differences(want, got)}"
        assert want.finished
        assert all(s.num_finishes == 1 for s in want.sequences.values())
        assert sorted(want.sequences) == list(range(case.params.n))
    return local


def _greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _sampled(seed: int, **kw: object) -> SamplingParams:
    base: dict[str, object] = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": seed,
                               "max_tokens": 24, "ignore_eos": True}
    return SamplingParams(**{**base, **kw})


def test_greedy(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    cases = [Case(f"greedy-{i}", _ids(pair, p), _greedy()) for i, p in enumerate(PROMPTS)]
    results = _check_same(pair, cases)
    assert all(r.seq().finish_reason == "length" and len(r.seq().token_ids) == 24
               for r in results.values())


def test_seeded_sampling(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    extras: list[dict[str, object]] = [
        {}, {"min_p": 0.05}, {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.3}, {"temperature": 1.5, "top_k": 0}, {"top_p": 0.5}]
    cases = [Case(f"sampled-{i}", _ids(pair, PROMPTS[i]), _sampled(100 + i, **kw))
             for i, kw in enumerate(extras)]
    _check_same(pair, cases)


def test_request_times_cross_the_process_boundary(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    """The core's first-scheduled and first-token times reach the front end's outputs, in
    order after the arrival (one clock: time.monotonic on one machine)."""

    async def last(engine: AsyncEngine | AsyncLLM) -> RequestOutput:
        outs = [o async for o in engine.generate(_ids(pair, PROMPTS[0]), _greedy(4), "timed")]
        assert outs and outs[-1].finished
        return outs[-1]

    for engine in pair:
        m = asyncio.run(last(engine)).metrics
        assert m is not None and m.first_scheduled_time is not None
        assert m.first_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time


@pytest.mark.parametrize("n", [2, 3])
def test_n_sequences(pair: tuple[AsyncEngine, AsyncLLM], n: int) -> None:
    cases = [Case(f"n{n}-{i}", _ids(pair, p), _sampled(7 * i, n=n, logprobs=1))
             for i, p in enumerate(PROMPTS[:3])]
    results = _check_same(pair, cases)
    for r in results.values():  # the sequences really are sampled apart
        assert len({tuple(s.token_ids) for s in r.sequences.values()}) > 1


def _stop_words(pair: tuple[AsyncEngine, AsyncLLM], prompt: list[int]
                ) -> tuple[str, str, int, int]:
    """From the greedy output of `prompt`: a stop string that is one token's text, one that
    spans two tokens (each first found where that token ends, from the fourth output token on),
    the output position of the first and its token."""
    tok = pair[1].frontend.tokenizer
    out = run_cases(pair[0], [Case("probe", prompt, _greedy(40))])["probe"].seq()
    texts = [tok.decode([t]) for t in out.token_ids]
    starts = [len("".join(texts[:k])) for k in range(len(texts) + 1)]

    def clean(k: int, span: int) -> str | None:
        word = "".join(texts[k:k + span])
        ok = len(word) >= 2 and word.isprintable() and "\ufffd" not in word
        return word if ok and out.text.find(word) == starts[k] else None

    single = next((k, w) for k in range(3, 30) if (w := clean(k, 1)))
    multi = next(w for k in range(3, 30) if (w := clean(k, 2)) and w != single[1])
    return single[1], multi, single[0], out.token_ids[single[0]]


def test_stop_strings(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    prompt = _ids(pair, PROMPTS[1])
    single, multi, pos, token = _stop_words(pair, prompt)
    params = {
        "single": _greedy(40, stop=[single]),
        "multi": _greedy(40, stop=[multi]),
        "two": _greedy(40, stop=[multi, single]),
        "include": _greedy(40, stop=[multi], include_stop_str_in_output=True),
        "min-tokens": _greedy(40, stop=[single], min_tokens=pos + 3),
        "n2": _sampled(5, n=2, temperature=0.3, max_tokens=40, stop=[single, multi]),
        "no-text": _greedy(40, stop=[single], detokenize=False),
        "id-first": _greedy(40, stop=[single], stop_token_ids=[token]),  # the id wins
        "at-length": _greedy(pos + 1, stop=[single]),  # the string wins over the length
    }
    cases = [Case(f"stop-{k}", prompt, p) for k, p in params.items()]
    results = _check_same(pair, cases)
    assert results["stop-single"].seq().stop_reason == single
    assert results["stop-multi"].seq().stop_reason == multi
    assert results["stop-include"].seq().text.endswith(multi)
    assert results["stop-id-first"].seq().stop_reason == token
    assert results["stop-at-length"].seq().finish_reason == "stop"
    # A stop string before min_tokens neither ends nor truncates the output.
    early = results["stop-min-tokens"].seq()
    assert single in early.text and len(early.token_ids) >= pos + 3


def test_stop_token_ids_and_eos(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    prompt = _ids(pair, PROMPTS[2])
    ref = run_cases(pair[0], [Case("probe-ids", prompt, _greedy(24))])["probe-ids"].seq()
    stop_id = ref.token_ids[5]
    eos = min(pair[1].frontend.tokenizer.eos_token_ids)
    params = {
        "stop-id": _greedy(24, stop_token_ids=[stop_id]),
        "stop-id-min": _greedy(24, stop_token_ids=[stop_id], min_tokens=8),
        "stop-id-incl": _greedy(24, stop_token_ids=[stop_id], skip_special_tokens=False),
        "eos": SamplingParams(temperature=0, max_tokens=24, logit_bias={eos: 100.0}),
        "eos-min": SamplingParams(temperature=0, max_tokens=24, min_tokens=4,
                                  logit_bias={eos: 100.0}),
    }
    cases = [Case(k, prompt, p) for k, p in params.items()]
    results = _check_same(pair, cases)
    assert results["stop-id"].seq().stop_reason == stop_id
    assert results["stop-id"].seq().token_ids == ref.token_ids[:ref.token_ids.index(stop_id) + 1]
    eos_seq = results["eos"].seq()
    assert (eos_seq.finish_reason, eos_seq.stop_reason, eos_seq.token_ids) == ("stop", None, [eos])
    assert len(results["eos-min"].seq().token_ids) == 5


def test_logprobs(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    params = [
        _greedy(12, logprobs=3, prompt_logprobs=2),
        _sampled(3, logprobs=3, prompt_logprobs=2, max_tokens=12),
        _sampled(4, n=2, logprobs=0, prompt_logprobs=0, max_tokens=12),
        _greedy(12, logprobs=3, prompt_logprobs=2, detokenize=False),
        _greedy(12, logprobs=2, skip_special_tokens=False),
    ]
    cases = [Case(f"lp-{i}", _ids(pair, PROMPTS[i]), p) for i, p in enumerate(params)]
    results = _check_same(pair, cases)
    first = results["lp-0"]
    assert first.num_prompt_logprobs_outputs == 1
    assert len(first.prompt_logprobs) == len(cases[0].prompt_ids)
    assert all(len(e) >= 3 and e[0][3] is not None for e in first.seq().logprobs)
    no_text = results["lp-3"]
    assert no_text.seq().text == "" and all(e[0][3] is None for e in no_text.seq().logprobs)


def test_prefix_cache_counts(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    prompt = _ids(pair, " ".join(PROMPTS))
    for rnd in range(2):
        results = _check_same(pair, [Case(f"cached-{rnd}", prompt, _greedy(4))])
    assert results["cached-1"].num_cached_tokens > 0


def test_structured_outputs(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    specs = [SO(json=SCHEMA), SO(choice=["yes", "no", "maybe so"]),
             SO(regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)")]
    cases = [Case(f"so-{i}-{seed}", _ids(pair, PROMPTS[seed]),
                  SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                                 structured_outputs=spec))
             for i, spec in enumerate(specs) for seed in range(2)]
    results = _check_same(pair, cases)
    for seed in range(2):
        out = results[f"so-0-{seed}"].seq()
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"name", "age"}


def test_grammar_compile_failure(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    bad = SamplingParams(max_tokens=8, structured_outputs=SO(regex="(ab"))
    cases = [Case("bad-grammar", _ids(pair, PROMPTS[0]), bad),
             Case("beside-it", _ids(pair, PROMPTS[1]), _greedy(8))]
    results = _check_same(pair, cases)
    failed = results["bad-grammar"]
    assert failed.seq().finish_reason == "abort" and failed.seq().token_ids == []
    assert "invalid regex" in failed.error
    assert results["beside-it"].error is None


async def _abort_after_first(engine: Engine, case: Case) -> Result:
    """Read the first output, abort the request, read on to the end."""
    result = Result()
    stream = engine.generate(list(case.prompt_ids), case.params, case.request_id)
    async for out in stream:
        if not result.sequences:
            engine.abort(case.request_id)
        result.add(out)
    return result


@pytest.mark.parametrize("n", [1, 2])
def test_abort_running_request(pair: tuple[AsyncEngine, AsyncLLM], n: int) -> None:
    case = Case(f"abort-{n}", _ids(pair, PROMPTS[3]), _sampled(9, n=n, max_tokens=200))
    full = run_cases(pair[0], [Case(f"full-{n}", case.prompt_ids, case.params)])[f"full-{n}"]
    for engine in pair:
        result = asyncio.run(asyncio.wait_for(_abort_after_first(engine, case), WAIT_S))
        assert result.finished
        for index, seq in result.sequences.items():
            assert (seq.finish_reason, seq.num_finishes) == ("abort", 1)
            assert len(seq.token_ids) < 200
            assert seq.token_ids == full.seq(index).token_ids[:len(seq.token_ids)]
        wait_drained(engine)


def test_many_concurrent_requests(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    kinds = [lambda i: _greedy(16 + i % 5), lambda i: _sampled(i, max_tokens=20),
             lambda i: _sampled(i, n=2, logprobs=2, max_tokens=12),
             lambda i: _greedy(20, logprobs=1, prompt_logprobs=1, stop=[" the", "e"])]
    cases = [Case(f"many-{i}", _ids(pair, f"{PROMPTS[i % len(PROMPTS)]} #{i}"), kinds[i % 4](i))
             for i in range(32)]
    _check_same(pair, cases)


async def _paused_add(engine: Engine, case: Case) -> Result:
    """Pause, add `case`, run the drain check (it must fail), resume, read the stream."""
    engine.call_utility("pause")
    try:
        sink = RequestSink()
        await engine.add_request(list(case.prompt_ids), case.params, case.request_id, sink)
        with pytest.raises(AssertionError, match="work still pending"):
            engine.call_utility("check_drained")
    finally:
        engine.call_utility("resume")
    result = Result()
    while not result.finished:
        _, out = await sink.get()
        assert not isinstance(out, BaseException)
        result.add(out)
    return result


def test_check_drained_fails_while_work_is_pending(pair: tuple[AsyncEngine, AsyncLLM]) -> None:
    case = Case("paused", _ids(pair, PROMPTS[4]), _greedy(6))
    results = [asyncio.run(asyncio.wait_for(_paused_add(e, case), WAIT_S)) for e in pair]
    assert not differences(results[0], results[1])
    assert results[0].seq().finish_reason == "length"
    for engine in pair:
        wait_drained(engine)


def test_request_id_reused_after_a_stop_string() -> None:
    """A request id is free again once its request's last output arrived, also when a stop
    string ended it while its last steps are still in flight: the next request with that id
    gets the tokens a fresh id gets, from either engine. (Engines of its own: a mix-up must not
    spill into the other tests.)"""
    with _engines() as pair:
        prompt = _ids(pair, PROMPTS[1])
        single, _, _, _ = _stop_words(pair, prompt)
        params = [_greedy(40, stop=[single]), _greedy(10)] * 3
        fresh = [run_cases(pair[0], [Case(f"fresh-{i}", prompt, p)])[f"fresh-{i}"]
                 for i, p in enumerate(params)]
        for engine in pair:
            reused = [run_cases(engine, [Case("reused", prompt, p)])["reused"] for p in params]
            found = [differences(w, g) for w, g in zip(fresh, reused)]
            assert not any(found), f"{type(engine).__name__}: {found}"
            wait_drained(engine)
