"""Speculative decoding (n-gram proposer) in the engine: greedy gives exactly the tokens of greedy
without speculation, pipelined equals blocking (same schedules, same tokens), and speculation
combines with seeded sampling, top-k/top-p/min-p, penalties, logprobs, stop strings and ids,
max_tokens, n > 1, aborts, preemption, prefix caching and grammar requests (tests/
test_spec_grammar.py has more). Every run ends with a drain audit (no KV block used, no request index held)."""

from __future__ import annotations

import json
import random

import pytest

from photon import LLM, SamplingParams
from photon.engine.kv_cache import KVCacheManager
from photon.structured.params import StructuredOutputsParams as SO
from tests.test_pipeline import Spec, _shared_prefix_specs, run
from tests.test_structured_pipeline import SCHEMA


def _llm(pipelined: bool, k: int | None = None, **kw: object) -> LLM:
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                   "adaptive": False}
    return LLM(**{"model": "photon-tiny-random", "pipelined": pipelined, "max_model_len": 256,
                  "speculative_config": spec, **kw})


def _accepted(llm: LLM) -> int:
    return llm.engine.runner.spec.counters.num_accepted_tokens


def _prompts(seed: int) -> list[list[int]]:
    """Prompts with repetition (the n-gram proposer finds matches, drafts get accepted) and
    without."""
    rng = random.Random(seed)
    pattern = [rng.randrange(3, 1000) for _ in range(5)]
    return [pattern * 6, [rng.randrange(3, 1000) for _ in range(3)] * 4 + pattern,
            [rng.randrange(3, 1000) for _ in range(17)], [rng.randrange(3, 1000)]]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_gives_the_tokens_of_greedy_decoding(k: int) -> None:
    specs = [Spec(p, GREEDY) for p in _prompts(k)]
    base, _ = run(_llm(False), specs)
    llm_p, llm_b = _llm(True, k), _llm(False, k)
    pipelined, audit_p = run(llm_p, specs)
    blocking, audit_b = run(llm_b, specs)
    assert pipelined == base
    assert blocking == base
    assert audit_p.schedule == audit_b.schedule
    assert _accepted(llm_p) == _accepted(llm_b) > 0


def test_greedy_near_max_model_len() -> None:
    """Drafts stop at max_model_len and zombie rows resolve positions past it safely."""
    pattern = [11, 12, 13, 14]
    specs = [Spec(pattern * 10, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
             Spec(pattern * 9 + [15], SamplingParams(temperature=0, max_tokens=27,
                                                     ignore_eos=True))]
    kw = dict(max_model_len=64, block_size=4)
    base, _ = run(_llm(False, **kw), specs)
    for pipelined in (True, False):
        out, _ = run(_llm(pipelined, 5, **kw), specs)
        assert out == base
        assert [len(o[0][0]) for o in (out["r0"], out["r1"])] == [24, 27]


def _logprob_run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    ids = [core.add_request(p, params) for p in prompts]
    last = {}
    while core.has_unfinished():
        for out in core.step():
            last[out.request_id] = out.outputs[0]
    core.assert_drained()
    return [(last[i].token_ids, last[i].logprobs) for i in ids]


def test_greedy_logprobs_equal_the_plain_engines() -> None:
    """The logprob, rank and top alternatives of every accepted token are those the plain engine
    computes for the same token."""
    prompts = _prompts(7)
    base = _logprob_run(_llm(False), prompts)
    llm = _llm(True, 3)
    spec = _logprob_run(llm, prompts)
    assert _accepted(llm) > 0
    for (toks_b, lps_b), (toks_s, lps_s) in zip(base, spec):
        assert toks_s == toks_b
        assert len(lps_s) == len(lps_b) == len(toks_b)
        for a, b in zip(lps_s, lps_b):
            assert list(a) == list(b)  # the token, then its top alternatives, same order
            for tid in a:
                assert a[tid].rank == b[tid].rank
                assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)


def _mixed_specs(stop_id: int) -> list[Spec]:
    rng = random.Random(9)
    pattern = [rng.randrange(3, 1000) for _ in range(4)]

    def prompt(n: int) -> list[int]:
        return pattern * 3 + [rng.randrange(3, 1000) for _ in range(n)]

    return [
        Spec(prompt(3), SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)),
        Spec(prompt(40), SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=15,
                                        ignore_eos=True, top_k=20, top_p=0.9)),
        Spec(prompt(5), SamplingParams(temperature=0.7, seed=2, max_tokens=30, min_p=0.05,
                                       stop_token_ids=[500, 501, 502, 503, 504])),
        Spec(prompt(2), SamplingParams(temperature=0, max_tokens=30, stop=["e"])),
        Spec(prompt(7), SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                                       repetition_penalty=1.3, presence_penalty=0.5,
                                       frequency_penalty=0.2)),
        Spec(prompt(9), SamplingParams(temperature=0.9, seed=8, max_tokens=40, ignore_eos=True,
                                       logit_bias={7: 3.0}), abort_after=9),
        Spec(prompt(1), SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
             abort_after=3),
        Spec(prompt(4), SamplingParams(temperature=0, max_tokens=1)),
        Spec(pattern * 8, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                         stop_token_ids=[stop_id])),
        Spec(pattern * 8, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
    ]


def test_sampling_features_with_speculation_under_preemption() -> None:
    """Seeded sampled runs repeat exactly, pipelined equals blocking (schedules included), and
    the stop checks cut speculative rows: max_tokens exactly, a stop id ends the output."""
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=40,
              max_model_len=128)
    # A stop id the greedy request r8 produces mid-way (its output without the stop id).
    probe_spec = _mixed_specs(0)[8]
    probe, _ = run(_llm(False, **kw), [Spec(probe_spec.prompt, GREEDY)])
    free_run = probe["r0"][0][0]
    stop_id = free_run[10]
    specs = _mixed_specs(stop_id)
    runs = [run(_llm(pipelined, 3, **kw), specs) for pipelined in (True, True, False)]
    (first, audit), (again, _), (blocking, audit_b) = runs
    assert first == again == blocking
    assert audit.schedule == audit_b.schedule
    assert audit.core.scheduler.num_preemptions > 0  # the small cache forced preemption
    assert audit.zombie_rows > 0
    assert audit.core.runner.spec.counters.num_accepted_tokens > 0
    assert len({tuple(t) for t, _ in first["r1"]}) == 3  # n = 3: three samples
    for rid, max_tokens in (("r0", 20), ("r1", 15)):
        assert all(len(t) == max_tokens and r == "length" for t, r in first[rid])
    assert first["r5"][0][1] == "abort" and first["r6"][0][1] == "abort"
    assert first["r7"][0] == (first["r7"][0][0], "length") and len(first["r7"][0][0]) == 1
    toks, reason = first["r8"][0]
    assert reason == "stop" and toks == free_run[:free_run.index(stop_id) + 1]


def test_prefix_caching_with_speculation() -> None:
    """Requests on shared prefixes: pipelined equals blocking, and greedy requests give the
    tokens of the engine without speculation."""
    specs = _shared_prefix_specs()
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=3)
    base, _ = run(_llm(False, **kw), specs)
    blocking, audit_b = run(_llm(False, 3, **kw), specs)
    pipelined, audit_p = run(_llm(True, 3, **kw), specs)
    assert audit_p.schedule == audit_b.schedule
    assert pipelined == blocking
    greedy = [f"r{i}" for i, s in enumerate(specs) if s.params.temperature == 0]
    assert greedy and all(pipelined[r] == base[r] for r in greedy)
    assert audit_p.core.kv.prefix_hits > 0


def test_grammar_requests_speculate_beside_plain_ones() -> None:
    rng = random.Random(2)
    pattern = [rng.randrange(3, 1000) for _ in range(5)]
    grammar = SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                             structured_outputs=SO(json=SCHEMA))
    specs = [Spec(pattern * 4, GREEDY), Spec(pattern * 2, grammar), Spec(pattern * 5, GREEDY)]
    inline = dict(structured_outputs_worker="inline")  # no worker process per engine
    base, _ = run(_llm(False, **inline), specs)
    llm = _llm(True, 3, **inline)
    pipelined, audit = run(llm, specs)
    blocking, _ = run(_llm(False, 3, **inline), specs)
    # Tokens, not schedules: when the grammar request is admitted depends on how long its
    # grammar takes to compile (a wall-clock race), which moves the other rows' steps.
    assert pipelined == blocking
    assert pipelined["r0"] == base["r0"] and pipelined["r2"] == base["r2"]
    assert _accepted(llm) > 0
    text = llm.engine.tokenizer.decode(pipelined["r1"][0][0])
    assert set(json.loads(text)) == {"id", "label", "kind"}
    rows = audit.core.scheduler
    assert rows.spec_k == 3


def test_which_requests_speculate() -> None:
    """Every request speculates with ngram: min_tokens and grammar ones too."""
    llm = _llm(True, 2)
    core = llm.engine
    core.add_request([5, 6, 7], GREEDY, request_id="plain")
    core.add_request([5, 6, 7], SamplingParams(max_tokens=8, min_tokens=2), request_id="min")
    core.add_request([5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=SO(
        json=SCHEMA)), request_id="grammar")
    by_id = {r.request_id: r.spec_k for r in core.scheduler.requests.values()}
    assert by_id == {"plain": 2, "min": 2, "grammar": 2}
    for rid in ("plain", "min", "grammar"):
        core.abort(rid)
    while core.has_unfinished() or not core.pipeline.idle:
        core.step()
    core.step()  # hand the runner the releases
    core.assert_drained()


def test_shrink_returns_reserved_blocks_but_never_published_ones() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.allocate("a", 20)  # 5 blocks
    kv.cache_blocks("a", list(range(8)), 8)  # 2 published
    kv.shrink("a", 13)
    assert len(kv.block_ids("a")) == 4 and kv.num_used_blocks == 4
    kv.shrink("a", 0)
    assert len(kv.block_ids("a")) == 2  # the published blocks stay
    kv.free("a")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


_END_KW = dict(model="photon-tiny", max_model_len=160, enable_prefix_caching=False)
_END_PARAMS = SamplingParams(temperature=0, ignore_eos=True, max_tokens=96)


@pytest.fixture(scope="module")
def ending_at_max_len() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts whose prompt + max_tokens is exactly max_model_len (160), and their greedy
    tokens without speculation."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(64)] for _ in range(4)]
    prompts.append([5, 6, 7, 8] * 16)
    want = [o.outputs[0].token_ids for o in
            LLM(**_END_KW).generate(prompts, _END_PARAMS, use_tqdm=False)]
    return prompts, want


@pytest.mark.parametrize(("pipelined", "method"), [(True, "ngram"), (False, "ngram"),
                                                    (True, "draft_model")])
def test_requests_ending_at_max_model_len_keep_the_engine_up(
        pipelined: bool, method: str,
        ending_at_max_len: tuple[list[list[int]], list[list[int]]]) -> None:
    """Requests whose prompt + max_tokens is exactly max_model_len: a zombie row verifying
    drafts past the end moves the device length beyond the token pool's row, and the n-gram
    proposer after it must not index past the row (it crashed the engine with an IndexError).
    Outputs equal greedy decoding without speculation."""
    prompts, want = ending_at_max_len
    spec: dict = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = "photon-tiny-draft"
    llm = LLM(**_END_KW, pipelined=pipelined, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _END_PARAMS, use_tqdm=False)]
    assert got == want and all(len(t) == 96 for t in got)
    llm.engine.assert_drained()
