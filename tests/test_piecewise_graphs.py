"""Piecewise graphs (photon.worker.piecewise_graphs) run on CPU with their pieces called eagerly
over the same static buffers, in the same order: the token buckets, the padding rows, and
engines whose steps outside the decode graphs run piecewise give the tokens, logprobs and
schedules of engines running them op by op, with and without speculation (the capture itself is
a `gpu` test: tests/gpu/test_cuda_piecewise.py)."""

from __future__ import annotations

import copy
import random

import pytest

from photon import LLM, SamplingParams
from photon.worker import model_runner
from photon.worker.inputs import HostStep, build_step_inputs, pad_tokens
from photon.worker.piecewise_graphs import PiecewiseGraphs, token_buckets
from tests.test_pipeline import Spec, _mixed_specs, _shared_prefix_specs, run
from tests.test_spec_draft_engine import DRAFT, TARGET
from tests.test_spec_engine import _mixed_specs as _spec_mixed_specs


def test_token_buckets() -> None:
    assert token_buckets(2048)[:17] == list(range(16, 257, 16)) + [288]
    assert token_buckets(2048)[-9:] == [1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    assert len(token_buckets(2048)) == 16 + 3 * 8
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96, 100]
    assert token_buckets(300) == list(range(16, 257, 16)) + [288, 300]
    buckets = token_buckets(2048)
    graphs = PiecewiseGraphs.__new__(PiecewiseGraphs)
    graphs.buckets = buckets
    for n in range(1, 2049):
        b = graphs.bucket(n)
        assert b in buckets and n <= b <= n + max(15, n // 8)
    assert graphs.bucket(2049) is None


def _first_step(monkeypatch: pytest.MonkeyPatch) -> HostStep:
    """The host inputs of an engine's first step: prompts of 9 and 3 tokens."""
    steps: list[HostStep] = []

    def keep(*args: object) -> HostStep:
        steps.append(build_step_inputs(*args))
        return copy.deepcopy(steps[-1])

    monkeypatch.setattr(model_runner, "build_step_inputs", keep)
    llm = LLM("photon-tiny-random", block_size=4, max_model_len=64)
    llm.generate([list(range(3, 12)), [5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
    return steps[0]


def test_padding_rows_are_one_token_each_in_the_null_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    host = _first_step(monkeypatch)
    inp = host.inputs
    before = inp.query_start_loc.tolist()
    width = inp.block_tables.shape[1]
    assert before == [0, 9, 12] and host.padding == 0
    pad_tokens(host, 16)
    inp = host.inputs
    assert host.padding == 4
    for name in ("positions", "pool_idx", "slot_mapping", "lora_slots"):
        arr = getattr(inp, name)
        assert arr.shape[0] == 16 and not arr[12:].any(), name
    assert inp.query_start_loc.tolist() == before + [13, 14, 15, 16]
    assert inp.seq_lens.tolist()[2:] == [1] * 4
    assert inp.block_tables.shape == (6, width) and not inp.block_tables[2:].any()
    assert host.query_lens == [9, 3, 1, 1, 1, 1] and host.seq_lens == [9, 3, 1, 1, 1, 1]
    assert host.sample_rows == [0, 1]  # padding rows never sample
    pad_tokens(host, 12)  # already longer: unchanged
    assert host.padding == 4 and inp.positions.shape[0] == 16


def _piecewise(llm: LLM, max_tokens: int = 64) -> LLM:
    """The engine's runner with piecewise graphs of up to `max_tokens` tokens, uncaptured."""
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model.model, runner.kv_caches, runner.backend,
                                       runner.kv_scales, max_tokens, runner.device)
    runner.piecewise.capture(eager=True)
    draft = runner.draft
    if draft is not None:
        draft.piecewise = PiecewiseGraphs(draft.model.model, draft.kv_caches, draft.backend,
                                          None, max_tokens, runner.device)
        draft.piecewise.capture(eager=True)
    return llm


def _with_prompt_logprobs(specs: list[Spec]) -> list[Spec]:
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(21)]
    return specs + [Spec(prompt, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3,
                                                logprobs=1, ignore_eos=True))]


def test_piecewise_engine_equals_op_by_op() -> None:
    kw = dict(model="photon-tiny-random", max_model_len=256, max_num_batched_tokens=48)
    specs = _with_prompt_logprobs(_mixed_specs())
    eos = frozenset({7})
    plain, audit = run(LLM(**kw), specs, eos)
    llm = _piecewise(LLM(**kw))
    piecewise, audit_p = run(llm, specs, eos)
    assert piecewise == plain
    assert audit_p.schedule == audit.schedule
    # every step ran piecewise (on CPU no decode graph takes any)
    assert llm.engine.runner.piecewise.replays == len(audit_p.schedule) - audit_p.schedule.count(())


def _logprob_entries(llm: LLM, specs: list[Spec]) -> list[dict]:
    """Every prompt and sample logprob entry of the outputs, in order."""
    outs = llm.generate([s.prompt for s in specs], [s.params for s in specs], use_tqdm=False)
    llm.engine.assert_drained()
    return [e for o in outs for e in (o.prompt_logprobs[1:] + o.outputs[0].logprobs)]


def test_piecewise_logprobs_equal_op_by_op() -> None:
    """The same tokens, ranks and alternatives; the values to float32 rounding (a GEMM of
    another row count may sum in another order)."""
    specs = _with_prompt_logprobs([])
    kw = dict(model="photon-tiny-random", max_model_len=128, max_num_batched_tokens=16)
    plain = _logprob_entries(LLM(**kw), specs)
    piecewise = _logprob_entries(_piecewise(LLM(**kw)), specs)
    assert len(piecewise) == len(plain) == 20 + 6
    for got, want in zip(piecewise, plain):
        assert got.keys() == want.keys()
        for tok, lp in want.items():
            assert got[tok].rank == lp.rank
            assert got[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_piecewise_speculation_equals_op_by_op(method: str) -> None:
    """Speculative rows beside prompt chunks and padding rows, under preemption: the same
    tokens and schedules (the draft's KV catch-up runs over the padded inputs)."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = DRAFT
    else:
        spec.update(prompt_lookup_min=2, prompt_lookup_max=4)
    kw = dict(model=TARGET if method == "draft_model" else "photon-tiny-random",
              dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
              num_gpu_blocks_override=40, max_model_len=128, speculative_config=spec)
    specs = _spec_mixed_specs(stop_id=500)
    plain, audit = run(LLM(**kw), specs)
    llm = _piecewise(LLM(**kw))
    piecewise, audit_p = run(llm, specs)
    assert piecewise == plain
    assert audit_p.schedule == audit.schedule
    runner = llm.engine.runner
    assert runner.spec.counters.num_accepted_tokens > 0
    assert runner.piecewise.replays > 20
    if runner.draft is not None:  # its catch-up ran piecewise in every such step
        assert runner.draft.piecewise.replays == runner.piecewise.replays


def test_piecewise_with_an_fp8_cache_equals_op_by_op() -> None:
    """The pieces write K/V with the FP8 cache's scales (set by the first, op-by-op step) and
    attention between them reads them: the tokens of the engine running steps op by op."""
    kw = dict(model="photon-tiny-random", max_model_len=256, max_num_batched_tokens=48,
              kv_cache_dtype="fp8", calculate_kv_scales=True)
    specs = _mixed_specs()
    eos = frozenset({7})
    plain, _ = run(LLM(**kw), specs, eos)
    llm = _piecewise(LLM(**kw))
    piecewise, _ = run(llm, specs, eos)
    assert piecewise == plain
    assert llm.engine.runner.kv_scales.source == "calculated"
    assert llm.engine.runner.piecewise.replays > 10


def test_piecewise_with_prefix_cache_hits_equals_op_by_op() -> None:
    """Rows starting from prefix-cache hits (their earlier positions read from the cache, none
    recomputed) run piecewise with the tokens and schedule of op by op."""
    kw = dict(model="photon-tiny-random", max_model_len=256, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=3, enable_prefix_caching=True)
    specs = _shared_prefix_specs()
    plain, audit = run(LLM(**kw), specs)
    piecewise, audit_p = run(_piecewise(LLM(**kw)), specs)
    assert piecewise == plain
    assert audit_p.schedule == audit.schedule
    assert sum(start > 0 for rows in audit_p.schedule for _, start, n, _ in rows if n > 1) > 5
