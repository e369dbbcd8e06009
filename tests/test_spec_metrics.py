"""Speculative decoding's metrics: the commit counts drafts, draft tokens and accepted tokens per
position from the step's one download (a row's positions past its drafts carry NO_DRAFT), the
engine's stats carry them, and a live server exposes them under vLLM's names."""

from __future__ import annotations

import json
import random

import httpx
import numpy as np
import openai
import pytest
import torch

from photon import SamplingParams
from photon.spec.config import parse_speculative_config
from photon.spec.stats import SpecDecodingStats
from photon.worker.spec_step import NO_DRAFT, SpecDecoder
from tests.server_util import live_server
from tests.test_bench_throughput import SMALL, _run
from tests.test_spec_engine import _llm, _prompts


def test_commit_counts_drafts_from_the_downloaded_tokens() -> None:
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    spec = SpecDecoder(config, 64, 4, 65, 4, torch.device("cpu"))
    tokens = [5, 6, -1, -1,  # 3 drafts, 1 accepted
              7, 8, 9, 10,  # 3 drafts, all accepted
              11, -1, NO_DRAFT, NO_DRAFT,  # 1 draft, rejected
              12, NO_DRAFT, NO_DRAFT, NO_DRAFT,  # no draft: not counted
              13]  # a plain row
    spec.count(np.array(tokens), [4, 4, 4, 4, 1])
    assert spec.counters == SpecDecodingStats(3, 7, 4, [2, 1, 1])
    assert spec.counters.mean_acceptance_length == 1 + 4 / 3


def test_a_steps_rows_count_as_each_row_alone() -> None:
    """observe (a step's rows at once) counts what a loop over the rows counts: rows with
    drafts, drafts, accepted drafts, and per position the rows that accepted past it."""
    rng = random.Random(0)
    drafts = [rng.randint(0, 5) for _ in range(300)]
    accepted = [rng.randint(0, n) for n in drafts]
    live = [(n, a) for n, a in zip(drafts, accepted) if n > 0]
    want = SpecDecodingStats(len(live), sum(n for n, _ in live), sum(a for _, a in live),
                             [sum(a > j for _, a in live) for j in range(5)])
    got = SpecDecodingStats.empty(5)
    got.observe(np.array(drafts), np.array(accepted))
    assert got == want and 0 < got.num_drafts < 300
    got.observe(np.array([3, 0]), np.array([2, 0]))  # one more row with drafts; one without
    assert (got.num_drafts, got.num_accepted_tokens_per_pos[:3]) == (
        want.num_drafts + 1, [want.num_accepted_tokens_per_pos[j] + 1 for j in range(2)]
        + [want.num_accepted_tokens_per_pos[2]])


def _spec_stats(llm: object) -> SpecDecodingStats:
    return llm.engine.stats().spec_decoding


def test_engine_stats_carry_the_counts_of_the_committed_steps() -> None:
    llm = _llm(True, 3, max_model_len=64, block_size=4)
    pattern = [11, 12, 13, 14]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([pattern * 10, *_prompts(3)[:3]], params)
    s = _spec_stats(llm)
    assert s.num_accepted_tokens == llm.engine.runner.spec.counters.num_accepted_tokens > 0
    assert s.num_accepted_tokens == sum(s.num_accepted_tokens_per_pos)
    per_pos = s.num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)
    assert s.num_drafts <= s.num_draft_tokens <= 3 * s.num_drafts
    assert s.num_accepted_tokens <= s.num_draft_tokens
    # Near max_model_len the proposer drafts fewer than K: fewer draft tokens than 3 per draft.
    assert s.num_draft_tokens < 3 * s.num_drafts
    assert _spec_stats(_llm(True)) is None


def _metrics(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("photon:spec_decode"):
            name, value = line.rsplit(" ", 1)
            out[name.replace('model_name="tiny",', "").split("{")[0] + (
                "{" + name.split("position=")[1].strip('"}') + "}" if "position=" in name
                else "")] = float(value)
    return out


def test_live_server_exposes_the_spec_decode_counters() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3, "adaptive": False}
    rng = random.Random(1)
    pattern = [rng.randrange(3, 1000) for _ in range(5)]
    with live_server({"speculative_config": spec}) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                               timeout=60)
        client.completions.create(model=client.models.list().data[0].id, prompt=pattern * 6,
                                  max_tokens=20, temperature=0)
        m = _metrics(server.base_url)
    drafts = m["photon:spec_decode_num_drafts_total"]
    accepted = m["photon:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0
    assert m["photon:spec_decode_num_draft_tokens_total"] >= drafts
    assert accepted == m["photon:spec_decode_num_accepted_tokens_per_pos_total{0}"] + m[
        "photon:spec_decode_num_accepted_tokens_per_pos_total{1}"]


def test_bench_throughput_reports_the_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 2, "adaptive": False})
    summary, err = _run(capsys, [*SMALL, "--warmup-prompts", "0", "--speculative-config", spec])
    drafts, accepted = summary["spec_decode_num_drafts"], summary["spec_decode_num_accepted_tokens"]
    assert drafts > 0
    assert summary["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    rates = summary["spec_acceptance_rate_per_pos"]
    assert len(rates) == 2 and sum(rates) * drafts == pytest.approx(accepted)
    assert "mean acceptance length" in err
    plain, _ = _run(capsys, SMALL)
    assert plain["spec_mean_acceptance_length"] is None
