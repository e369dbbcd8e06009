"""Tensor parallelism: the process group of the ranks (`TPGroup`) and the worker processes of
ranks 1..tp-1 (`photon.distributed.workers`); the expert-parallel group that spans data-parallel
engine cores (`photon.distributed.dp_experts`)."""

from __future__ import annotations

from photon.distributed.group import TPGroup, TPGroupSpec

__all__ = ["TPGroup", "TPGroupSpec"]
