"""Eager steps padded to token buckets (on by default on CUDA, where GEMM shapes must repeat):
the buckets, the padding rows, and engines whose every eager step is padded giving exactly the
tokens, logprobs and schedules of unpadded ones, with and without speculation, KV all free after
the drain."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from photon import LLM, SamplingParams
from photon.worker import model_runner
from photon.worker.inputs import HostStep, build_step_inputs, pad_tokens, token_bucket
from tests.test_pipeline import Spec, _mixed_specs, run
from tests.test_spec_draft_engine import DRAFT, TARGET
from tests.test_spec_engine import _mixed_specs as _spec_mixed_specs


@pytest.mark.parametrize(("n", "cap", "want"), [
    (1, 8192, 16), (16, 8192, 16), (17, 8192, 32), (256, 8192, 256), (257, 8192, 288),
    (300, 8192, 320), (600, 8192, 640), (1100, 8192, 1152), (3000, 8192, 3072),
    (8000, 8192, 8192), (20, 24, 24), (30, 24, 30), (9000, 8192, 9000)])
def test_token_buckets(n: int, cap: int, want: int) -> None:
    assert token_bucket(n, cap) == want


def test_buckets_are_few_and_waste_at_most_an_eighth() -> None:
    buckets = {token_bucket(n, 8192) for n in range(1, 8193)}
    assert len(buckets) == 64
    assert all(token_bucket(n, 8192) - n <= max(15, n // 8) for n in range(1, 8193))


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


def _padded(llm: LLM) -> LLM:
    llm.engine.runner.pad_eager = True
    return llm


def _with_prompt_logprobs(specs: list[Spec]) -> list[Spec]:
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(21)]
    return specs + [Spec(prompt, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3,
                                                logprobs=1, ignore_eos=True))]


@pytest.mark.parametrize("pipelined", [True, False])
def test_padded_engine_equals_unpadded(pipelined: bool) -> None:
    kw = dict(model="photon-tiny-random", max_model_len=256, max_num_batched_tokens=48,
              pipelined=pipelined)
    specs = _with_prompt_logprobs(_mixed_specs())
    eos = frozenset({7})
    plain, audit = run(LLM(**kw), specs, eos)
    padded, audit_p = run(_padded(LLM(**kw)), specs, eos)
    assert padded == plain
    assert audit_p.schedule == audit.schedule


def _logprob_entries(llm: LLM, specs: list[Spec]) -> list[dict]:
    """Every prompt and sample logprob entry of the outputs, in order."""
    outs = llm.generate([s.prompt for s in specs], [s.params for s in specs], use_tqdm=False)
    llm.engine.assert_drained()
    return [e for o in outs for e in (o.prompt_logprobs[1:] + o.outputs[0].logprobs)]


def test_padded_logprobs_equal_unpadded() -> None:
    """The same tokens, ranks and alternatives; the values to float32 rounding (a GEMM of
    another row count may sum in another order)."""
    specs = _with_prompt_logprobs([])
    kw = dict(model="photon-tiny-random", max_model_len=128, max_num_batched_tokens=16)
    plain = _logprob_entries(LLM(**kw), specs)
    padded = _logprob_entries(_padded(LLM(**kw)), specs)
    assert len(padded) == len(plain) == 20 + 6
    for got, want in zip(padded, plain):
        assert got.keys() == want.keys()
        for tok, lp in want.items():
            assert got[tok].rank == lp.rank
            assert got[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_padded_speculation_equals_unpadded(method: str) -> None:
    """Speculative rows beside prompt chunks and padding rows, under preemption: the same
    tokens and schedules, and the draft's KV catch-up over padded inputs leaves it right."""
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
    llm = _padded(LLM(**kw))
    padded, audit_p = run(llm, specs)
    assert padded == plain
    assert audit_p.schedule == audit.schedule
    assert llm.engine.runner.spec.counters.num_accepted_tokens > 0
    assert np.all(llm.engine.runner.spec.dev_len.cpu().numpy() >= 0)
