"""Random-weight checkpoints of the built-in shapes (what `photon quantize` reads), and `photon
bench quality --reference-model` (a quantized checkpoint against the model it came from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from photon.bench.quality import reference_args
from photon.bench.shape_weights import random_tensors, write_random_checkpoint
from photon.bench.shapes import SHAPES
from photon.engine_args import EngineArgs


def test_tiny_checkpoint_loads_and_generates(tmp_path: Path) -> None:
    from photon import LLM, SamplingParams

    path = write_random_checkpoint("tiny", str(tmp_path))
    llm = LLM(path, device="cpu", max_model_len=32, max_num_seqs=2)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_tensor_names_per_architecture() -> None:
    llama = {**SHAPES["tiny"], "model_type": "llama", "tie_word_embeddings": False}
    names = set(random_tensors(llama))
    assert "lm_head.weight" in names and not any("q_norm" in n for n in names)
    qwen3 = set(random_tensors(SHAPES["tiny"]))
    assert "lm_head.weight" not in qwen3  # tied
    assert qwen3 - names == {f"model.layers.{i}.self_attn.{n}_norm.weight"
                             for i in range(4) for n in "qk"}


def test_moe_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qwen3-30b-a3b' is a mixture of experts"):
        write_random_checkpoint("qwen3-30b-a3b", str(tmp_path))


def test_quality_reference_model() -> None:
    args = EngineArgs(model="/q/model-w4a16", device="cpu", kv_cache_dtype="fp8")
    ref = reference_args(args, "/q/model")
    assert ref.model == "/q/model" and ref.kv_cache_dtype == "auto" and ref.quantization is None
    assert reference_args(args).model == "/q/model-w4a16"
