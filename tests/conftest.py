from __future__ import annotations

import os
import signal
from collections.abc import Iterator

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


_SIGINT_AT_START = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in the background


@pytest.fixture(autouse=True)
def _sigint_left_as_found() -> Iterator[None]:
    """A test that leaves SIGINT handled differently than it found it, or blocked, would make
    later tests' Ctrl-C behave differently: it fails here, naming itself, and the disposition
    the suite started with is put back."""
    yield
    handler = signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if handler is not _SIGINT_AT_START:
        signal.signal(signal.SIGINT, _SIGINT_AT_START)
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    assert handler is _SIGINT_AT_START and not blocked, \
        f"the test left SIGINT {'blocked' if blocked else f'handled by {handler!r}'}"
