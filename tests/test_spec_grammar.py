"""Structured outputs with n-gram speculation: the host's n-gram proposal equals the device's, the
grammar job fills a mask for every verified position (matcher accepts, then rollback), and in
the engine greedy grammar requests give exactly the tokens of the engine without speculation,
pipelined and blocking, with drafts verified and accepted for grammar rows; seeded sampling
keeps the grammar and pipelined equals blocking; a reasoning gate speculates only once open."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from photon import LLM, SamplingParams
from photon.engine.scheduler import speculates
from photon.model.tiny import ensure_photon_tiny_random
from photon.spec import grammar_drafter
from photon.spec.ngram import propose_ngram
from photon.spec.ngram_host import HostNgram, propose_ngram_host
from photon.spec.proposer import ProposeContext
from photon.structured.backend import create_backend
from photon.structured.bitmask import mask_numel, mask_views
from photon.structured.executor import StepJob, run_job
from photon.structured.params import StructuredOutputsParams as SO
from photon.structured.rows import GrammarRows, RowLayout
from photon.tokenizer import Tokenizer
from tests.test_pipeline import Spec, run
from tests.test_structured_pipeline import SCHEMA, _gated

REGEX = r"([0-9]{1,3}[a-c]){1,12}"
CHOICES = ["alpha beta alpha beta", "gamma"]


# ---- the host's proposal ----------------------------------------------------------------------
@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (1, 3, 3), (2, 4, 5), (3, 3, 2), (2, 6, 4)])
def test_host_ngram_equals_the_device_proposal(min_n: int, max_n: int, k: int) -> None:
    """On rows of few distinct tokens (many matches, ties and overlaps), every length from 0 and
    max_model_len cuts: the host's drafts are the torch path's (the Triton kernel's oracle)."""
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k)
    rows, width = 96, 40
    pool = torch.from_numpy(rng.integers(0, 4, size=(rows, width)).astype(np.int32))
    pool[::3] = torch.from_numpy(rng.integers(0, 2, size=(rows // 3, width)).astype(np.int32))
    lens = torch.from_numpy(rng.integers(0, width + 1, size=rows))
    max_model_len = 36
    ctx = ProposeContext(pool, torch.arange(rows), lens, k)
    prop = propose_ngram(ctx, min_n, max_n, max_model_len, fused=False)
    found = 0
    for b in range(rows):
        n = int(prop.num_draft[b])
        host = propose_ngram_host(pool[b, :lens[b]].numpy(), k, min_n, max_n, max_model_len)
        assert host.tolist() == prop.draft_ids[b, :n].tolist(), (b, pool[b, :lens[b]].tolist())
        found += n > 0
    assert found > rows // 4


# ---- the job: a mask per verified position ------------------------------------------------------
@pytest.fixture(scope="module")
def backend() -> object:
    tok = Tokenizer.from_pretrained(ensure_photon_tiny_random())
    return create_backend("xgrammar", tok, 1024, 1), tok


def test_job_fills_the_mask_after_each_draft_and_rolls_back(backend: tuple) -> None:
    """Row 0 verifies 3 drafts the grammar allows: its 4 masks are a reference matcher's after
    0..3 of them. Row 1's third draft is refused: the mask after it allows all. The matchers
    are where they were (the next job's fill equals the first mask). At commit a row accepts its
    emitted tokens up to the grammar's stop token, which ends it (ended_at: its place)."""
    back, tok = backend
    compiled = back.compile(SO(regex=REGEX))
    ids = [tok.encode(c)[0] for c in "12a3b"]
    matchers = {0: back.matcher(compiled), 1: back.matcher(compiled)}
    words = back.mask_words
    bits = mask_views(torch.zeros(mask_numel(8, words), dtype=torch.int32), 8, words).bits
    job = StepJob(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.array([0, 4]),
                  np.array([0, 1]), np.array([3, 3]),
                  np.array([ids[0], ids[1], ids[2], ids[0], ids[2], ids[2]]))
    assert run_job(back, matchers, job, bits) == []
    ref = back.matcher(compiled)
    expected = torch.zeros_like(bits)
    back.fill_bitmasks([ref], expected, [0])
    for j, t in enumerate(ids[:3]):
        assert ref.accept(t)
        back.fill_bitmasks([ref], expected, [j + 1])
    assert torch.equal(bits[:4], expected[:4])
    assert torch.equal(bits[4:6], expected[:2])  # "1" then "a": allowed
    after_1a = torch.zeros_like(bits)
    back.fill_bitmasks([_after(back, compiled, [ids[0], ids[2]])], after_1a, [0])
    assert torch.equal(bits[6], after_1a[0])  # the mask that refuses the next "a"
    assert (bits[7] == -1).all()  # past the refused draft: never emitted
    again = torch.zeros_like(bits)
    back.fill_bitmasks([matchers[0], matchers[1]], again, [0, 1])
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[0])

    stop = next(iter(back.stop_token_ids))
    table = GrammarRows(2, back.stop_token_ids, words, lambda known: np.array(ids[:5]))
    req = _request(0)
    table.assign(0, req)
    fills = table.fill([req], np.array([0]), np.array([-1]),
                       mask_views(torch.zeros(mask_numel(4, words), dtype=torch.int32), 4, words),
                       RowLayout.of(np.array([4])))
    acc = table.accept(fills, [req], np.array([ids[0], stop, ids[1], -1]))
    assert acc.tokens.tolist() == [ids[0], stop] and acc.rows.tolist() == [0, 0]
    assert fills.num_drafts.tolist() == [3] and fills.draft_tokens.tolist() == ids[:3]
    assert fills.mask_rows.tolist() == [0]
    assert acc.ended.tolist() == [0] and acc.ended_at.tolist() == [1]
    assert table.sent[0] == 2 and table.handle[0] == -1
    assert table.known[0] == [5, 6, ids[0], stop]


def _after(back: object, compiled: object, tokens: list[int]) -> object:
    matcher = back.matcher(compiled)
    assert all(matcher.accept(t) for t in tokens)
    return matcher


def _request(handle: int) -> SimpleNamespace:
    return SimpleNamespace(grammar=SimpleNamespace(handle=handle, start_after=None),
                           finished=False, output_token_ids=[], prompt_token_ids=[5, 6])


# ---- the engine ---------------------------------------------------------------------------------
def _llm(pipelined: bool, k: int | None = None, **kw: object) -> LLM:
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                   "adaptive": False}
    return LLM(**{"model": "photon-tiny-random", "pipelined": pipelined, "max_model_len": 256,
                  "speculative_config": spec, "structured_outputs_worker": "inline", **kw})


def _grammar_specs(greedy: bool) -> list[Spec]:
    rng = random.Random(7)
    pattern = [rng.randrange(3, 1000) for _ in range(5)]

    def so(spec: SO, seed: int) -> SamplingParams:
        if greedy:
            return SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=spec)

    return [
        Spec(pattern * 3, so(SO(json=SCHEMA), 1)),
        Spec(pattern * 4, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
        Spec(pattern * 2, so(SO(regex=REGEX), 2)),
        Spec(pattern, so(SO(choice=CHOICES), 3)),
        Spec(pattern * 2 + [17], SamplingParams(temperature=0.8, seed=9, max_tokens=20)),
    ]


def _grammar_rows(audit: object, rid: str) -> tuple[int, int]:
    """(rows verifying drafts, sampling rows) of request `rid`."""
    verifying = samples = 0
    for rows, specs in zip(audit.schedule, audit.row_spec):
        for (r, _, _, sample), spec in zip(rows, specs):
            if r == rid and sample:
                samples += 1
                verifying += bool(spec)
    return verifying, samples


def _check_grammars(llm: LLM, out: dict) -> None:
    tok = llm.engine.tokenizer
    ids, finish = out["r0"][0]
    assert finish == "stop"
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    ids, finish = out["r2"][0]
    assert re.fullmatch(REGEX, tok.decode(ids)) and finish in ("stop", "length")
    ids, finish = out["r3"][0]
    assert finish == "stop" and tok.decode(ids) in CHOICES


def test_greedy_grammar_speculation_gives_the_tokens_without_speculation() -> None:
    specs = _grammar_specs(greedy=True)
    base, _ = run(_llm(False), specs)
    llm_p, llm_b = _llm(True, 3), _llm(False, 3)
    pipelined, audit = run(llm_p, specs)
    blocking, _ = run(llm_b, specs)
    assert pipelined == blocking
    greedy = ("r0", "r1", "r2", "r3")  # r4 samples: its draws differ with speculation
    assert {r: pipelined[r] for r in greedy} == {r: base[r] for r in greedy}
    _check_grammars(llm_p, pipelined)
    for rid in ("r0", "r2", "r3"):
        verifying, samples = _grammar_rows(audit, rid)
        assert verifying > 0, rid
    # Accepted drafts: fewer sampling rows than tokens.
    assert sum(_grammar_rows(audit, rid)[1] for rid in ("r0", "r2", "r3")) < sum(
        len(pipelined[rid][0][0]) for rid in ("r0", "r2", "r3"))
    assert llm_p.engine.runner.spec.counters.num_accepted_tokens > 0


def test_seeded_grammar_speculation_pipelined_equals_blocking() -> None:
    """Sampled rows verify on the masked target distribution: pipelined equals blocking, and
    every output keeps its grammar. The grammar worker process serves the pipelined run."""
    specs = _grammar_specs(greedy=False)
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=4, num_gpu_blocks_override=40,
              max_model_len=160)
    pipelined, audit = run(_llm(True, 3, structured_outputs_worker="process", **kw), specs)
    llm_b = _llm(False, 3, **kw)
    blocking, _ = run(llm_b, specs)
    assert pipelined == blocking
    _check_grammars(llm_b, blocking)
    assert sum(_grammar_rows(audit, rid)[0] for rid in ("r0", "r2", "r3")) > 0


def test_reasoning_gate_speculates_once_open() -> None:
    """A grammar that starts after an end-of-reasoning token runs plain rows while the gate is
    closed, speculates after it; pipelined equals blocking and the output after the gate keeps
    its grammar."""
    rng = random.Random(3)
    pattern = [rng.randrange(3, 1000) for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=SCHEMA))
    specs = [Spec(pattern * 3, params)]
    free, _ = run(_gated(_llm(True, 3), 1023), specs)
    end = free["r0"][0][0][4]
    llm_p = _gated(_llm(True, 3), end)
    pipelined, audit = run(llm_p, specs)
    blocking, _ = run(_gated(_llm(False, 3), end), specs)
    assert pipelined == blocking
    ids, finish = pipelined["r0"][0]
    k = ids.index(end)
    assert ids[:k + 1] == free["r0"][0][0][:k + 1] and finish == "stop"
    jsonschema.validate(json.loads(llm_p.engine.tokenizer.decode(ids[k + 1:])), SCHEMA)
    rows = [spec for rows, specs in zip(audit.schedule, audit.row_spec)
            for (_, _, _, sample), spec in zip(rows, specs) if sample]
    assert any(rows) and not any(rows[:k + 2])  # plain rows up to the gate token (and the row
    # planned before its commit), speculative ones after


def test_grammar_requests_speculate_with_ngram_only() -> None:
    """The host knows n-gram drafts, not a draft model's: only ngram makes a grammar drafter."""
    def config(method: str | None) -> SimpleNamespace:
        spec = None if method is None else SimpleNamespace(
            method=method, k=3, prompt_lookup_min=1, prompt_lookup_max=2)
        return SimpleNamespace(speculative_config=spec, model=SimpleNamespace(max_model_len=64))

    assert grammar_drafter(config("ngram")) == HostNgram(3, 1, 2, 64)
    assert grammar_drafter(config("draft_model")) is None
    assert grammar_drafter(config(None)) is None
    req = SimpleNamespace(grammar=object())
    assert speculates(req, True) and not speculates(req, False)
