"""compressed-tensors checkpoints: config.json `quantization_config` parsed into typed schemes.

Layout (what llm-compressor writes): `config_groups` maps a group name to {targets, weights,
input_activations}; `ignore` lists modules left unquantized; `format` says how the tensors are
stored (float-quantized, int-quantized, pack-quantized). Targets and ignore entries are a class
name ("Linear"), a module name, or "re:" and a regular expression matched against module names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from photon.config import ConfigError
from photon.quant.base import LinearMethod
from photon.quant.config import QuantConfig

WHERE = "config.json quantization_config"
SUPPORTED = (
    "W8A8-FP8 (format float-quantized: 8-bit float weights per channel or per tensor, 8-bit "
    "float activations dynamic per token or static per tensor), W8A8-INT8 (format "
    "int-quantized: 8-bit int symmetric per-channel weights, 8-bit int symmetric activations "
    "dynamic per token or static per tensor), W4A16 / W8A16 (format pack-quantized: 4- or 8-bit "
    "int weights with group scales, activations unquantized)")
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class QuantArgs:
    num_bits: int
    type: str  # "int" | "float"
    strategy: str  # "tensor" | "channel" | "group" | "token"
    symmetric: bool
    dynamic: bool
    group_size: int | None
    actorder: str | None

    @classmethod
    def parse(cls, obj: object, where: str) -> QuantArgs:
        if not isinstance(obj, dict):
            raise ConfigError(f"{where} must be an object, got {obj!r}")
        try:
            return cls(num_bits=int(obj["num_bits"]), type=str(obj.get("type", "int")),
                       strategy=str(obj.get("strategy") or "tensor"),
                       symmetric=bool(obj.get("symmetric", True)),
                       dynamic=bool(obj.get("dynamic", False)),
                       group_size=None if obj.get("group_size") is None
                       else int(obj["group_size"]),
                       actorder=obj.get("actorder"))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {type(e).__name__} {e} in {obj!r}") from None

    def describe(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        group = f" group_size {self.group_size}" if self.strategy == "group" else ""
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.num_bits}-bit {self.type} {self.strategy}{group} {sym} {kind}"


@dataclass(frozen=True)
class QuantScheme:
    group: str  # the config group's name
    targets: tuple[str, ...]
    weights: QuantArgs
    input_activations: QuantArgs | None

    def describe(self) -> str:
        acts = self.input_activations.describe() if self.input_activations else "none"
        return f"config group {self.group!r} (weights {self.weights.describe()}; input " \
               f"activations {acts})"


def matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: tuple[QuantScheme, ...], ignore: tuple[str, ...], fmt: str,
                 use_triton: bool) -> None:
        from photon.quant.schemes import method_for

        self.schemes, self.ignore, self.format = schemes, ignore, fmt
        # Built (and checked) once per scheme: layers share their scheme's method.
        self.methods = {s.group: method_for(s, fmt, use_triton) for s in schemes}
        if self.scheme_of(LM_HEAD) is not None:
            raise ConfigError(f"{WHERE}: the targets quantize lm_head; photon keeps the LM head "
                              f"unquantized (list lm_head under ignore)")

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any] | None, use_triton: bool
                        ) -> QuantConfig:
        ckpt = checkpoint or {}
        groups = ckpt.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConfigError(f"{WHERE}: config_groups must be a non-empty object, got "
                              f"{groups!r}")
        sparsity = ckpt.get("sparsity_config") or {}
        if sparsity.get("format", "dense") not in ("dense", None):
            raise ConfigError(f"{WHERE}: sparsity_config {sparsity.get('format')!r} is not "
                              f"supported; supported schemes: {SUPPORTED}")
        ignore = ckpt.get("ignore") or []
        if not isinstance(ignore, list):
            raise ConfigError(f"{WHERE}: ignore must be a list of module names, got {ignore!r}")
        schemes = tuple(_parse_group(name, g) for name, g in groups.items())
        return cls(schemes, tuple(map(str, ignore)), str(ckpt.get("format") or ""), use_triton)

    def scheme_of(self, module: str) -> QuantScheme | None:
        if any(matches(module, t) for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(matches(module, t) for t in s.targets)),
                    None)

    def linear_method(self, module: str, members: tuple[str, ...]) -> LinearMethod | None:
        schemes = {m: self.scheme_of(m) for m in members}
        groups = {s.group if s else None for s in schemes.values()}
        if len(groups) > 1:
            shown = ", ".join(f"{m}: {s.group if s else 'unquantized'}"
                              for m, s in schemes.items())
            raise ConfigError(f"{WHERE}: {module} packs {', '.join(members)}, which must share "
                              f"one scheme; the checkpoint has {shown}")
        group = groups.pop()
        return None if group is None else self.methods[group]

    def uses_fp8(self) -> bool:
        return any(s.weights.type == "float" for s in self.schemes)


def _parse_group(name: str, group: object) -> QuantScheme:
    where = f"{WHERE}.config_groups.{name}"
    if not isinstance(group, dict):
        raise ConfigError(f"{where} must be an object, got {group!r}")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets:
        raise ConfigError(f"{where}.targets must be a non-empty list, got {targets!r}")
    if group.get("weights") is None:
        raise ConfigError(f"{where}: no weights quantization; supported schemes: {SUPPORTED}")
    acts = group.get("input_activations")
    if group.get("output_activations") is not None:
        raise ConfigError(f"{where}: output_activations quantization is not supported; "
                          f"supported schemes: {SUPPORTED}")
    return QuantScheme(
        group=name, targets=tuple(map(str, targets)),
        weights=QuantArgs.parse(group["weights"], f"{where}.weights"),
        input_activations=None if acts is None
        else QuantArgs.parse(acts, f"{where}.input_activations"))
