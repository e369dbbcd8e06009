"""Pipelined == blocking on CUDA in bfloat16 with prefix caching, on a real model shape: requests on
shared prefixes admitted in different steps, greedy and seeded. In bf16 a prefix-cache hit and a
recompute of the same tokens can differ in the last bit and flip near-tied logits, so the two
loops must find the same hits at the same steps (the same schedule) for their tokens to agree."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from photon import LLM, SamplingParams
from photon.bench.shapes import materialize_shape
from tests.test_pipeline import Spec, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _specs(vocab: int) -> list[Spec]:
    rng = random.Random(14)
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in (64, 230, 470, 700)]
    kinds = [
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.1,
                       presence_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(range(100, 3000))),
    ]
    return [Spec(prefixes[rng.randrange(4)] + [rng.randrange(3, vocab)
                                               for _ in range(rng.randrange(1, 48))],
                 kinds[i % len(kinds)]) for i in range(160)]


def test_pipelined_equals_blocking_with_prefix_hits_bf16(tmp_path: Path) -> None:
    model = materialize_shape("qwen3-0.6b", str(tmp_path))
    kw = dict(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024, block_size=16)
    specs = _specs(150_000)
    blocking, audit_b = run(LLM(pipelined=False, **kw), specs)
    pipelined, audit_p = run(LLM(pipelined=True, **kw), specs)
    assert audit_b.core.kv.prefix_hits > 0
    diff = sorted(k for k in blocking if blocking[k] != pipelined[k])
    assert not diff, f"{len(diff)} of {len(blocking)} requests differ: {diff[:10]}"
    assert audit_p.schedule == audit_b.schedule
