"""A compressed-tensors scheme -> the linear method that runs it (or the error saying why not)."""

from __future__ import annotations

from typing import NoReturn

from photon.config import ConfigError
from photon.quant.base import LinearMethod
from photon.quant.compressed_tensors import SUPPORTED, WHERE, QuantArgs, QuantScheme

FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_FORMATS = ("int-quantized", "naive-quantized")
PACKED_FORMATS = ("pack-quantized",)


def method_for(scheme: QuantScheme, fmt: str, use_triton: bool) -> LinearMethod:
    w, a = scheme.weights, scheme.input_activations
    if w.actorder not in (None, "static"):
        _unsupported(scheme, f"actorder {w.actorder!r} (weights reordered by g_idx)")
    if w.type == "float":
        return _fp8(scheme, fmt, w, a)
    if w.type == "int" and a is not None:
        return _int8(scheme, fmt, w, a)
    if w.type == "int":
        return _wna16(scheme, fmt, w, use_triton)
    return _unsupported(scheme, f"weights of type {w.type!r}")


def _fp8(scheme: QuantScheme, fmt: str, w: QuantArgs, a: QuantArgs | None) -> LinearMethod:
    from photon.quant.fp8 import CompressedFp8Method

    _check_format(scheme, fmt, FLOAT_FORMATS)
    if w.num_bits != 8 or w.strategy not in ("channel", "tensor") or not w.symmetric:
        _unsupported(scheme, "these FP8 weights")
    if a is None or a.type != "float" or a.num_bits != 8:
        _unsupported(scheme, "FP8 weights without FP8 activations")
    return CompressedFp8Method(static_input=_static_activations(scheme, a))


def _int8(scheme: QuantScheme, fmt: str, w: QuantArgs, a: QuantArgs) -> LinearMethod:
    from photon.quant.int8 import CompressedInt8Method

    _check_format(scheme, fmt, INT_FORMATS)
    if w.num_bits != 8 or w.strategy != "channel" or not w.symmetric:
        _unsupported(scheme, "these int weights with activation quantization")
    if a.type != "int" or a.num_bits != 8:
        _unsupported(scheme, "these activations")
    return CompressedInt8Method(static_input=_static_activations(scheme, a))


def _wna16(scheme: QuantScheme, fmt: str, w: QuantArgs, use_triton: bool) -> LinearMethod:
    from photon.quant.wna16 import WNA16Method

    _check_format(scheme, fmt, PACKED_FORMATS)
    if w.num_bits not in (4, 8) or w.strategy != "group" or not w.group_size \
            or w.group_size <= 0:
        _unsupported(scheme, "these weight-only int weights")
    return WNA16Method(w.num_bits, int(w.group_size or 0), w.symmetric, use_triton)


def _static_activations(scheme: QuantScheme, a: QuantArgs) -> bool:
    """Dynamic per-token or static per-tensor symmetric activations (False / True)."""
    if a.symmetric and a.dynamic and a.strategy == "token":
        return False
    if a.symmetric and not a.dynamic and a.strategy == "tensor":
        return True
    _unsupported(scheme, "these input activations")


def _check_format(scheme: QuantScheme, fmt: str, allowed: tuple[str, ...]) -> None:
    if fmt not in allowed:
        _unsupported(scheme, f"format {fmt!r} (this scheme is stored as "
                             f"{' or '.join(allowed)})")


def _unsupported(scheme: QuantScheme, what: str) -> NoReturn:
    raise ConfigError(f"{WHERE}: {scheme.describe()}: {what} not supported; supported schemes: "
                      f"{SUPPORTED}")
