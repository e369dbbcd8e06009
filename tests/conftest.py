from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _photon_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """photon-tiny is created into a per-session temp dir: tests never write to ~/.cache. Hub
    model ids resolve from the cache only: tests never reach the network."""
    os.environ["PHOTON_CACHE_DIR"] = str(tmp_path_factory.mktemp("photon-cache"))
    os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    """Without CUDA, Triton kernels run in its interpreter; it is read when a kernel is decorated,
    so it has to be set before any test imports a module that defines one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
