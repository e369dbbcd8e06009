"""The vectorized decode staging path produces exactly the general path's arrays."""

from __future__ import annotations

import numpy as np
import pytest

from photon import LLM, SamplingParams
from photon.core.inputs import FLOAT_FIELDS, INT_FIELDS
from photon.worker import decode_inputs, model_runner
from photon.worker.inputs import HostStep, build_step_inputs


def _mixed_params(max_tokens: tuple[int, int, int]) -> list[SamplingParams]:
    """Greedy; sampled with top-k/top-p, min_tokens, a stop id, logprobs and logit_bias; min_p
    with a penalty and n = 2: every sampling constant the builders gather."""
    greedy, sampled, penalized = max_tokens
    return [SamplingParams(temperature=0, max_tokens=greedy, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=1, max_tokens=sampled,
                           min_tokens=6, stop_token_ids=[7], logprobs=2,
                           logit_bias={9: 3.0, 11: -2.5}),
            SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5, seed=2,
                           max_tokens=penalized, ignore_eos=True, n=2)]


def _assert_same(general: HostStep, got: HostStep, fields: tuple[str, ...]) -> None:
    for name in INT_FIELDS + FLOAT_FIELDS:
        assert np.array_equal(np.asarray(getattr(general.inputs, name)).reshape(-1),
                              np.asarray(getattr(got.inputs, name)).reshape(-1)), name
    assert general.flags == got.flags
    for field in fields:
        assert getattr(general, field) == getattr(got, field), field
    for a, b in zip(general.pool_valid, got.pool_valid):
        assert np.array_equal(a, b)


def test_decode_fast_path_equals_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = [0]
    fast = decode_inputs.build_decode_inputs

    def both(rows, table, block_size, pool_width, lookahead=0):  # noqa: ANN001, ANN202
        valid = table.pool_valid.copy()
        general = build_step_inputs(rows, table, block_size, pool_width)
        got = fast(rows, table, block_size, pool_width, lookahead)
        assert np.array_equal(valid, table.pool_valid), "the builders only read the table"
        _assert_same(general, got, ("seq_lens", "sample_rows"))
        checked[0] += 1
        return got

    monkeypatch.setattr(model_runner, "build_decode_inputs", both)
    llm = LLM("photon-tiny-random", block_size=4, max_num_seqs=8, max_model_len=128)
    params = _mixed_params((20, 15, 12))
    prompts = [[5], list(range(3, 40)), "Hello there"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert checked[0] > 10
    assert [len(c.token_ids) for o in outs for c in o.outputs][0] == 20
    llm.engine.assert_drained()


def test_spec_fast_path_equals_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative decode steps (every row verifying the same K_eff drafts): the vectorized
    builder gives the general builder's arrays, for ngram with the adaptive switch off (every
    step verifies K) and with sampling, min_tokens, logit_bias and n = 2 rows in the batch."""
    checked = [0]
    fast = decode_inputs.build_spec_inputs

    def both(rows, table, k, pool_width, block_size):  # noqa: ANN001, ANN202
        valid = table.pool_valid.copy()
        general = build_step_inputs(rows, table, block_size, pool_width)
        got = fast(rows, table, k, pool_width, block_size)
        assert np.array_equal(valid, table.pool_valid), "the builders only read the table"
        assert general.inputs.block_tables.shape == got.inputs.block_tables.shape
        assert got.uniform_spec and not general.uniform_spec  # the speculative graphs' mark
        _assert_same(general, got, ("seq_lens", "query_lens", "decode_only", "sample_rows",
                                    "widths", "spec_k", "prompt_spans"))
        checked[0] += 1
        return got

    monkeypatch.setattr(model_runner, "build_spec_inputs", both)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "adaptive": False}
    llm = LLM("photon-tiny-random", block_size=4, max_num_seqs=8, max_model_len=128,
              speculative_config=spec)
    params = _mixed_params((30, 24, 20))
    prompts = [[5, 6, 5, 6, 5, 6], list(range(3, 40)), "Hello there"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert checked[0] > 5
    assert [len(c.token_ids) for o in outs for c in o.outputs][0] == 30
    llm.engine.assert_drained()
