"""Grammar compiles under load: size limits, a pool where a slow compile never blocks a cheap one,
expiry that frees the slot and keeps the result out of the cache, a cache bounded in bytes, and
shutdowns that wait for no compile. Slow compiles are fakes that block on an Event: nothing here
depends on timing."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.engine_args import EngineArgs
from photon.structured.backend import GrammarError
from photon.structured.compile_pool import HEAVY_CHARS, CompilePool, PoolCounts
from photon.structured.manager import StructuredOutputManager
from photon.structured.params import GrammarLimits
from photon.structured.params import StructuredOutputsParams as SO

BIG = 'root ::= "a"' + " " * HEAVY_CHARS  # a heavy-lane spec that compiles at once for real
WAIT_S = 60.0  # bound on any wait below: a hang fails the test instead of stalling the suite


def _gate() -> threading.Event:
    return threading.Event()


def _blocked(gate: threading.Event, value: object = "done"):  # noqa: ANN202
    def fn() -> object:
        assert gate.wait(WAIT_S), "test gate never opened"
        return value
    return fn


def _until(cond, what: str) -> None:  # noqa: ANN001
    """Poll `cond` (state, not time) with a bound."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ---------------------------------------------------------------------------------- limits
@pytest.mark.parametrize("spec, words", [
    (SO(grammar='root ::= "' + "a" * 200 + '"'), "grammar is 211 characters long; at most 100"),
    (SO(regex="a" * 101), "regex is 101 characters long; at most 100"),
    (SO(json={"enum": ["x" * 120]}), "json is 133 characters long; at most 100"),
    (SO(choice=["a" * 30] * 4), "choice is 133 characters long; at most 100"),
    (SO(choice=[str(i) for i in range(6)]), "choice has 6 entries; at most 5"),
])
def test_limits_reject_with_the_limit_and_the_value(spec: SO, words: str) -> None:
    limits = GrammarLimits(max_chars=100, max_choices=5)
    with pytest.raises(ValueError, match=words) as err:
        limits.check(spec)
    assert "structured_outputs_max_c" in str(err.value)  # names the engine argument
    GrammarLimits(max_chars=0, max_choices=0).check(spec)  # 0: no limit
    GrammarLimits(max_chars=6, max_choices=1).check(SO(regex="[a-z]+"))  # at the limit


def test_limits_are_engine_args() -> None:
    llm = LLM("photon-tiny-random", max_model_len=128, structured_outputs_max_chars=50,
              structured_outputs_worker="inline")
    with pytest.raises(ValueError, match="at most 50 are allowed .structured_outputs_max_chars"):
        llm.generate("x", SamplingParams(structured_outputs=SO(regex="[a-z]" * 20)),
                     use_tqdm=False)
    assert not llm.engine.structured.cache  # rejected before any compile
    llm.engine.assert_drained()
    with pytest.raises(ConfigError, match="structured_outputs_max_choices must be an integer >= 0"):
        EngineArgs(structured_outputs_max_choices=-1).create_config()


# ---------------------------------------------------------------------------------- the pool
@pytest.fixture
def pool() -> Iterator[CompilePool]:
    pool = CompilePool(3, "test-compile")
    yield pool
    pool.shutdown()


def test_small_compile_runs_while_heavy_ones_hold_their_lane(pool: CompilePool) -> None:
    gate = _gate()
    heavy = [pool.submit(_blocked(gate, i), heavy=True) for i in range(3)]
    assert pool.counts() == PoolCounts(1, 2, 0)  # slots - 1 heavy
    assert pool.submit(lambda: "small", heavy=False).result(WAIT_S) == "small"
    assert not any(f.done() for f in heavy)
    gate.set()
    assert [f.result(WAIT_S) for f in heavy] == [0, 1, 2]


def test_abandoned_compile_frees_its_slot_and_drops_its_result(pool: CompilePool) -> None:
    gate, later = _gate(), _gate()
    first = pool.submit(_blocked(gate, "stale"), heavy=True)
    second = pool.submit(_blocked(later), heavy=True)
    third = pool.submit(_blocked(later), heavy=True)  # the heavy lane (2 of 3 slots) is full
    small = [pool.submit(_blocked(later), heavy=False) for _ in range(2)]  # one slot left
    assert pool.counts() == PoolCounts(2, 3, 0)
    assert pool.abandon(first, GrammarError("too slow"))
    with pytest.raises(GrammarError, match="too slow"):
        first.result(0)
    # Its slot is free: the small job starts there; the heavy one still waits, because the
    # abandoned compile keeps running (and counts against the heavy lane) until it returns.
    assert pool.counts() == PoolCounts(1, 3, 1)
    assert not third.done() and not pool.abandon(first, GrammarError("again"))
    gate.set()  # the abandoned compile returns: its result reaches nobody
    _until(lambda: pool.counts().abandoned == 0, "the abandoned compile to end")
    assert isinstance(first.exception(0), GrammarError)
    later.set()
    assert [f.result(WAIT_S) for f in (second, third, *small)] == ["done"] * 4


def test_abandoned_queued_job_never_runs(pool: CompilePool) -> None:
    gate, ran = _gate(), []
    running = [pool.submit(_blocked(gate), heavy=False) for _ in range(3)]
    queued = pool.submit(lambda: ran.append(1), heavy=False)
    assert pool.abandon(queued, GrammarError("expired"))
    gate.set()
    for f in running:
        f.result(WAIT_S)
    _until(lambda: pool.counts() == PoolCounts(0, 0, 0), "the pool")
    assert ran == [] and isinstance(queued.exception(0), GrammarError)


def test_shutdown_waits_for_no_compile() -> None:
    pool, gate = CompilePool(2, "test-shutdown"), _gate()
    running = pool.submit(_blocked(gate), heavy=False)
    queued = [pool.submit(_blocked(gate), heavy=False) for _ in range(2)]
    pool.shutdown()  # returns although a compile is blocked
    assert running.cancelled() and all(f.cancelled() for f in queued)
    assert pool.submit(lambda: 1, heavy=False).cancelled()
    threads = [t for t in threading.enumerate() if t.name == "test-shutdown"]
    assert threads and all(t.daemon for t in threads)
    gate.set()
    for t in threads:
        t.join(WAIT_S)


def test_running_compile_does_not_block_interpreter_exit() -> None:
    code = ("import threading\n"
            "from photon.structured.compile_pool import CompilePool\n"
            "pool = CompilePool(2)\n"
            "fut = pool.submit(threading.Event().wait, heavy=True)\n"  # never returns
            "print('submitted', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "submitted\n", proc.stderr


# ---------------------------------------------------------------------------------- manager
@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from photon.model.tiny import resolve_model_path
    from photon.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(resolve_model_path("photon-tiny-random"))


def _manager(tokenizer, worker: str = "inline", **kw) -> StructuredOutputManager:  # noqa: ANN001
    """A manager built as the engine builds it: from the engine arguments (`structured_outputs_`
    + the keys of kw), for a 1024-token vocabulary."""
    args = EngineArgs(structured_outputs_worker=worker,
                      **{f"structured_outputs_{k}": v for k, v in kw.items()})
    return StructuredOutputManager(args.structured_outputs_config(), tokenizer, 1024,
                                   max_rows=256, cuda=False)


def test_manager_has_no_settings_of_its_own(tokenizer) -> None:  # noqa: ANN001
    """Every setting comes from the engine's StructuredOutputsConfig (a manager that defaulted
    to the inline worker while the engine said process once made tests run another path)."""
    params = inspect.signature(StructuredOutputManager).parameters
    assert [p.name for p in params.values() if p.default is not inspect.Parameter.empty] == []
    config = EngineArgs(structured_outputs_timeout=7, structured_outputs_max_chars=9,
                        structured_outputs_cache_mb=3).structured_outputs_config()
    manager = StructuredOutputManager(config, tokenizer, 1024, max_rows=4, cuda=False)
    assert manager.config.worker == "process" and not manager.started
    assert manager.cache.limit_bytes == 3 << 20
    assert manager.timeout_message == ("grammar compilation timed out after 7 s "
                                       "(structured_outputs_timeout)")
    with pytest.raises(ValueError, match="at most 9 are allowed"):
        manager.compile(SO(regex="a" * 10))
    manager.shutdown()


@pytest.fixture
def manager(tokenizer) -> Iterator[StructuredOutputManager]:  # noqa: ANN001
    manager = _manager(tokenizer)
    yield manager
    manager.shutdown()


def _block_grammars(manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch,
                    gate: threading.Event) -> list[str]:
    """EBNF specs compile only once `gate` opens; returns the grammars that started."""
    backend, started = manager.backend, []
    real = backend.compile

    def compile(spec: SO):  # noqa: ANN202
        if spec.grammar is not None:
            started.append(spec.grammar)
            assert gate.wait(WAIT_S), "test gate never opened"
        return real(spec)

    monkeypatch.setattr(backend, "compile", compile)
    return started


def test_cheap_grammar_compiles_while_two_slow_ones_are_in_flight(
        manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _gate()
    started = _block_grammars(manager, monkeypatch, gate)
    slow = [manager.compile(SO(grammar=BIG + " " * i)) for i in range(3)]
    _until(lambda: len(started) == 2, "two slow compiles to start")
    cheap = manager.compile(SO(regex="[0-9]{3}"))
    assert manager.backend.memory_bytes(cheap.result(WAIT_S)) > 0
    assert not any(f.done() for f in slow)
    gate.set()
    assert all(f.result(WAIT_S) is not None for f in slow)


def test_timed_out_compile_is_expired_not_cached(tokenizer, monkeypatch) -> None:  # noqa: ANN001
    manager = _manager(tokenizer, timeout=0.01)
    gate = _gate()
    started = _block_grammars(manager, monkeypatch, gate)
    spec = SO(grammar=BIG)
    grammar = manager.request_grammar(spec)
    _until(lambda: started, "the slow compile to start")
    forgotten = []
    monkeypatch.setattr(manager.executor, "forget", forgotten.append)
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(GrammarError, match="timed out after 0.01 s .structured_outputs_timeout"):
        while not grammar.poll():  # the request's own deadline (0.01 s) expires the compile
            assert time.monotonic() < deadline
    assert spec.key() not in manager.cache and forgotten == [spec.key()]
    assert manager.pool.counts() == PoolCounts(0, 0, 1)
    grammar.release()
    gate.set()  # the abandoned compile ends; its result is dropped
    _until(lambda: manager.pool.counts().abandoned == 0, "the abandoned compile to end")
    assert spec.key() not in manager.cache and manager.cache.nbytes == 0
    manager.shutdown()


def test_cache_evicts_by_bytes_and_keeps_pinned_entries(
        manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager.backend, "memory_bytes", lambda compiled: 1000)
    forgotten = []
    monkeypatch.setattr(manager.executor, "forget", forgotten.append)
    manager.cache.limit_bytes = 2500
    specs = [SO(regex=f"[a-z]{{{i}}}") for i in range(1, 5)]
    pinned = manager.request_grammar(specs[0])  # pinned until its matcher is open
    pinned.future.result(WAIT_S)
    for spec in specs[1:]:
        manager.compile(spec).result(WAIT_S)
    _until(lambda: len(manager.cache) == 2, "the cache to shrink")
    keys = [s.key() for s in specs]
    assert keys[0] in manager.cache and keys[3] in manager.cache  # pinned, and the newest
    assert forgotten == keys[1:3] and manager.cache.nbytes <= 2500
    assert pinned.poll()  # opened: unpinned, so it is the next to go
    manager.compile(SO(regex="[0-9]")).result(WAIT_S)
    _until(lambda: keys[0] not in manager.cache, "the unpinned entry to go")
    assert forgotten == [*keys[1:3], keys[0]]
    pinned.release()


def test_failed_compile_cached_at_its_key_size(manager: StructuredOutputManager) -> None:
    spec = SO(regex="(ab")
    with pytest.raises(GrammarError, match="invalid regex"):
        manager.compile(spec).result(WAIT_S)
    _until(lambda: manager.cache.nbytes == len("regex") + len("(ab"), "the entry's size")
    assert manager.compile(spec).exception(0) is not None  # answered from the cache


# ---------------------------------------------------------------------------------- worker
def test_worker_forget_abandons_its_compile(tokenizer) -> None:  # noqa: ANN001
    """The grammar worker keeps only what the engine caches: "forget" drops a grammar, and one
    still compiling (it timed out on the engine side) gives its slot back at once."""
    from photon.structured.worker import Worker

    gate = _gate()
    worker = Worker.__new__(Worker)
    worker.compiles, worker.pool, worker.matchers = {}, CompilePool(2, "test-worker"), {}

    class Backend:
        def compile(self, spec: SO) -> str:
            if spec.grammar is not None:
                assert gate.wait(WAIT_S)
            return spec.kind

    worker.backend = Backend()
    slow, cheap = SO(grammar=BIG), SO(regex="a")
    worker._handle(("compile", slow.key(), slow))
    worker._handle(("compile", cheap.key(), cheap))
    assert worker.compiles[cheap.key()].result(WAIT_S) == "regex"
    worker._handle(("forget", slow.key()))
    worker._handle(("forget", cheap.key()))
    assert worker.compiles == {}
    assert worker.pool.counts() == PoolCounts(0, 0, 1)
    gate.set()
    _until(lambda: worker.pool.counts().abandoned == 0, "the abandoned compile to end")
    worker.pool.shutdown()


def test_worker_exits_quietly_when_the_engine_closes(tokenizer, capfd) -> None:  # noqa: ANN001
    """The engine shuts down without reading the worker's "ready" (a server that got no grammar
    request): the worker sees its connection reset and must exit 0 without a traceback."""
    manager = _manager(tokenizer, worker="process")
    executor = manager.executor
    assert executor.conn.poll(120)  # the worker sent "ready"; it stays unread
    manager.shutdown()
    assert executor.proc.wait(WAIT_S) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err

