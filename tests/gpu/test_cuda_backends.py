"""End to end on the GPU: greedy outputs with the Triton backend (and fused kernels) equal the
torch reference backend's, through the whole engine (chunked prefill, prefix hits, graphs)."""

from __future__ import annotations

import random

import pytest
import torch

from photon import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(k)] for k in (1, 9, 33)]
    return prompts + [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 17, 300)]


def _greedy(backend: str) -> list[list[int]]:
    llm = LLM(device="cuda", dtype="float32", attention_backend=backend, block_size=16,
              max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    llm.engine.assert_drained()
    assert llm.engine.runner.backend.name == backend
    return [o.outputs[0].token_ids for o in outs]


def test_triton_backend_greedy_equals_torch_backend() -> None:
    assert _greedy("triton") == _greedy("torch")
