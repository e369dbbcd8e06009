"""Triton kernels for CUDA tensors; the torch code in the layers/sampler is the CPU path and oracle.

Whether the model's layers use them is configuration (`ModelConfig.use_triton`, resolved once by
`EngineArgs.create_config`); each kernel module imports triton, so it is imported only by a caller
that uses it, never by importing this package.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


@functools.cache
def has_triton() -> bool:
    """Whether triton imports (CPU-only installs may lack it); probed once, on first call."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def elementwise_kernel(name: str, use_triton: bool) -> Callable[..., Any] | None:
    """The kernel `name` of photon.kernels.elementwise for a layer built with use_triton (its
    module, and triton, are imported now), else None: the layer runs its torch ops."""
    if not use_triton:
        return None
    from photon.kernels import elementwise

    kernel: Callable[..., Any] = getattr(elementwise, name)
    return kernel


__all__ = ["elementwise_kernel", "has_triton"]
