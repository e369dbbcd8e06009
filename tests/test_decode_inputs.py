"""The vectorized decode staging path produces exactly the general path's arrays."""

from __future__ import annotations

import numpy as np
import pytest

from photon import LLM, SamplingParams
from photon.worker import decode_inputs, model_runner
from photon.worker.inputs import build_step_arrays


def test_decode_fast_path_equals_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = [0]
    fast = decode_inputs.build_decode_arrays

    def both(rows, state, block_size, pool_width):  # noqa: ANN001, ANN202
        valid = state.pool_valid.copy()
        general = build_step_arrays(rows, block_size, pool_width, valid, state)
        got = fast(rows, state, block_size, pool_width)
        assert np.array_equal(valid, state.pool_valid)
        for name, arr in general.ints.items():
            assert np.array_equal(np.asarray(arr).reshape(-1),
                                  np.asarray(got.ints[name]).reshape(-1)), name
        for name, arr in general.floats.items():
            assert np.array_equal(arr, got.floats[name]), name
        assert general.flags == got.flags
        assert (general.seq_lens_host, general.sample_rows) == (got.seq_lens_host, got.sample_rows)
        checked[0] += 1
        return got

    monkeypatch.setattr(model_runner, "build_decode_arrays", both)
    llm = LLM(block_size=4, max_num_seqs=8, max_model_len=128)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=1, max_tokens=15,
                             min_tokens=6, stop_token_ids=[7], logprobs=2,
                             logit_bias={9: 3.0, 11: -2.5}),
              SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5, seed=2,
                             max_tokens=12, ignore_eos=True, n=2)]
    prompts = [[5], list(range(3, 40)), "Hello there"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert checked[0] > 10
    assert [len(c.token_ids) for o in outs for c in o.outputs][0] == 20
    llm.engine.assert_drained()
