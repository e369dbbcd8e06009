"""Greedy token ids equal Hugging Face transformers' for every architecture, through the whole
engine: small blocks, a small token budget (chunked prefill mixed with decodes) and shared prefixes
(prefix-cache hits), pipelined and blocking."""

from __future__ import annotations

import random

import pytest

from photon import LLM, SamplingParams
from tests.hf_models import MIXTRAL, QWEN3_MOE, hf_greedy, make_engine_model

ARCHS = {
    "llama-llama3-rope": ("LlamaForCausalLM", {"rope_scaling_llama3": True}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2-tied": ("Qwen2ForCausalLM", {"tied": True}),
    "qwen3-head-dim": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"head_dim": 32, "num_layers": 3, "extra": QWEN3_MOE}),
    "mixtral": ("MixtralForCausalLM", {"num_layers": 3, "extra": MIXTRAL}),
}
MAX_NEW = 10


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(23)]
    tails = [1, 7, 19]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(k)] for k in tails]
    prompts += [[rng.randrange(3, 1000) for _ in range(n)] for n in (41, 2, 13)]
    return prompts


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model_and_reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                        ) -> tuple[str, list[list[int]], list[list[int]]]:
    arch, kwargs = ARCHS[request.param]
    path = make_engine_model(str(tmp_path_factory.mktemp(request.param)), arch, **kwargs)
    prompts = _prompts(1)
    return path, prompts, hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_greedy_matches_transformers(model_and_reference: tuple, pipelined: bool) -> None:
    path, prompts, reference = model_and_reference
    llm = LLM(path, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=128, pipelined=pipelined)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    llm.engine.assert_drained()
    # Second pass: every prompt now hits the prefix cache and must still match exactly.
    hits_before = llm.engine.kv.prefix_hits
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert llm.engine.kv.prefix_hits > hits_before > 0
    llm.engine.assert_drained()
