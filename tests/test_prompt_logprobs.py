"""Prompt logprobs (and the ranks of sampled tokens) equal transformers' float32 log-softmax,
through chunked prefill and next to requests that share the prompt's prefix (a request that
asks for prompt logprobs never takes a prefix-cache hit), pipelined and blocking."""

from __future__ import annotations

import random

import pytest
import torch

from photon import LLM, SamplingParams
from tests.hf_models import hf_log_softmax, make_engine_model

K = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_engine_model(str(tmp_path_factory.mktemp("plp")), "LlamaForCausalLM")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _check_prompt_entries(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """entries[i] (i >= 1) scores ids[i] with the distribution after ids[:i] (ref[i - 1])."""
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        row = ref[i - 1]
        entry = entries[i]
        lp = entry[ids[i]]
        assert lp.logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert lp.rank == int((row > row[ids[i]]).sum()) + 1
        top_lp, top_ids = row.topk(k)
        others = [t for t in entry if t != ids[i]]
        assert set(others) <= set(top_ids.tolist()) and len(entry) in (k, k + 1)
        for rank, (t, v) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
            assert entry[t].rank == (lp.rank if t == ids[i] else rank)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_prompt_logprobs_match_transformers(model_path: str, pipelined: bool) -> None:
    shared = _prompt(1, 24)
    first, second = shared + _prompt(2, 9), shared + _prompt(3, 5)
    llm = LLM(model_path, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
              max_model_len=128, pipelined=pipelined)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # `first` fills the prefix cache; `second` shares its prefix but must not use it.
    warm = llm.generate([first], greedy, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and warm.prompt_logprobs is None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    out, hit = llm.generate([second, second], [params, greedy], use_tqdm=False)
    assert hit.num_cached_tokens == 24  # the shared full blocks
    assert out.num_cached_tokens == 0  # scored from the first token: no cached prefix
    _check_prompt_entries(out.prompt_logprobs, second, hf_log_softmax(model_path, second), K)
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids
    llm.engine.assert_drained()


def test_prompt_logprobs_with_preemption_and_n(model_path: str) -> None:
    """A tiny KV cache preempts and recomputes; each prompt token is still scored once. With
    n > 1 the prompt is reported once."""
    prompts = [_prompt(10 + i, 30) for i in range(3)]
    llm = LLM(model_path, block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
              max_model_len=64, num_gpu_blocks_override=20)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True,
                            prompt_logprobs=1, n=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        _check_prompt_entries(out.prompt_logprobs, ids, hf_log_softmax(model_path, ids), 1)
    llm.engine.assert_drained()


def test_sampled_token_ranks_match_torch(model_path: str) -> None:
    ids = _prompt(5, 12)
    llm = LLM(model_path, block_size=4, max_model_len=64)
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=8, ignore_eos=True, logprobs=2)
    completion = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    ref = hf_log_softmax(model_path, ids + completion.token_ids)
    ranks = []
    for j, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(ids) - 1 + j]
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        ranks.append(entry[tok].rank)
    assert max(ranks) > 1  # a hot temperature samples below the top token
