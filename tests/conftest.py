from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _photon_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """photon-tiny is created into a per-session temp dir: tests never write to ~/.cache."""
    os.environ["PHOTON_CACHE_DIR"] = str(tmp_path_factory.mktemp("photon-cache"))
