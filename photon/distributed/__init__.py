"""Tensor parallelism: the process group of the ranks (`TPGroup`) and the worker processes of
ranks 1..tp-1 (`photon.distributed.workers`)."""

from __future__ import annotations

from photon.distributed.group import TPGroup, TPGroupSpec

__all__ = ["TPGroup", "TPGroupSpec"]
