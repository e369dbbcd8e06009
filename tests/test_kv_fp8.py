"""FP8 KV cache (--kv-cache-dtype fp8): attention against full precision (the torch reference and
the Triton kernels in the interpreter), the pool's capacity, the scales' sources (checkpoint,
--calculate-kv-scales, 1.0), greedy agreement on photon-tiny and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from photon import LLM, SamplingParams
from photon.attention.kv_quant import (
    CheckpointKVScales,
    KVCacheScales,
    LayerKVScales,
    check_fp8_kv_device,
)
from photon.attention.torch_ref import TorchReferenceBackend
from photon.attention.triton_paged import TritonPagedBackend
from photon.config import ConfigError
from photon.engine_args import EngineArgs
from photon.model.layers.attention import Attention
from photon.model.tiny import PHOTON_TINY, builtin_model_path
from photon.quant.numerics import FP8_DTYPE, FP8_MAX, to_fp8
from photon.worker.model_runner import ModelRunner
from tests.quant_util import heldout
from tests.test_triton_attention import Case, make_case

# FP8 e4m3 keeps 3 mantissa bits (relative error <= 1/16): attention outputs (convex mixtures of
# V rows, |V| ~ 1, K ~ N(0, 1) so softmax weights shift too) move by about a hundredth on average.
FP8_MEAN_TOL = 0.02
FP8_MAX_TOL = 0.25
BACKENDS = [TorchReferenceBackend, TritonPagedBackend]
# (context after the step, query length): a prefill with history, a chunk, decode rows.
PREFILL = [(37, 37), (20, 5), (9, 3)]
DECODE = [(37, 1), (9, 1), (70, 1)]


def _calibrated(case: Case) -> tuple[torch.Tensor, LayerKVScales]:
    """The case's cache quantized with per-head amax / 448 scales, and those scales."""
    k = case.cache[0].abs().amax(dim=(0, 1, 3)).maximum(case.k.abs().amax(dim=(0, 2)))
    v = case.cache[1].abs().amax(dim=(0, 1, 3)).maximum(case.v.abs().amax(dim=(0, 2)))
    scales = LayerKVScales(k / FP8_MAX, v / FP8_MAX)
    cache = torch.stack([to_fp8(case.cache[0], scales.k[:, None]),
                         to_fp8(case.cache[1], scales.v[:, None])])
    return cache, scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("specs", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("shape", [(4, 2, 32, 4), (8, 2, 64, 16), (4, 4, 64, 8)])
def test_fp8_attention_close_to_full_precision(backend: type, specs: list[tuple[int, int]],
                                               shape: tuple[int, int, int, int]) -> None:
    case = make_case(specs, *shape, device="cpu")
    full = TorchReferenceBackend().forward(case.q, case.k, case.v, case.cache.clone(),
                                           case.meta, case.scale)
    cache, scales = _calibrated(case)
    out = backend().forward(case.q, case.k, case.v, cache, case.meta, case.scale, scales)
    assert cache.dtype == FP8_DTYPE
    err = (out - full).abs()
    assert 0 < err.mean().item() < FP8_MEAN_TOL and err.max().item() < FP8_MAX_TOL


@pytest.mark.parametrize("specs", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_triton_fp8_matches_the_reference_bit_for_bit_writes(specs: list[tuple[int, int]]
                                                             ) -> None:
    """Both backends store the same FP8 bytes and read them the same way."""
    case = make_case(specs, 8, 2, 64, 16, device="cpu")
    cache, scales = _calibrated(case)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    ref = TorchReferenceBackend().forward(case.q, case.k, case.v, ref_cache, case.meta,
                                          case.scale, scales)
    tri = TritonPagedBackend().forward(case.q, case.k, case.v, tri_cache, case.meta, case.scale,
                                       scales)
    assert torch.equal(ref_cache.view(torch.uint8), tri_cache.view(torch.uint8))
    assert (ref - tri).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_write_saturates_and_scales(backend: type) -> None:
    """x / scale is stored, saturated to +-448 (never inf / NaN)."""
    cache = torch.zeros(2, 2, 4, 1, 32, dtype=FP8_DTYPE)
    k = torch.full((1, 1, 32), 3.0)
    k[0, 0, 0] = 1e6
    scales = LayerKVScales(torch.tensor([0.5]), torch.tensor([2.0]))
    backend().write_kv(k, k.clone(), cache, torch.tensor([5]), scales)
    assert cache[0, 1, 1, 0, 0].float().item() == FP8_MAX
    assert cache[0, 1, 1, 0, 1].float().item() == 6.0
    assert cache[1, 1, 1, 0, 1].float().item() == 1.5


def test_fp8_cache_without_scales_is_refused() -> None:
    case = make_case(DECODE, 4, 2, 32, 4, device="cpu")
    with pytest.raises(ValueError, match="needs its layer's scales"):
        TorchReferenceBackend().forward(case.q, case.k, case.v, case.cache.to(FP8_DTYPE),
                                        case.meta, case.scale)


def _runner(model: str = PHOTON_TINY, **kw: object) -> ModelRunner:
    args = EngineArgs(model=model, max_model_len=256, max_num_seqs=4, **kw)
    return ModelRunner(args.create_config())


def test_pool_holds_twice_the_tokens_of_bf16_for_the_same_bytes() -> None:
    budget = 1 << 20
    bf16 = _runner(dtype="bfloat16", kv_cache_memory_bytes=budget)
    fp8 = _runner(dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    assert fp8.kv_caches[0].dtype == FP8_DTYPE and bf16.kv_caches[0].dtype == torch.bfloat16
    assert bf16.kv_bytes_per_block() == 2 * fp8.kv_bytes_per_block()
    # num_blocks counts the null block 0 on top of budget // bytes - 1 usable ones.
    assert fp8.num_blocks - 1 == budget // fp8.kv_bytes_per_block() - 1
    assert fp8.num_blocks - 1 == 2 * (bf16.num_blocks - 1) + 1
    assert sum(c.numel() * c.element_size() for c in fp8.kv_caches) <= budget


def _tiny_with_scales(out: Path, extra: dict[str, torch.Tensor]) -> str:
    """photon-tiny's weights in one file plus `extra` tensors (the KV scales)."""
    src = Path(builtin_model_path(PHOTON_TINY))
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file({**tensors, **extra}, str(out / "model.safetensors"))
    return str(out)


def _num_layers_heads() -> tuple[int, int]:
    cfg = json.loads((Path(builtin_model_path(PHOTON_TINY)) / "config.json").read_text())
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def test_checkpoint_scales_are_read(tmp_path: Path) -> None:
    layers, heads = _num_layers_heads()
    extra = {}
    for i in range(layers):
        extra[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        extra[f"model.layers.{i}.self_attn.v_scale"] = torch.arange(1, heads + 1) * 0.001
    model = _tiny_with_scales(tmp_path / "tiny", extra)
    s = _runner(model, kv_cache_dtype="fp8", calculate_kv_scales=True).kv_scales
    assert s.source == "checkpoint" and not s.calibrating  # checkpoint scales win
    for i in range(layers):
        assert torch.allclose(s.k[i], torch.full((heads,), 0.01 * (i + 1)))
        assert torch.allclose(s.v[i], torch.arange(1, heads + 1) * 0.001)
    # auto: the same checkpoint loads (the scale tensors are not model weights).
    assert _runner(model).kv_scales is None


def test_checkpoint_kv_scale_names_and_shapes() -> None:
    rec = CheckpointKVScales()
    weights = [("model.layers.0.self_attn.kv_scale", torch.tensor([2.0])),
               ("model.layers.1.self_attn.k_proj.output_scale", torch.tensor(3.0)),
               ("model.layers.1.self_attn.attn.v_scale", torch.tensor([4.0, 5.0])),
               ("model.layers.0.mlp.down_proj.weight", torch.zeros(1))]
    assert [n for n, _ in rec.filter(weights)] == ["model.layers.0.mlp.down_proj.weight"]
    scales = KVCacheScales.ones(2, 1, torch.device("cpu"))
    assert rec.apply(scales, total_kv_heads=2, first_head=1)  # the second of two heads
    assert scales.k[:, 0].tolist() == [2.0, 3.0] and scales.v[:, 0].tolist() == [2.0, 5.0]
    bad = CheckpointKVScales({(0, "k"): torch.ones(3), (0, "v"): torch.ones(1)})
    with pytest.raises(ConfigError, match="k_scale has 3 values; expected 1"):
        bad.apply(KVCacheScales.ones(1, 2, torch.device("cpu")), 2, 0)
    missing = CheckpointKVScales({(0, "k"): torch.ones(1)})
    with pytest.raises(ConfigError, match="none for model.layers.0.self_attn.v_scale"):
        missing.apply(KVCacheScales.ones(1, 2, torch.device("cpu")), 2, 0)
    zero = CheckpointKVScales({(0, "k"): torch.zeros(1), (0, "v"): torch.ones(1)})
    with pytest.raises(ConfigError, match="not a positive finite number"):
        zero.apply(KVCacheScales.ones(1, 2, torch.device("cpu")), 2, 0)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _first_keys(llm: LLM) -> dict[int, torch.Tensor]:
    """Records each attention layer's K of its first call (the calibrating forward)."""
    seen: dict[int, torch.Tensor] = {}

    def hook(module: Attention, args: tuple) -> None:
        seen.setdefault(module.layer_idx, args[1].detach().clone())

    for m in llm.engine.runner.model.modules():
        if isinstance(m, Attention):
            m.register_forward_pre_hook(hook)
    return seen


def test_calculate_kv_scales_once_from_the_first_forward() -> None:
    llm = LLM(PHOTON_TINY, max_model_len=256, kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.engine.runner
    scales = runner.kv_scales
    assert scales.calibrating and torch.equal(scales.k, torch.ones_like(scales.k))
    keys = _first_keys(llm)
    prompts = heldout()[4:6]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert scales.source == "calculated" and not scales.calibrating
    for layer, k in keys.items():
        k = k.reshape(k.shape[0], scales.k.shape[1], -1)
        assert torch.allclose(scales.k[layer], k.abs().amax(dim=(0, 2)) / FP8_MAX)
    fixed = scales.k.clone(), scales.v.clone()
    llm.generate(heldout()[6:8], GREEDY, use_tqdm=False)  # other prompts: scales stay
    assert torch.equal(scales.k, fixed[0]) and torch.equal(scales.v, fixed[1])
    llm.engine.shutdown()


def _prefix_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of reference tokens generated before the first divergence of each sequence."""
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
               for x, y in zip(ref, got))
    return same / sum(len(x) for x in ref)


def _greedy(prompts: list[list[int]], **kw: object) -> list[list[int]]:
    llm = LLM(PHOTON_TINY, max_model_len=256, **kw)
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.engine.shutdown()
    return out


@pytest.mark.parametrize("calculate,bound", [(False, 0.95), (True, 0.75)],
                         ids=["scales-1", "calculated"])
def test_greedy_with_fp8_kv_agrees_with_float_kv(calculate: bool, bound: float) -> None:
    """Bound: that share of the float-KV greedy tokens comes before any divergence. Calculated
    scales fit the first prefill's K and V only: later, larger values saturate, hence the lower
    bound (photon-tiny's float32 K and V are well inside e4m3's range at scale 1.0)."""
    prompts = heldout()[4:10]
    ref = _greedy(prompts)
    got = _greedy(prompts, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=calculate)
    assert _prefix_agreement(ref, got) >= bound


@pytest.mark.parametrize("kw,match", [
    ({"kv_cache_dtype": "fp8_e5m2"}, "must be one of auto, fp8, fp8_e4m3"),
    ({"kv_cache_dtype": "int8"}, "must be one of auto, fp8, fp8_e4m3"),
    ({"calculate_kv_scales": True}, "needs kv_cache_dtype .--kv-cache-dtype. fp8"),
    ({"kv_cache_dtype": "fp8", "kv_transfer_config": {"kv_connector": "SharedMemoryConnector",
                                                      "kv_role": "kv_both"}},
     "not supported with kv_transfer_config"),
])
def test_bad_kv_cache_dtype_combinations(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=PHOTON_TINY, **kw).create_config()


def test_unsupported_kv_cache_scheme_and_old_gpus() -> None:
    from photon.attention.kv_quant import check_kv_cache_dtype

    scheme = {"kv_cache_scheme": {"num_bits": 8, "type": "int", "symmetric": True}}
    with pytest.raises(ConfigError, match="kv_cache_scheme .* is not supported"):
        check_kv_cache_dtype("fp8", False, scheme)
    assert check_kv_cache_dtype("auto", False, scheme) == "auto"  # auto ignores it
    with pytest.raises(ConfigError, match="compute capability 8.9 or newer.*this GPU is 8.0"):
        check_fp8_kv_device((8, 0))
    check_fp8_kv_device((9, 0))


@pytest.mark.parametrize("block_n", [64, 128])
def test_fp8_decode_with_f16_tiles_matches_the_plain_launch(block_n: int) -> None:
    """The FP8 decode launch that converts tiles to float16 reads the same values: q (and the
    probabilities before the V dot) are all that is rounded differently, to float16's 11
    significant bits (relative 2^-11): outputs of magnitude ~1 move by a few 1e-4."""
    from photon.attention.triton_paged import DecodeTuning, decode_attention, decode_tuning

    case = make_case(DECODE, 8, 2, 64, 16, device="cpu")
    cache, scales = _calibrated(case)
    meta = case.meta
    assert decode_tuning(64, cache, case.q.bfloat16()).fp8_f16  # 16-bit models only
    assert not decode_tuning(64, cache, case.q).fp8_f16
    plain = DecodeTuning(block_n=64, num_warps=4, num_stages=2, fp8_f16=False)
    base = decode_attention(case.q, cache, meta.block_tables, meta.seq_lens, case.scale, scales,
                            plain)
    tune = DecodeTuning(block_n=block_n, num_warps=4, num_stages=2, fp8_f16=True)
    f16 = decode_attention(case.q, cache, meta.block_tables, meta.seq_lens, case.scale, scales,
                           tune)
    assert f16.dtype == base.dtype and f16.shape == base.shape
    assert (f16.float() - base.float()).abs().max().item() < 2e-3
