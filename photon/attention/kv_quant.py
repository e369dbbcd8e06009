"""FP8 KV cache (--kv-cache-dtype fp8): cache dtype, per-layer per-KV-head scales and their sources.

A cached value c (float8_e4m3fn) stands for c * scale, with one float32 scale per layer, per KV head,
for K and V separately. The attention backends quantize when they write (x / scale, saturated to
e4m3's range) and dequantize when they read. Scales come, in this order, from the checkpoint
(vLLM's `k_scale` / `v_scale` tensors, as llm-compressor's `kv_cache_scheme` writes them), from the
first forward (--calculate-kv-scales: amax / 448 of that forward's K and V, then fixed), or are 1.0.
Scales are device tensors written in place only (graphs captured over them stay valid).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from photon.config import ConfigError, flag
from photon.quant.numerics import FP8_DTYPE, fp8_scale

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_NAMES = ("fp8", "fp8_e4m3")
# A checkpoint's KV scale tensors: vLLM's names (self_attn[.attn].k_scale / v_scale, kv_scale for
# both) and the older k_proj / v_proj output_scale.
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for --kv-cache-dtype `name` (auto: the model's dtype)."""
    return FP8_DTYPE if name in FP8_NAMES else model_dtype


def check_kv_cache_dtype(name: str, calculate: bool, checkpoint: dict[str, Any] | None) -> str:
    """--kv-cache-dtype and --calculate-kv-scales checked against each other and the checkpoint's
    quantization_config (its kv_cache_scheme); ConfigError naming the flag at fault."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"{flag('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}"
                          f" (fp8 = fp8_e4m3: float8 e4m3 with per-head scales); got {name!r}")
    if calculate and name not in FP8_NAMES:
        raise ConfigError(f"{flag('calculate_kv_scales')} computes the scales of an FP8 KV cache:"
                          f" it needs {flag('kv_cache_dtype')} fp8 or fp8_e4m3, got {name!r}")
    scheme = (checkpoint or {}).get("kv_cache_scheme") if isinstance(checkpoint, dict) else None
    if name in FP8_NAMES and scheme:
        _check_scheme(scheme)
    return name


def _check_scheme(scheme: object) -> None:
    where = "config.json quantization_config.kv_cache_scheme"
    ok = isinstance(scheme, dict) and int(scheme.get("num_bits", 0)) == 8 \
        and scheme.get("type", "float") == "float" and scheme.get("symmetric", True)
    if not ok:
        raise ConfigError(f"{where} {scheme!r} is not supported with {flag('kv_cache_dtype')} "
                          f"fp8: photon's FP8 KV cache reads 8-bit float symmetric scales "
                          f"(per tensor or per head)")


@dataclass(frozen=True)
class LayerKVScales:
    """One layer's dequantization scales, [num_kv_heads] float32 each (views of KVCacheScales)."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class KVCacheScales:
    """The scales of every layer of one FP8 KV cache; the model runner owns it."""

    k: torch.Tensor  # [num_layers, num_kv_heads] float32, on the cache's device
    v: torch.Tensor
    # The next eager forward sets the scales of every layer from its K and V, then the runner
    # clears this (finish_calibration): from then on the scales are fixed.
    calibrating: bool = False
    # checkpoint | pending (to be calculated) | calculated | default (1.0)
    source: str = "default"
    _layers: list[LayerKVScales] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._layers = [LayerKVScales(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    @classmethod
    def ones(cls, num_layers: int, num_kv_heads: int, device: torch.device) -> KVCacheScales:
        shape = (num_layers, num_kv_heads)
        return cls(torch.ones(shape, device=device), torch.ones(shape, device=device))

    def layer(self, i: int, k: torch.Tensor | None = None, v: torch.Tensor | None = None
              ) -> LayerKVScales:
        """Layer i's scales; while calibrating, first set from k, v [T, Hkv, D] (amax / 448)."""
        scales = self._layers[i]
        if self.calibrating and k is not None and v is not None and k.shape[0] > 0:
            scales.k.copy_(fp8_scale(k.abs().amax(dim=(0, 2))))
            scales.v.copy_(fp8_scale(v.abs().amax(dim=(0, 2))))
        return scales

    def start_calibration(self) -> None:
        """--calculate-kv-scales without checkpoint scales: the next eager forward sets them."""
        self.calibrating = self.source == "pending"

    def finish_calibration(self) -> None:
        if self.calibrating:
            self.calibrating = False
            self.source = "calculated"


@dataclass
class CheckpointKVScales:
    """KV scale tensors met while a checkpoint streams in (kept out of the model's weights)."""

    found: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without its KV scales, which are recorded by (layer, "k" | "v")."""
        for name, tensor in weights:
            m = _SCALE_NAME.search(name)
            if m is None:
                yield name, tensor
                continue
            layer, which = int(m.group(1)), m.group(2) or m.group(3)
            for kind in ("k", "v") if which == "kv" else (which,):
                self.found[(layer, kind)] = tensor.detach().float().reshape(-1)

    def apply(self, scales: KVCacheScales, total_kv_heads: int, first_head: int) -> bool:
        """Copy the recorded scales into `scales` (this rank's heads: first_head on); False when
        the checkpoint had none. Every layer needs both K and V scales."""
        if not self.found:
            return False
        num_layers, local = scales.k.shape
        for i in range(num_layers):
            for kind, dst in (("k", scales.k), ("v", scales.v)):
                dst[i].copy_(self._heads(i, kind, total_kv_heads)[first_head:first_head + local])
        scales.source = "checkpoint"
        return True

    def _heads(self, layer: int, kind: str, total_kv_heads: int) -> torch.Tensor:
        t = self.found.get((layer, kind))
        name = f"model.layers.{layer}.self_attn.{kind}_scale"
        if t is None:
            raise ConfigError(f"the checkpoint has KV cache scales, but none for {name}: every "
                              f"layer needs k_scale and v_scale")
        if t.numel() not in (1, total_kv_heads):
            raise ConfigError(f"checkpoint tensor {name} has {t.numel()} values; expected 1 "
                              f"(per tensor) or {total_kv_heads} (one per KV head)")
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise ConfigError(f"checkpoint tensor {name} holds a scale that is not a positive "
                              f"finite number: {t.tolist()}")
        return t.expand(total_kv_heads)


def fp8_scales(cache: torch.Tensor, scales: LayerKVScales | None) -> LayerKVScales | None:
    """The scales a backend applies to `cache`: None for an unquantized cache; an FP8 cache
    without scales is a caller's bug."""
    if cache.dtype != FP8_DTYPE:
        return None
    if scales is None:
        raise ValueError("an FP8 KV cache needs its layer's scales (ForwardContext.kv_scales)")
    return scales


def check_fp8_kv_device(capability: tuple[int, int]) -> None:
    """The attention kernels convert FP8 tiles on the GPU: compute capability 8.9 or newer."""
    if tuple(capability) < (8, 9):
        raise ConfigError(
            f"{flag('kv_cache_dtype')} fp8: the FP8 KV cache needs a GPU of compute capability "
            f"8.9 or newer (Ada, Hopper, Blackwell); this GPU is {capability[0]}.{capability[1]}."
            f" Use {flag('kv_cache_dtype')} auto on it")


def build_kv_scales(cache_dtype: str, calculate: bool, checkpoint: CheckpointKVScales,
                    num_layers: int, total_kv_heads: int, local_kv_heads: int, first_head: int,
                    device: torch.device) -> KVCacheScales | None:
    """The scales of a cache of `local_kv_heads` heads (first_head on, of total_kv_heads) for
    --kv-cache-dtype `cache_dtype`: None for an unquantized cache. The runner starts
    calibration (`calibrating`) only once its CUDA graphs are captured."""
    if cache_dtype not in FP8_NAMES:
        return None
    scales = KVCacheScales.ones(num_layers, local_kv_heads, device)
    if not checkpoint.apply(scales, total_kv_heads, first_head) and calculate:
        scales.source = "pending"
    return scales
