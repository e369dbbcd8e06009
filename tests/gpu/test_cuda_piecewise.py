"""Piecewise CUDA graphs on the GPU: steps outside the decode and speculative graphs (prompt
chunks, mixed steps) replay captured pieces, with the tokens of the same engine running them op
by op (float32), pipelined equal to blocking (bfloat16), and no host sync in the loop."""

from __future__ import annotations

import pytest
import torch

from photon import LLM
from tests.test_pipeline import _mixed_specs, run
from tests.test_spec_engine import _mixed_specs as _spec_mixed_specs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(block_size=4, max_num_batched_tokens=48, max_num_seqs=6, num_gpu_blocks_override=64,
          device="cuda", max_model_len=256)


def _op_by_op(llm: LLM) -> LLM:
    llm.engine.runner.piecewise = None
    return llm


def test_piecewise_equals_op_by_op_float32() -> None:
    specs = _mixed_specs()
    eos = frozenset({7})
    llm = LLM(dtype="float32", **KW)
    assert llm.engine.runner.piecewise is not None
    piecewise, audit = run(llm, specs, eos)
    plain, audit_p = run(_op_by_op(LLM(dtype="float32", **KW)), specs, eos)
    assert piecewise == plain
    assert audit.schedule == audit_p.schedule
    assert llm.engine.runner.piecewise.replays > 5


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 2, "adaptive": False}])
def test_piecewise_pipelined_equals_blocking_bf16(spec: dict | None) -> None:
    specs = _spec_mixed_specs(stop_id=500) if spec else _mixed_specs()
    kw = dict(KW, dtype="bfloat16", speculative_config=spec)
    engines = [LLM(pipelined=p, **kw) for p in (True, False)]
    (pipelined, audit), (blocking, audit_b) = [run(e, specs) for e in engines]
    assert pipelined == blocking
    assert audit.schedule == audit_b.schedule
    assert all(e.engine.runner.piecewise.replays > 5 for e in engines)
