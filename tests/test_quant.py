"""Quantization on CPU: each scheme's GEMM against a float reference, the W4A16 Triton kernel
(in Triton's interpreter) against dequantize-then-matmul, packing, checkpoint round trips and
the errors for bad checkpoints and unsupported combinations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from photon import LLM
from photon.config import ConfigError
from photon.quant import numerics as qn
from photon.quant.config import check_fp8_capability
from photon.quant.fp8 import fp8_linear
from photon.quant.int8 import int8_linear
from photon.quant.wna16 import WNA16Method
from tests.quant_util import SCHEMES, dequantized_tensors, quantized_tiny

pytestmark = pytest.mark.timeout(300)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


# ---------------------------------------------------------------- GEMMs vs float reference

X, W = randn(7, 256, seed=1), randn(96, 256, seed=2) * 0.05
REF = X @ W.t()


def test_fp8_gemm_within_tolerance_and_static_scale() -> None:
    wq, ws = qn.per_channel_fp8(W)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (96, 1)
    assert rel_err(fp8_linear(X, wq, ws, None, None), REF) < 0.06  # e4m3: 3 mantissa bits
    static = qn.fp8_scale(X.abs().max()).reshape(())
    assert rel_err(fp8_linear(X, wq, ws, static, None), REF) < 0.08
    bias = randn(96, seed=3)
    torch.testing.assert_close(fp8_linear(X, wq, ws, None, bias),
                               fp8_linear(X, wq, ws, None, None) + bias)


def test_int8_gemm_within_tolerance() -> None:
    scale = W.abs().amax(dim=1, keepdim=True) / 127
    wq = qn.to_int(W, scale, -127, 127)
    assert rel_err(int8_linear(X, wq, scale, None, None), REF) < 0.02


@pytest.mark.parametrize("bits,bound", [(4, 0.15), (8, 0.01)])
def test_weight_only_gemm_within_tolerance(bits: int, bound: float) -> None:
    layer, method = _wna16_layer(W, bits, 128, symmetric=True)
    assert rel_err(method.apply(layer, X, None), REF) < bound


def _wna16_layer(w: torch.Tensor, bits: int, group: int, symmetric: bool
                 ) -> tuple[torch.nn.Module, WNA16Method]:
    scale, zero = qn.group_scales(w, bits, group, symmetric)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(
        qn.pack_int32(qn.quantize_groups(w, scale, zero, bits), bits), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    if zero is not None:
        layer.weight_zero_point = torch.nn.Parameter(zero, requires_grad=False)
    return layer, WNA16Method(bits, group, symmetric, use_triton=True)


def test_group_quantization_error_is_bounded_by_half_a_step() -> None:
    for symmetric in (True, False):
        scale, zero = qn.group_scales(W, 4, 128, symmetric)
        q = qn.quantize_groups(W, scale, zero, 4)
        deq = qn.dequantize_groups(q, scale, zero, torch.float32)
        step = scale.repeat_interleave(128, dim=1)
        assert bool(((deq - W).abs() <= step / 2 + 1e-7).all())


def test_pack_int32_is_compressed_tensors_layout() -> None:
    # compressed-tensors' documented example: 8-bit [1, 2] -> 129 | 130 << 8 = 33409.
    assert qn.pack_int32(torch.tensor([[1, 2]], dtype=torch.int8), 8).tolist() == [[33409]]
    q = torch.randint(-8, 8, (10, 24), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int8)
    for dim in (0, 1):
        packed = qn.pack_int32(q, 4, dim=dim)
        assert packed.dtype == torch.int32 and packed.shape[dim] == -(-q.shape[dim] // 8)
        assert torch.equal(qn.unpack_int32(packed, 4, q.shape[dim], dim=dim), q)


triton_only = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@triton_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_wna16_triton_paths_match_dequantized_matmul(bits: int, symmetric: bool) -> None:
    """Both paths on tiny shapes: the fused kernel at each BLOCK_M (with K split or not), and
    dequantize-then-linear (forced with a threshold of 1 row) whose weight is bitwise the
    reference's. Groups of 32 span several per tile, and N = 80 and K = 160 are not multiples of
    the tiles; groups of 128 hold whole tiles (one scale per row and tile)."""
    w = randn(80, 160, seed=4) * 0.05
    _check_wna16_paths(w, bits, 32, symmetric, ((3, 2), (20, 1), (40, 1)))
    w = randn(80, 256, seed=8) * 0.05
    _check_wna16_paths(w, bits, 128, symmetric, ((3, 4), (40, 1)))


def _check_wna16_paths(w: torch.Tensor, bits: int, group: int, symmetric: bool,
                       fused: tuple[tuple[int, int], ...]) -> None:
    from photon.kernels.wna16 import wna16_gemm

    layer, method = _wna16_layer(w, bits, group, symmetric)
    args = (layer.weight_packed, layer.weight_scale, method.zero_point(layer), bits, group)
    ref_w = method.dequantized(layer, torch.float32)
    k = w.shape[1]
    for m, split_k in fused:  # BLOCK_M 16 for m = 3, 32 for 20, 64 for 40
        x = randn(m, k, seed=m)
        out = wna16_gemm(x, *args, split_k=split_k)
        torch.testing.assert_close(out, x @ ref_w.t(), atol=1e-4, rtol=1e-4)
    # The dequantized weight is bitwise the reference's, so is the linear. float32 only: the
    # interpreter truncates float32 -> bfloat16 (CUDA rounds to nearest even, checked bitwise in
    # tests/gpu/test_cuda_quant.py).
    x, bias = randn(5, k, seed=7), randn(w.shape[0], seed=6)
    out = wna16_gemm(x, *args, bias=bias, dequant_min_tokens=1)
    assert torch.equal(out, torch.nn.functional.linear(x, ref_w, bias))


@triton_only
@pytest.mark.parametrize("m", [1, 17, 40])
def test_int8_scaling_epilogue_is_the_torch_expression(m: int) -> None:
    """photon.kernels.quant.scale_int32 (the INT8 GEMM's epilogue) gives the bits of the torch
    expression it replaces, per-token and per-tensor activation scales, with and without bias.
    float32 output: the interpreter truncates float32 -> bfloat16 where CUDA rounds (the bf16
    output is checked bit for bit in tests/gpu/test_cuda_quant.py)."""
    from photon.kernels.quant import scale_int32

    gen = torch.Generator().manual_seed(m)
    acc = torch.randint(-2**20, 2**20, (m, 300), generator=gen, dtype=torch.int32)
    ws = torch.rand(300, 1, generator=gen) * 1e-3
    bias = randn(300, seed=m)
    for xs in (torch.rand(m, 1, generator=gen) * 1e-2, torch.full((1, 1), 3e-3)):
        want = acc.float() * xs * ws.reshape(1, -1)
        assert torch.equal(scale_int32(acc, xs, ws, None, torch.float32), want)
        assert torch.equal(scale_int32(acc, xs, ws, bias, torch.float32), want + bias)


@triton_only
def test_fused_per_token_quant_matches_reference() -> None:
    """The one-kernel activation quantization (photon.kernels.quant) against the torch reference:
    INT8 bit for bit (ties to even included) and FP8 scales exactly. Triton's interpreter
    truncates to FP8 where CUDA rounds to nearest even (and without carrying into the exponent:
    127.9 -> 64, not 128), so on CPU an FP8 value may only fall short of the reference, by at
    most half of it or one subnormal step; tests/gpu/test_cuda_quant.py checks FP8 bit for bit."""
    from photon.kernels.quant import per_token_fp8_fused, per_token_int8_fused

    x = randn(6, 1500, seed=3) * 3
    x[2] = 0  # an all-zero row: the smallest scale, zeros out
    x[3, 0] = 1e4  # one outlier sets its row's scale
    ties = torch.tensor([0.5, 1.5, 2.5, -2.5, -3.5, 126.5, 127.0, -0.5])
    for xs in (x, ties.reshape(1, -1)):
        q, scale = per_token_int8_fused(xs)
        q_ref, scale_ref = qn.per_token_int8(xs)
        assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)
    q, scale = per_token_fp8_fused(x)
    q_ref, scale_ref = qn.per_token_fp8(x)
    assert torch.equal(scale, scale_ref)
    got, want = q.float(), q_ref.float()
    short = (got.abs() < want.abs()) & (got * want >= 0) & \
        ((want - got).abs() <= torch.clamp(want.abs() / 2, min=2.0 ** -9))
    assert torch.equal(got[~short], want[~short]) and (got == want).float().mean() > 0.9


# ---------------------------------------------------------------- checkpoint round trips


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized")
    return {s: quantized_tiny(str(root / s), s) for s in SCHEMES}


def _loaded_weights(path: str) -> dict[str, torch.Tensor]:
    """photon module name -> the dequantized weight photon holds after loading `path`."""
    from photon.quant.calibrate import float_model

    out = {}
    for name, module in float_model(path).named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, WNA16Method):
            out[name] = method.dequantized(module, torch.float32)
        elif method is not None:
            out[name] = module.weight.float() * module.weight_scale
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_then_load_round_trips(scheme: str, checkpoints: dict[str, str]) -> None:
    path = checkpoints[scheme]
    config = json.loads(Path(path, "config.json").read_text(encoding="utf-8"))
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    deq = dequantized_tensors(load_file(os.path.join(path, "model.safetensors")))
    loaded = _loaded_weights(path)
    assert len(loaded) == 6 * 4  # every decoder linear of photon-tiny is quantized
    prefix = "model.layers.2."
    qkv = torch.cat([deq[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([deq[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(loaded[prefix + "self_attn.qkv_proj"], qkv)
    assert torch.equal(loaded[prefix + "mlp.gate_up_proj"], gate_up)
    assert torch.equal(loaded[prefix + "mlp.down_proj"], deq[prefix + "mlp.down_proj.weight"])


def test_asymmetric_w4a16_round_trips(tmp_path: Path) -> None:
    path = quantized_tiny(str(tmp_path / "asym"), "w4a16", symmetric=False)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert "model.layers.0.mlp.down_proj.weight_zero_point" in tensors
    deq = dequantized_tensors(tensors)
    loaded = _loaded_weights(path)
    assert torch.equal(loaded["model.layers.0.self_attn.o_proj"],
                       deq["model.layers.0.self_attn.o_proj.weight"])


# ---------------------------------------------------------------- errors


def _edit(src: str, dst: Path, config: dict | None = None,
          tensors: dict[str, torch.Tensor] | None = None) -> str:
    """A copy of checkpoint src with quantization_config entries or tensors replaced."""
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes(Path(src, name).read_bytes())
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text(encoding="utf-8"))
        cfg["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        state.update(tensors)
        save_file(state, str(dst / "model.safetensors"))
    return str(dst)


def _error(path: str, **kw: object) -> str:
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32", max_model_len=128, **kw)
    return str(e.value)


def _group(checkpoint: str, **weights: object) -> dict:
    cfg = json.loads(Path(checkpoint, "config.json").read_text(encoding="utf-8"))
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    return {"config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


def test_unsupported_scheme_is_named(checkpoints: dict[str, str], tmp_path: Path) -> None:
    src = checkpoints["w4a16"]
    msg = _error(_edit(src, tmp_path / "a", _group(src, num_bits=2)))
    assert "config group 'group_0'" in msg and "2-bit int group" in msg
    assert "supported schemes: W8A8-FP8" in msg and "W4A16 / W8A16" in msg
    msg = _error(_edit(src, tmp_path / "b", {"format": "marlin-24"}))
    assert "format 'marlin-24'" in msg and "pack-quantized" in msg
    msg = _error(_edit(src, tmp_path / "c", {"quant_method": "gptq"}))
    assert "quant_method 'gptq'" in msg and "compressed-tensors" in msg
    msg = _error(_edit(src, tmp_path / "d", {"config_groups": {}}))
    assert "config_groups must be a non-empty object" in msg


def test_lm_head_and_split_packed_modules_are_refused(checkpoints: dict[str, str],
                                                      tmp_path: Path) -> None:
    src = checkpoints["fp8-dynamic"]
    assert "lm_head" in _error(_edit(src, tmp_path / "a", {"ignore": []}))
    msg = _error(_edit(src, tmp_path / "b", {"ignore": ["lm_head", "re:.*k_proj$"]}))
    assert "model.layers.0.self_attn.qkv_proj packs" in msg and "must share one scheme" in msg


def test_mismatched_tensors_name_the_tensor(checkpoints: dict[str, str],
                                            tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight_scale"
    bad = _edit(checkpoints["w8a8-int8"], tmp_path / "a", tensors={name: torch.ones(5, 1)})
    msg = _error(bad)
    assert name in msg and "expected 896" in msg
    weight = "model.layers.1.mlp.up_proj.weight"
    bad = _edit(checkpoints["fp8-dynamic"], tmp_path / "b",
                tensors={weight: torch.zeros(896, 384, dtype=torch.bfloat16)})
    msg = _error(bad)
    assert weight in msg and "the scheme stores torch.float8_e4m3fn" in msg
    shape = "model.layers.1.mlp.up_proj.weight_shape"
    bad = _edit(checkpoints["w4a16"], tmp_path / "c", tensors={shape: torch.tensor([896, 256])})
    assert shape in _error(bad) and "[896, 256]" in _error(bad)


def test_quantization_flag_errors(checkpoints: dict[str, str]) -> None:
    msg = _error(checkpoints["w4a16"], quantization="fp8")
    assert "does not match the checkpoint" in msg and "compressed-tensors" in msg
    assert "no quantization_config" in _error("photon-tiny", quantization="compressed-tensors")
    msg = _error("photon-tiny", quantization="awq")
    assert "quantization (--quantization)" in msg and "available: compressed-tensors, fp8" in msg


def test_fp8_needs_compute_capability_8_9() -> None:
    check_fp8_capability((9, 0), "fp8")
    with pytest.raises(ConfigError, match=r"fp8: FP8 GEMMs need .* 8\.9 .* this GPU is 8\.0"):
        check_fp8_capability((8, 0), "fp8")


def test_moe_models_are_refused(tmp_path: Path) -> None:
    from tests.hf_models import QWEN3_MOE, make_engine_model

    path = make_engine_model(str(tmp_path / "moe"), "Qwen3MoeForCausalLM", extra=QWEN3_MOE)
    assert "Qwen3MoeForCausalLM cannot be quantized" in _error(path, quantization="fp8")


def test_cli_writes_a_checkpoint_and_rejects_bad_arguments(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ok = subprocess.run([sys.executable, "-m", "photon.quant", "--model", "photon-tiny",
                         "--scheme", "w8a16", "--out", str(tmp_path / "q")], env=env,
                        capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "photon.quant", "--model", "photon-tiny",
                          "--scheme", "int3", "--out", str(tmp_path / "r")], env=env,
                         capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--scheme must be one of fp8-dynamic" in bad.stderr
    static = subprocess.run([sys.executable, "-m", "photon.quant", "--model", "photon-tiny",
                             "--scheme", "fp8-static", "--out", str(tmp_path / "s")], env=env,
                            capture_output=True, text=True, timeout=240)
    assert static.returncode == 2 and "needs calibration text" in static.stderr
