"""photon.worker.cuda_graph.Captured keeps alive what its captured function closes over (a
replay reads those addresses), with torch's graph capture stood in for on CPU."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from photon.worker.cuda_graph import Captured


class _Graph:
    def pool(self) -> tuple[int, int]:
        return (0, 1)


@contextlib.contextmanager
def _capture(graph: _Graph, pool: tuple | None = None) -> Iterator[None]:
    yield


def test_inputs_built_outside_the_capture_live_as_long_as_the_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    inputs = torch.arange(4)
    alive = weakref.ref(inputs)
    g = Captured(lambda x=inputs: x * 2, None)
    del inputs
    gc.collect()
    assert alive() is not None  # the graph would read freed memory otherwise
    assert torch.equal(g.out, torch.arange(4) * 2)
    del g
    gc.collect()
    assert alive() is None
