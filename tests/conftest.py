from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from types import ModuleType

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
    _share_cores_between_workers(torch)


def _share_cores_between_workers(torch: ModuleType) -> None:
    """Under pytest-xdist (`-n N`) each worker takes its share of the cores for torch's
    intra-op threads, and so do the processes its tests start (engine cores, API servers,
    grammar workers: OMP_NUM_THREADS is inherited). With every process on all the cores, the
    OpenMP threads of one spin at their barriers while another process holds a core: a server
    test then runs several times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = int(os.environ.setdefault(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers))))
        torch.set_num_threads(threads)


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
