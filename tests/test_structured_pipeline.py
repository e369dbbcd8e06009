"""Grammar requests through the pipeline: pipelined (depth 2) and blocking (depth 1) give identical
tokens and finish reasons when grammar requests are mixed with plain ones (the mask depends only
on committed tokens), under preemption and aborts, with the zombie/release invariants checked."""

from __future__ import annotations

import json
import random
import re

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photon import LLM, SamplingParams
from photon.reasoning import get_reasoning_parser
from photon.structured.params import StructuredOutputsParams as SO
from tests.test_pipeline import Spec, _engine, run

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "label": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["x", "y"]}}, "required": ["id", "label", "kind"]}
REGEX = r"[0-9]{1,4}(\.[0-9]{1,2})?"


def _specs() -> list[Spec]:
    rng = random.Random(5)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    def so(spec: SO, seed: int, **kw: object) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=spec,
                              **kw)

    return [
        Spec(prompt(6), so(SO(json=SCHEMA), 1)),
        Spec(prompt(40), SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)),
        Spec(prompt(9), so(SO(regex=REGEX), 2, n=2)),
        Spec(prompt(12), so(SO(choice=["alpha", "beta", "gamma delta"]), 3)),
        Spec(prompt(30), SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)),
        Spec(prompt(7), so(SO(json=SCHEMA), 4, logprobs=2)),
        Spec(prompt(15), so(SO(json=SCHEMA), 5), abort_after=4),
        Spec(prompt(20), so(SO(grammar='root ::= "(" [a-c]{1,5} ")" | [0-9]{2}'), 6)),
        Spec(prompt(10), so(SO(json=SCHEMA), 7, stop=['"kind"'])),  # a stop string ends it first
        Spec(prompt(5), SamplingParams(temperature=0, max_tokens=1)),
    ]


def test_grammar_pipelined_equals_blocking() -> None:
    specs = _specs()
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=40,
              max_model_len=160)
    blocking, _ = run(_engine(False, **kw), specs)
    engine = _engine(True, **kw)
    pipelined, audit = run(engine, specs)
    assert pipelined == blocking
    assert audit.zombie_rows > 0
    assert engine.engine.scheduler.num_preemptions > 0  # the small cache forced preemption
    tok = engine.engine.tokenizer
    for rid in ("r0", "r5"):
        ids, finish = blocking[rid][0]
        assert finish == "stop"
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    for ids, finish in blocking["r2"]:
        assert finish == "stop" and re.fullmatch(REGEX, tok.decode(ids))
    assert blocking["r3"][0][1] == "stop"
    assert tok.decode(blocking["r3"][0][0]) in ("alpha", "beta", "gamma delta")
    assert blocking["r6"][0][1] == "abort" and len(blocking["r6"][0][0]) == 4
    assert tok.decode(blocking["r8"][0][0]).endswith('"kind"')


_GRAMMARS = [SO(json=SCHEMA), SO(regex=REGEX), SO(choice=["on", "off", "onward"]), None, None]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.tuples(st.integers(0, len(_GRAMMARS) - 1), st.integers(0, 2**31),
                                st.lists(st.integers(3, 999), min_size=1, max_size=30),
                                st.one_of(st.none(), st.integers(1, 6))),
                      min_size=1, max_size=6),
       budget=st.sampled_from([8, 32]), tight=st.booleans())
def test_grammar_pipelined_equals_blocking_property(kinds: list, budget: int, tight: bool) -> None:
    specs = [Spec(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                                         structured_outputs=_GRAMMARS[k]), abort)
             for k, seed, prompt, abort in kinds]
    # Grammar jobs inline (no worker process to start per engine): the worker process runs the
    # same jobs (test_grammar_rows_on_threads_equal_serial checks it against inline).
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
              num_gpu_blocks_override=26 if tight else None, max_model_len=104 if tight else 256,
              structured_outputs_worker="inline")
    blocking, _ = run(_engine(False, **kw), specs)
    pipelined, _ = run(_engine(True, **kw), specs)
    assert pipelined == blocking


def test_grammar_rows_on_threads_equal_serial() -> None:
    """32 grammar rows a step: with 4 backend threads the rows are dealt to 4 parallel xgrammar
    calls (while at least 8 rows each remain); tokens, finish reasons and the drain invariants
    equal the one-thread run, inline and in the grammar-worker process. (The thread split is spied
    on inline, in this process.)"""
    rng = random.Random(11)
    grammars = [SO(json=SCHEMA), SO(regex=REGEX), SO(choice=["on", "off", "onward"])]
    specs = [Spec([rng.randrange(3, 1000) for _ in range(rng.randrange(2, 20))],
                  SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                 structured_outputs=grammars[i % 3]),
                  abort_after=5 if i % 7 == 0 else None)
             for i in range(32)]
    kw = dict(block_size=8, max_num_seqs=32)
    serial, _ = run(_engine(True, structured_outputs_threads=1, structured_outputs_worker="inline",
                            **kw), specs)
    assert run(_engine(True, **kw), specs)[0] == serial  # the grammar-worker process (default)
    engine = _engine(True, structured_outputs_threads=4, structured_outputs_worker="inline", **kw)
    assert engine.engine.structured.config.threads == 4
    split = engine.engine.structured.backend.fill
    second = split.batches[1] = _CountingBatch(split.batches[1])  # used from 16 rows on
    threaded, _ = run(engine, specs)
    assert threaded == serial
    assert second.calls > 0 and min(second.rows) >= 8  # each part got at least 8 rows
    tok = engine.engine.tokenizer
    for i in range(0, 32, 3):
        ids, finish = serial[f"r{i}"][0]
        if finish == "stop":
            jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


class _CountingBatch:
    """Wraps one part's BatchGrammarMatcher, recording how many rows each call filled."""

    def __init__(self, inner: object) -> None:
        self.inner, self.rows = inner, []

    @property
    def calls(self) -> int:
        return len(self.rows)

    def batch_fill_next_token_bitmask(self, handles: list, *args: object) -> None:
        self.rows.append(len(handles))
        self.inner.batch_fill_next_token_bitmask(handles, *args)


class _Tags:
    """A vocabulary in which `</think>` is token `end` (a token the random model samples)."""

    def __init__(self, end: int) -> None:
        self.ids = {"<think>": 1, "</think>": end}

    def token_to_id(self, token: str) -> int | None:
        return self.ids[token]


def _gated(llm: LLM, end: int) -> LLM:
    llm.engine.reasoning = get_reasoning_parser("deepseek_r1")(_Tags(end))
    return llm


def test_reasoning_gate_pipelined_equals_blocking() -> None:
    """Grammars that start after an end-of-reasoning token (masks allow all until it is
    committed) give the same tokens pipelined and blocking, under preemption and aborts. Until
    the gate opens a request samples as if it had no grammar (the sampler's draws depend only
    on its seed and position); after it, its output keeps the grammar."""
    specs = _specs()
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=40,
              max_model_len=160)
    never = 1023  # a vocabulary-padding row: not sampled
    free, _ = run(_gated(_engine(True, **kw), never), specs)
    assert all(never not in ids for outs in free.values() for ids, _ in outs)
    end = free["r0"][0][0][5]
    blocking, _ = run(_gated(_engine(False, **kw), end), specs)
    engine = _gated(_engine(True, **kw), end)
    pipelined, _ = run(engine, specs)
    assert pipelined == blocking
    assert engine.engine.scheduler.num_preemptions > 0
    ids, finish = blocking["r0"][0]
    k = ids.index(end)
    assert ids[:k + 1] == free["r0"][0][0][:k + 1] and finish == "stop"
    jsonschema.validate(json.loads(engine.engine.tokenizer.decode(ids[k + 1:])), SCHEMA)
