"""Structured outputs with random weights: the grammar alone makes every output valid (JSON schema,
regex, choice, EBNF), the grammar's end finishes the request with "stop", and bad grammars or slow
compiles fail their own request with a clear error while the engine keeps serving."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from photon import LLM, SamplingParams
from photon.structured.compile_pool import PoolCounts
from photon.structured.executor import StepJob
from photon.structured.params import StructuredOutputsParams as SO

_NONE = np.zeros(0, dtype=np.int64)

SEEDS = range(8)
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "y": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x", "y"]},
        "color": {"enum": ["red", "green", "blue"]},
        "note": {"type": "string", "maxLength": 4}},
     "required": ["ok", "point", "color"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 1, "maxItems": 4},
]
REGEX = r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so", "yes please"]
ARITH = r"""
root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" inner ")"
inner ::= num (op num){0,3}
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]{0,2} | "0"
"""


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("photon-tiny-random", max_model_len=512, max_num_seqs=16)


def _generate(llm: LLM, spec: SO, max_tokens: int = 300) -> list[tuple[str, str | None]]:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens,
                             structured_outputs=spec) for s in SEEDS]
    outs = llm.generate([f"Answer {s}:" for s in SEEDS], params, use_tqdm=False)
    llm.engine.assert_drained()
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "nested", "array"])
def test_json_schema_outputs_validate(llm: LLM, schema: dict) -> None:
    for text, finish in _generate(llm, SO(json=schema)):
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)
        assert "\n" not in text and "  " not in text  # whitespace is bounded by default


def test_json_object(llm: LLM) -> None:
    spec = SO(json_object=True)
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec)
    out = llm.generate("{", params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{")  # an object starts; it may be cut by max_tokens


def test_regex_outputs_fullmatch(llm: LLM) -> None:
    for text, finish in _generate(llm, SO(regex=REGEX)):
        assert finish == "stop" and re.fullmatch(REGEX, text), (text, finish)


def test_choice_outputs(llm: LLM) -> None:
    for text, finish in _generate(llm, SO(choice=CHOICES)):
        assert finish == "stop" and text in CHOICES, (text, finish)


def _parse_arith(text: str) -> None:
    """A tiny recursive-descent parser of ARITH (nesting unbounded): raises on mismatch."""
    pos = 0

    def num() -> None:
        nonlocal pos
        m = re.compile(r"0|[1-9][0-9]{0,2}").match(text, pos)
        assert m, f"number expected at {pos} in {text!r}"
        pos = m.end()

    def seq(item) -> None:  # item (op item){0,3}
        nonlocal pos
        item()
        for _ in range(3):
            if pos < len(text) and text[pos] in "+-*":
                pos += 1
                item()

    def term() -> None:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            seq(num)
            assert text.startswith(")", pos), f"')' expected at {pos} in {text!r}"
            pos += 1
        else:
            num()

    seq(term)
    assert pos == len(text), f"trailing text at {pos} in {text!r}"


def test_ebnf_outputs_parse(llm: LLM) -> None:
    for text, finish in _generate(llm, SO(grammar=ARITH)):
        assert finish == "stop", (text, finish)
        _parse_arith(text)


def test_any_whitespace_bounded(llm: LLM) -> None:
    schema = SCHEMAS[2]
    for text, finish in _generate(llm, SO(json=schema, any_whitespace=True, max_whitespace=2)):
        assert finish == "stop" and not re.search(r"\s{3}", text), text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty"), ({"choice": "ab"}, "list of strings"),
    ({"json": "{not json"}, "invalid JSON"), ({"regex": "a", "max_whitespace": 0}, ">= 1"),
])
def test_params_validation(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SO(**kwargs)


@pytest.mark.parametrize("spec, words", [
    (SO(json={"type": "foo"}), "invalid json"),
    (SO(regex="(ab"), "invalid regex"),
    (SO(grammar="root ::= undefined_rule"), "invalid grammar"),
])
def test_invalid_grammar_raises_and_engine_keeps_serving(llm: LLM, spec: SO, words: str) -> None:
    plain = SamplingParams(temperature=0, max_tokens=8)
    with pytest.raises(ValueError, match=words):
        llm.generate(["a", "b"], [SamplingParams(structured_outputs=spec), plain], use_tqdm=False)
    llm.engine.assert_drained()
    good = SamplingParams(temperature=0, max_tokens=50, structured_outputs=SO(choice=CHOICES))
    assert llm.generate("ok", good, use_tqdm=False)[0].outputs[0].text in CHOICES
    llm.engine.assert_drained()


def _gated_regex_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                          gate: threading.Event) -> list[SO]:
    """Regex specs compile only once `gate` opens (in the engine process: the grammar worker
    compiles its own copy unhindered); returns the specs whose compile started."""
    backend = llm.engine.structured.backend
    orig, started = backend.compile, []

    def gated(spec: SO):  # noqa: ANN202
        if spec.regex is not None:
            started.append(spec)
            assert gate.wait(120), "test gate never opened"
        return orig(spec)

    monkeypatch.setattr(backend, "compile", gated)
    return started


def _finish_all(core: object) -> dict:
    outs = {}
    while core.has_unfinished():  # EngineCore reports failures; it does not raise
        outs.update({o.request_id: o for o in core.step() if o.finished})
    return outs


def test_compile_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile still running at the request's deadline fails it (and any other request
    waiting for it), frees its compile slot and is not cached: the next grammars compile while
    the expired ones still run."""
    llm = LLM("photon-tiny-random", max_model_len=256, structured_outputs_timeout=0.1)
    gate = threading.Event()
    _gated_regex_compiles(llm, monkeypatch, gate)
    core, manager = llm.engine, llm.engine.structured
    slow = SO(regex="[0-9]{3}")
    core.add_request("slow", SamplingParams(structured_outputs=slow), "slow")
    core.add_request("plain", SamplingParams(temperature=0, max_tokens=4), "plain")
    outs = _finish_all(core)
    assert "timed out" in outs["slow"].error and outs["slow"].outputs[0].finish_reason == "abort"
    assert outs["plain"].error is None and len(outs["plain"].outputs[0].token_ids) == 4
    core.assert_drained()
    with pytest.raises(ValueError, match="structured_outputs_timeout"):
        llm.generate("x", SamplingParams(structured_outputs=SO(regex="[a-z]{3}")), use_tqdm=False)
    assert slow.key() not in manager.cache
    assert manager.pool.counts() == PoolCounts(0, 0, 2)
    good = SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(choice=["x", "y"]))
    assert llm.generate("ok", good, use_tqdm=False)[0].outputs[0].text in ("x", "y")
    core.assert_drained()
    gate.set()  # the expired compiles return; their results are dropped
    deadline = time.monotonic() + 120
    while manager.pool.counts().abandoned:
        assert time.monotonic() < deadline, "the expired compiles did not return"
        time.sleep(0.01)
    assert slow.key() not in manager.cache


def test_compiling_request_does_not_block_others(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("photon-tiny-random", max_model_len=256)
    gate = threading.Event()
    started = _gated_regex_compiles(llm, monkeypatch, gate)
    core = llm.engine
    regex = "[0-9]{2}"
    core.add_request("g", SamplingParams(structured_outputs=SO(regex=regex), seed=1), "g")
    core.add_request("p", SamplingParams(temperature=0, max_tokens=6), "p")
    order = []
    while "p" not in order:
        order += [o.request_id for o in core.step() if o.finished]
    assert order == ["p"] and started  # the plain request ran while the grammar compiled
    gate.set()
    order += _finish_all(core)
    assert order == ["p", "g"]
    core.assert_drained()
    # The compile is cached by spec: a second request with it does not compile again.
    compiles = len(started)
    out = llm.generate("x", SamplingParams(structured_outputs=SO(regex=regex)), use_tqdm=False)
    assert re.fullmatch(regex, out[0].outputs[0].text) and len(started) == compiles


def test_min_tokens_does_not_fight_the_grammar(llm: LLM) -> None:
    """A choice grammar ends after a few tokens; min_tokens far beyond that must not ban the EOS
    the grammar requires (grammar rows are exempt from min_tokens bans)."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=64, min_tokens=50,
                             structured_outputs=SO(choice=CHOICES)) for s in SEEDS]
    outs = llm.generate([f"Pick {s}:" for s in SEEDS], params, use_tqdm=False)
    assert all(o.outputs[0].text in CHOICES for o in outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    llm.engine.assert_drained()


def test_grammar_rows_get_no_min_tokens_bans() -> None:
    from photon.core.sampling import pack_sampling

    def bans(structured: SO | None) -> tuple[int, ...]:
        params = SamplingParams(min_tokens=5, stop_token_ids=[9], structured_outputs=structured)
        return pack_sampling(params, 1, 4, 16, 100, frozenset({2})).min_tokens_bans

    assert bans(None) == (2, 9)
    assert bans(SO(choice=CHOICES)) == ()


def test_mask_never_allows_ids_past_the_tokenizer(llm: LLM) -> None:
    """photon-tiny's model is 1,024 wide, its tokenizer 1,000: xgrammar sees the 1,000 ids only
    (its accept scans special ids, so padding would cost per token). Mask rows are the tokenizer's
    words wide; a grammar row's tail flag is 0, so ids past them (here a model padded to 1,280) can
    never be sampled under a grammar, while rows without one keep the whole vocabulary."""
    import torch

    from photon.structured.bitmask import mask_numel, mask_views

    manager = llm.engine.structured
    backend = manager.backend
    assert manager.vocab_size == 1024 and backend.info.vocab_size == 1000
    assert backend.mask_words == 32
    grammar = _ready(manager.request_grammar(SO(regex="[a-z]+")))
    mask = mask_views(manager.executor.mask_buffer(0, mask_numel(3, 32)), 3, 32)
    mask.bits.fill_(0x5A5A5A5A)
    table, requests = _grammar_rows(manager, [None, grammar, None])
    fills = table.fill(requests, np.arange(3), np.zeros(3, dtype=np.int64), mask)
    assert fills.rows.tolist() == [1] and fills.handles.tolist() == [grammar.handle]
    manager.submit(StepJob(_NONE, _NONE, fills.rows, fills.handles), mask)
    assert manager.wait() == []
    assert mask.tail.tolist() == [-1, 0, -1]
    assert (mask.bits[0] == -1).all() and (mask.bits[2] == -1).all()
    logits = torch.zeros(3, 1280)
    allowed_all = torch.isfinite(_apply(logits, mask))
    allowed = allowed_all[1].nonzero().flatten().tolist()
    tok = llm.engine.tokenizer
    assert allowed and max(allowed) < 1000
    assert all(re.fullmatch("[a-z]+", tok.decode([v])) for v in allowed)
    assert allowed_all[0].all() and allowed_all[2].all()  # no grammar: all 1,280 ids


def _ready(grammar: object, timeout: float = 120.0) -> object:
    """The grammar once its matcher is open (the grammar worker may still be starting)."""
    grammar.future.result()
    deadline = time.monotonic() + timeout
    while not grammar.poll():
        assert time.monotonic() < deadline, "the grammar worker did not start"
        time.sleep(0.01)
    return grammar


def _grammar_rows(manager: object, grammars: list, out_index: int = 0) -> tuple:
    """A GrammarRows table whose request index i holds a request under grammars[i] (or none)
    that committed `out_index` outputs, and those requests (sampling row i is index i)."""
    from types import SimpleNamespace

    from photon.structured.rows import GrammarRows

    table = GrammarRows(len(grammars), manager.backend.stop_token_ids, manager.backend.mask_words)
    requests = [SimpleNamespace(grammar=g, finished=False, output_token_ids=[0] * out_index)
                for g in grammars]
    for i, req in enumerate(requests):
        table.assign(i, req)
    return table, requests


def _all_filled(table: object) -> object:
    """The fills of a step in which every row of `table` with a grammar was filled."""
    from photon.structured.rows import StepFills

    index = np.flatnonzero(table.handle >= 0)
    return StepFills(index, table.handle[index], index)


def _apply(logits, mask):
    from photon.structured.bitmask import apply_token_bitmask

    return apply_token_bitmask(logits, mask)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32, 127])
def test_mask_layout_tail_is_aligned_and_disjoint(rows: int) -> None:
    """The tail starts on 16 bytes whatever the row count (one Triton variant, not two), after
    the bits and inside mask_numel."""
    import torch

    from photon.structured.bitmask import mask_numel, mask_views

    flat = torch.zeros(mask_numel(128, 3835), dtype=torch.int32)
    mask = mask_views(flat, rows, 3835)
    assert mask.tail.data_ptr() % 16 == 0 and mask.tail.numel() == rows
    assert mask.tail.data_ptr() >= mask.bits.data_ptr() + mask.bits.numel() * 4
    assert (mask.tail.data_ptr() - flat.data_ptr()) // 4 + rows == mask_numel(rows, 3835)


def test_split_fill_equals_one_call_and_reraises(llm: LLM) -> None:
    """SplitFill deals 20 rows to 2 threads (at least 8 rows each) round-robin: the masks equal
    one serial call's, rows not listed stay untouched, and a part's error reaches the caller."""
    import torch

    from photon.structured.xgrammar_backend import SplitFill, XGrammarBackend

    backend = XGrammarBackend(llm.engine.tokenizer, 1024, threads=2)
    compiled = llm.engine.structured.compile(SO(json=SCHEMAS[0])).result()
    matchers = [backend.matcher(compiled) for _ in range(20)]
    tok = llm.engine.tokenizer
    for i, m in enumerate(matchers):  # different states: prefixes of one valid document
        for t in tok.encode('{"name": "ab", "age": 7, "tags": []}')[:i % 9]:
            assert m.accept(t)
    handles = [m.handle for m in matchers]
    rows = list(range(1, 21))
    serial, split = (torch.full((22, backend.mask_words), 7, dtype=torch.int32) for _ in range(2))
    SplitFill(1)(handles, serial, rows)
    SplitFill(2)(handles, split, rows)
    assert torch.equal(serial, split)
    assert (split[0] == 7).all() and (split[21] == 7).all()
    assert not torch.equal(split[1], split[5])  # the states differ, so do their masks
    with pytest.raises(RuntimeError):
        SplitFill(2)(handles, torch.zeros(22, 3, dtype=torch.int32), rows)  # wrong width


@pytest.mark.parametrize("spec, text", [
    (SO(json=SCHEMAS[0]), '{"name": "ab", "age": 7, "tags": []}'),
    (SO(regex=r"[0-9]{1,4}(\.[0-9]{1,2})?"), "12.5"),
    (SO(choice=["on", "off", "onward"]), "on"),
])
def test_stop_token_set_predicts_termination(llm: LLM, spec: SO, text: str) -> None:
    """GrammarRows.accept takes a grammar's end from the stop-token set instead of asking the
    matcher: after every accepted token it equals the matcher's own is_terminated() (a matcher
    accepts a stop token only where the grammar may end); an ended grammar fills nothing more."""
    engine = llm.engine
    grammar = _ready(engine.structured.request_grammar(spec))
    backend = engine.structured.backend
    stops = sorted(backend.stop_token_ids)
    assert stops
    matcher = backend.matcher(grammar.future.result())
    assert not backend.matcher(grammar.future.result()).accept(stops[0])  # cannot end yet
    table, requests = _grammar_rows(engine.structured, [grammar])
    ended = False
    for t in [*engine.tokenizer.encode(text), stops[0]]:
        fills = _all_filled(table)
        assert fills.rows.size == 1
        accepts = table.accept(fills, requests, np.array([t]))
        assert accepts.handles.tolist() == [grammar.handle] and accepts.tokens.tolist() == [t]
        assert backend.accept_tokens([matcher], [t]) == [True]
        ended = accepts.ended.size == 1
        assert ended == matcher.is_terminated()
    assert ended and _all_filled(table).rows.size == 0
    assert backend.accept_tokens([matcher], [stops[0]]) == [False]  # nothing after the end


def test_grammar_rejection_aborts_only_that_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A matcher rejecting a committed token (an engine bug: the mask forbids it) ends that
    request with finish_reason "abort" and an error; the other requests and the engine go on.
    (Inline executor: the rejection is injected into the engine process's backend.)"""
    core = LLM("photon-tiny-random", max_model_len=512, max_num_seqs=16, structured_outputs_worker="inline").engine
    backend = core.structured.backend
    real = backend.accept_tokens
    calls = {"n": 0}

    def reject_third(matchers: list, tokens: list[int]) -> list[bool]:  # the third step's
        calls["n"] += 1
        ok = real(matchers, tokens)
        return [False] * len(ok) if calls["n"] == 3 else ok

    monkeypatch.setattr(backend, "accept_tokens", reject_third)
    spec = SO(json=SCHEMAS[0])
    core.add_request("a", SamplingParams(temperature=1.0, seed=1, max_tokens=50,
                                         structured_outputs=spec), request_id="bad")
    core.add_request("b", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     request_id="plain")
    final = {}
    while core.has_unfinished():
        final |= {o.request_id: o for o in core.step() if o.finished}
    bad, plain = final["bad"], final["plain"]
    assert bad.outputs[0].finish_reason == "abort" and len(bad.outputs[0].token_ids) == 3
    assert bad.error is not None and "rejected" in bad.error
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 8
    core.assert_drained()
    monkeypatch.undo()
    core.add_request("a", SamplingParams(temperature=1.0, seed=1, max_tokens=50,
                                         structured_outputs=spec), request_id="again")
    while core.has_unfinished():
        final |= {o.request_id: o for o in core.step() if o.finished}
    assert final["again"].outputs[0].finish_reason in ("stop", "length")


def test_worker_reports_rejections_and_fills_live_rows(llm: LLM) -> None:
    """The grammar-worker process accepts a step's tokens and fills the next masks in one job:
    a token its grammar forbids comes back rejected (its row all ones, so the request can only
    abort), the live row's mask equals the engine-side backend's for the same state."""
    from photon.structured.bitmask import mask_numel, mask_views
    from photon.structured.worker import ProcessExecutor

    manager = llm.engine.structured
    assert isinstance(manager.executor, ProcessExecutor)
    spec = SO(json=SCHEMAS[0])
    good, bad = (_ready(manager.request_grammar(spec)) for _ in range(2))
    tok = llm.engine.tokenizer
    first = tok.encode('{"')[0]
    words = manager.backend.mask_words
    mask = mask_views(manager.executor.mask_buffer(1, mask_numel(2, words)), 2, words)
    table, requests = _grammar_rows(manager, [good, bad])
    acc = table.accept(_all_filled(table), requests, np.array([first, tok.encode("]")[0]]))
    fills = table.fill(requests, np.arange(2), np.ones(2, dtype=np.int64), mask)
    assert fills.rows.tolist() == [0, 1]  # a rejection shows only once the job ran
    manager.submit(StepJob(acc.handles, acc.tokens, fills.rows, fills.handles), mask, 1)
    assert manager.wait() == [1]  # the second accept: `bad`'s
    assert (mask.bits[1] == -1).all()
    reference = manager.backend.matcher(good.future.result())
    assert reference.accept(first)
    expected = mask.bits.clone()
    manager.backend.fill_bitmasks([reference], expected, [0])
    assert torch.equal(mask.bits[0], expected[0]) and not (mask.bits[0] == -1).all()


def test_handle_released_mid_job_is_reused_only_after_it(llm: LLM) -> None:
    """A request can be released in the commit that submitted its last accept. Its matcher
    handle is closed only once that job was waited for: a rejection in it is reported by its
    place among the job's accepts (the grammar step maps it to the request it submitted), and a
    grammar opened meanwhile gets another handle."""
    manager = llm.engine.structured
    executor = manager.executor
    spec = SO(json=SCHEMAS[0])
    old = _ready(manager.request_grammar(spec))
    open_before = executor.open_matchers
    bad = llm.engine.tokenizer.encode("]")[0]  # a JSON object cannot start with it
    manager.submit(StepJob(np.array([old.handle]), np.array([bad]), _NONE, _NONE), None, 0)
    handle = old.handle
    old.release()
    new = _ready(manager.request_grammar(spec))
    assert new.handle != handle
    assert manager.wait() == [0]  # the job's first (only) accept: old's
    assert executor.open_matchers == open_before  # old's handle closed after the job, new open
    freed = (handle, new.handle)
    new.release()
    assert executor.open_matchers == open_before - 1
    reused = _ready(manager.request_grammar(spec))
    assert reused.handle in freed
    reused.release()


def test_worker_fence_words_follow_jobs(llm: LLM) -> None:
    """Each job sets its mask buffer's fence word to the job's number once it is done, also when
    it failed (the GPU waits on that word), and a dead worker's words are set by the engine side
    so a GPU waiting on them would go on. (On CPU nothing waits on them: device_fence is None.)"""
    from photon.structured.worker import ProcessExecutor

    manager = llm.engine.structured
    executor = manager.executor
    assert isinstance(executor, ProcessExecutor) and executor.device_fence(0) is None
    grammar = _ready(manager.request_grammar(SO(regex="[a-z]+")))
    tok = llm.engine.tokenizer.encode("a")[0]
    for index in (0, 1, 1, 0):
        manager.submit(StepJob(np.array([grammar.handle]), np.array([tok]), _NONE, _NONE),
                       None, index)
        assert manager.wait() == []
        assert int(executor.fences[index]) == executor.fence_values[index] > 0
    no_such_matcher = StepJob(_NONE, _NONE, np.array([0]), np.array([10_000]))
    executor.submit(no_such_matcher, None, 1)
    with pytest.raises(RuntimeError, match="grammar worker: KeyError"):
        executor.wait()
    assert int(executor.fences[1]) == executor.fence_values[1]
    assert executor.fence_values[1] > executor.fence_values[0]


def test_dead_worker_releases_fences() -> None:
    """A worker that dies with a job queued: the engine side sets the job's fence word."""
    import signal

    from photon.structured.worker import ProcessExecutor

    llm = LLM("photon-tiny-random", max_model_len=256, max_num_seqs=4)
    executor = llm.engine.structured.executor
    assert isinstance(executor, ProcessExecutor)
    assert llm.engine.structured.start(wait_s=120)
    executor.proc.send_signal(signal.SIGSTOP)  # the job below is queued, never run
    executor.submit(StepJob(_NONE, _NONE, _NONE, _NONE), None, 0)
    executor.proc.kill()
    executor.proc.wait()
    assert list(executor.fences) == [0, 0] and executor.fence_values == [1, 0]
    with pytest.raises(RuntimeError, match="the grammar worker died"):
        executor.wait()
    assert list(executor.fences) == [1, 0]


@pytest.mark.parametrize("pipelined", [True, False])
def test_worker_death_mid_run_fails_only_grammar_requests(pipelined: bool) -> None:
    """The grammar worker is killed while grammar and plain requests decode together: the
    grammar requests end with "abort" and a clear error, the plain ones finish untouched, every
    block and row is freed, and the engine serves plain requests afterwards."""
    import signal

    core = LLM("photon-tiny-random", max_model_len=256, max_num_seqs=8, pipelined=pipelined).engine
    assert core.structured.start(wait_s=120)
    spec = SO(json=SCHEMAS[0])
    for i in range(2):
        core.add_request(f"g{i}", SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                                 structured_outputs=spec), request_id=f"g{i}")
        core.add_request(f"p{i}", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         request_id=f"p{i}")
    final: dict = {}
    for _ in range(6):
        final |= {o.request_id: o for o in core.step() if o.finished}
    assert not final  # everything still decoding
    core.structured.executor.proc.send_signal(signal.SIGKILL)
    while core.has_unfinished():
        final |= {o.request_id: o for o in core.step() if o.finished}
    for i in range(2):
        g, p = final[f"g{i}"], final[f"p{i}"]
        assert g.outputs[0].finish_reason == "abort"
        assert "structured outputs are unavailable" in g.error
        assert p.error is None and p.outputs[0].finish_reason == "length"
        alone = LLM("photon-tiny-random", max_model_len=256, max_num_seqs=8).generate(
            [f"p{i}"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
            use_tqdm=False)[0]
        assert p.outputs[0].token_ids == alone.outputs[0].token_ids  # greedy: unchanged
    core.assert_drained()
    core.add_request("again", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                     request_id="again")
    while core.has_unfinished():
        final |= {o.request_id: o for o in core.step() if o.finished}
    assert len(final["again"].outputs[0].token_ids) == 5


def test_grammar_worker_lifecycle() -> None:
    """The worker process starts with the first grammar; a dropped engine ends it (no reference
    cycle keeps the executor alive), shutdown() ends it at once, and once it died a new grammar
    request fails with a clear error (not a hang) while plain requests are still served."""

    from photon.engine.async_engine import AsyncEngine

    def started() -> tuple[LLM, object]:
        llm = LLM("photon-tiny-random", max_model_len=256, max_num_seqs=4)
        out = llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a-z]+")),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids
        return llm, llm.engine.structured.executor.proc

    llm, proc = started()
    del llm  # no gc.collect(): a reference cycle would keep the worker running
    assert proc.wait(timeout=30) == 0
    llm, proc = started()
    AsyncEngine(llm.engine).shutdown()
    assert proc.poll() is not None
    llm, proc = started()
    proc.kill()
    proc.wait()
    with pytest.raises(ValueError, match="structured outputs are unavailable: the grammar worker"):
        llm.generate(["b"], SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a-z]+")),
                     use_tqdm=False)
    plain = llm.generate(["c"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(plain.outputs[0].token_ids) == 3
