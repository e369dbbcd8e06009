"""Triton kernels for CUDA tensors; the torch code in the layers/sampler is the CPU path and oracle.

`USE_TRITON` is false when triton does not import or `PHOTON_TRITON=0`: callers branch on
`x.is_cuda and USE_TRITON` (two attribute checks, no per-call try/except).
"""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

USE_TRITON = HAS_TRITON and os.environ.get("PHOTON_TRITON", "1") != "0"

__all__ = ["HAS_TRITON", "USE_TRITON"]
