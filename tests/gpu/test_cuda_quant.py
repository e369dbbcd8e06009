"""Quantized GEMMs and engines on CUDA: torch._scaled_mm (FP8), torch._int_mm (INT8), the fused
per-token activation quantization and the W4A16 / W8A16 Triton paths against the reference path; greedy outputs with CUDA graphs equal eager
ones; no host sync inside a quantized step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from photon import LLM, SamplingParams
from photon.quant import numerics as qn
from photon.quant.fp8 import _per_token, dequant_linear, fp8_linear
from photon.quant.int8 import _per_token as int8_per_token
from photon.quant.int8 import int8_linear
from tests.gpu.test_cuda_pipeline import sync_debug_error  # noqa: F401  (fixture)
from tests.quant_util import quantized_tiny
from tests.test_quant import _wna16_layer

FP8_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_fp8 = pytest.mark.skipif(not FP8_OK, reason="needs compute capability 8.9+")


def _inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).cuda().bfloat16()
    w = (torch.randn(384, 512, generator=g) * 0.05).cuda()
    return x, w


@needs_fp8
@pytest.mark.parametrize("m", [1, 7, 64])
def test_fp8_scaled_mm_matches_reference(m: int) -> None:
    x, w = _inputs(m)
    wq, ws = qn.per_channel_fp8(w)
    xq, xs = _per_token(x)  # the activations fp8_linear multiplies (the fused kernel's)
    ref = dequant_linear(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), None, torch.float32)
    out = fp8_linear(x, wq, ws, None, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@needs_fp8
@pytest.mark.parametrize("m", [1, 33, 300])
def test_fused_per_token_quant_is_bitwise_the_reference(m: int) -> None:
    from photon.kernels.quant import per_token_fp8_fused, per_token_int8_fused

    x, _ = _inputs(m)
    x[0, 0] = 0.5 * x[0].abs().max()  # not an outlier; rows keep their own scales
    for fused, ref in ((per_token_fp8_fused, qn.per_token_fp8),
                       (per_token_int8_fused, qn.per_token_int8)):
        q, scale = fused(x)
        q_ref, scale_ref = ref(x)
        assert torch.equal(scale, scale_ref)
        assert torch.equal(q.view(torch.uint8) if q.dtype != torch.int8 else q,
                           q_ref.view(torch.uint8) if q_ref.dtype != torch.int8 else q_ref)


@pytest.mark.parametrize("m", [1, 17, 64])
def test_int8_int_mm_matches_reference(m: int) -> None:
    x, w = _inputs(m)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    wq = qn.to_int(w, scale, -127, 127)
    xq, xs = int8_per_token(x)  # the activations int8_linear multiplies (the fused kernel's)
    ref = dequant_linear(xq.cpu(), xs.cpu(), wq.cpu(), scale.cpu(), None, torch.float32)
    out = int8_linear(x, wq, scale, None, None)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 17, 300])
def test_int8_scaling_epilogue_is_bitwise_the_torch_expression(m: int) -> None:
    from photon.kernels.quant import scale_int32

    g = torch.Generator().manual_seed(m)
    acc = torch.randint(-2**20, 2**20, (m, 384), generator=g, dtype=torch.int32).cuda()
    xs, ws = (torch.rand(m, 1, generator=g) * 1e-2).cuda(), (torch.rand(384, 1) * 1e-3).cuda()
    bias = torch.randn(384, generator=g).cuda().bfloat16()
    want = (acc.float() * xs * ws.reshape(1, -1)).bfloat16()
    assert torch.equal(scale_int32(acc, xs, ws, None, torch.bfloat16), want)
    assert torch.equal(scale_int32(acc, xs, ws, bias, torch.bfloat16), want + bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 20, 32, 33, 300])  # fused (K split, BLOCK_M 16, 32); dequantize
def test_wna16_kernel_matches_reference(m: int, bits: int) -> None:
    from photon.kernels.wna16 import DEQUANT_MIN_TOKENS

    assert (m >= DEQUANT_MIN_TOKENS) == (m >= 33)
    x, w = _inputs(m)
    layer, method = _wna16_layer(w, bits, 128, symmetric=False)
    ref = x.float() @ method.dequantized(layer, torch.float32).t()
    out = method.apply(layer, x, None)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    assert torch.equal(method.apply(layer, x, None), out)  # bitwise reproducible (no atomics)


@pytest.mark.parametrize("symmetric", [True, False])
def test_wna16_dequantize_is_bitwise_the_reference(symmetric: bool) -> None:
    from photon.kernels.wna16 import wna16_dequantize

    _, w = _inputs(1)
    layer, method = _wna16_layer(w, 4, 128, symmetric)
    out = wna16_dequantize(layer.weight_packed, layer.weight_scale, method.zero_point(layer),
                           4, 128, torch.bfloat16)
    assert torch.equal(out, method.dequantized(layer, torch.bfloat16))


def _greedy(model: str, enforce_eager: bool, **kw: object) -> list[list[int]]:
    llm = LLM(model, device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8,
              enforce_eager=enforce_eager, **kw)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([f"def function_{i}(" for i in range(6)], params, use_tqdm=False)
    if not enforce_eager:
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("scheme", ["fp8", "w8a8-int8", "w4a16"])
def test_graphs_equal_eager(scheme: str, tmp_path: Path) -> None:
    if scheme == "fp8" and not FP8_OK:
        pytest.skip("needs compute capability 8.9+")
    if scheme == "fp8":
        model, kw = "photon-tiny", {"quantization": "fp8"}
    else:
        model, kw = quantized_tiny(str(tmp_path / scheme), scheme), {}
    assert _greedy(model, False, **kw) == _greedy(model, True, **kw)


@needs_fp8
def test_no_host_sync_in_a_quantized_step(sync_debug_error: list[int]) -> None:  # noqa: F811
    torch.cuda.set_sync_debug_mode(0)
    llm = LLM("photon-tiny", device="cuda", dtype="bfloat16", quantization="fp8",
              max_num_seqs=8, max_model_len=512)
    core = llm.engine
    for i in range(8):
        core.add_request(f"import os{i}\n", SamplingParams(temperature=0, max_tokens=30,
                                                           ignore_eos=True))
    torch.cuda.set_sync_debug_mode("error")
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
    torch.cuda.set_sync_debug_mode(0)
    assert steps >= 30 and sync_debug_error[0] >= 30
    core.assert_drained()
