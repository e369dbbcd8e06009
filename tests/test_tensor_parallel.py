"""Tensor parallelism on CPU (gloo, two ranks): TP=2 gives the tokens TP=1 gives."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from photon.config import ConfigError
from photon.distributed.workers import TensorParallelError
from photon.engine_args import EngineArgs
from photon.sampling_params import SamplingParams
from photon.structured.params import StructuredOutputsParams
from tests.hf_models import make_engine_model
from tests.tp_util import MAX_STEPS, engine, run_all, tp_config

pytestmark = pytest.mark.timeout(300)

# Llama: 2 KV heads split over 2 ranks; Qwen3: 1 KV head, replicated on both ranks.
MODELS = {"LlamaForCausalLM": {"num_kv_heads": 2}, "Qwen3ForCausalLM": {"num_kv_heads": 1}}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_reference(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    arch = request.param
    path = make_engine_model(str(tmp_path_factory.mktemp(arch)), arch, **MODELS[arch])
    with engine(tp_config(path, 1)) as core:
        return path, run_all(core)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_tp2_tokens_equal_tp1(model_and_reference: tuple[str, dict], pipelined: bool) -> None:
    """Greedy and seeded sampled requests: the same tokens at TP=2 as at TP=1 (drained on both
    ranks)."""
    path, reference = model_and_reference
    assert len(set(map(tuple, reference.values()))) > 1  # varied outputs: the check can fail
    with engine(tp_config(path, 2, pipelined)) as core:
        assert core.workers is not None and len(core.workers.procs) == 1
        assert run_all(core) == reference


def test_abort_under_tp2(model_and_reference: tuple[str, dict]) -> None:
    """An aborted request frees its rows on every rank; the others keep their tokens."""
    path, reference = model_and_reference
    with engine(tp_config(path, 2)) as core:
        tokens = run_all(core, abort="g2")
    assert "g2" not in tokens or len(tokens["g2"]) < len(reference["g2"])
    assert {k: v for k, v in tokens.items() if k != "g2"} == \
        {k: v for k, v in reference.items() if k != "g2"}


def test_killed_worker_ends_the_engine(tmp_path) -> None:
    """A rank killed mid-run: the next step raises TensorParallelError naming it (no hang)."""
    path = make_engine_model(str(tmp_path / "m"), "LlamaForCausalLM")
    with engine(tp_config(path, 2, timeout_s=20.0)) as core:
        core.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        core.step()
        worker = core.workers.procs[0]
        worker.kill()
        worker.join(30)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(exit code -9\)"):
            for _ in range(MAX_STEPS):
                core.step()
    assert not worker.is_alive()


def test_structured_outputs_refused_under_tp_and_workers_exit_on_shutdown(tmp_path) -> None:
    """One TP=2 engine (a start of its worker) for both: a grammar request is refused, and the
    worker exits cleanly on shutdown."""
    path = make_engine_model(str(tmp_path / "m"), "LlamaForCausalLM")
    with engine(tp_config(path, 2)) as core:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            core.add_request([1, 2], params)
        procs = list(core.workers.procs)
    assert [p.exitcode for p in procs] == [0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_heads": 4, "num_kv_heads": 2, "tp": 3}, "must divide the model's num_attention_heads=4"),
    ({"num_heads": 4, "num_kv_heads": 4, "tp": 0}, "tensor_parallel_size must be a positive"),
])
def test_tp_config_errors(tmp_path, kwargs: dict, message: str) -> None:
    tp = kwargs.pop("tp")
    path = make_engine_model(str(tmp_path / "m"), "LlamaForCausalLM", **kwargs)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=path, tensor_parallel_size=tp).create_config()


def test_tp_with_speculative_decoding_refused(tmp_path) -> None:
    path = make_engine_model(str(tmp_path / "m"), "LlamaForCausalLM")
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineArgs(model=path, tensor_parallel_size=2, speculative_config=spec).create_config()


def test_tp_flag_alias() -> None:
    import argparse

    from photon.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["-tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4


def test_engine_core_process_tp2(model_and_reference: tuple[str, dict]) -> None:
    """`photon serve`'s engine-core process runs rank 0 and starts the worker itself: its
    streams carry the tokens of the in-process TP=1 engine."""
    from photon.engine.async_llm import AsyncLLM
    from tests.engine_pair import Case, run_cases
    from tests.tp_util import prompt_of, requests

    path, reference = model_and_reference
    remote = AsyncLLM(tp_config(path, 2))
    remote.start()
    try:
        cases = [Case(rid, prompt_of(rid), p) for rid, p in requests().items()]
        results = run_cases(remote, cases)
    finally:
        remote.shutdown()
    assert {rid: r.sequences[0].token_ids for rid, r in results.items()} == reference


@pytest.fixture
def local_ray() -> Iterator[Any]:
    """A local Ray instance of two CPUs (no dashboard: it starts faster), shut down after."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.parametrize("model_and_reference", ["LlamaForCausalLM"], indirect=True)
def test_ray_backend_tokens_equal_tp1_and_actors_reaped(model_and_reference: tuple[str, dict],
                                                         local_ray: Any) -> None:
    """--distributed-executor-backend ray: rank 1 is a Ray actor in a placement group; the
    tokens equal TP=1's (drained on both ranks); a killed actor ends the engine with
    TensorParallelError; shutdown kills the actors and removes the placement group."""
    path, reference = model_and_reference
    # The timeout bounds the join (a Ray actor importing torch on a loaded machine took over
    # 20 s once); the killed actor below is found at once (its collective fails, no timeout).
    with engine(tp_config(path, 2, timeout_s=60.0, backend="ray")) as core:
        launcher = core.workers.launcher
        assert core.workers.procs == [] and len(launcher.actors) == 1
        group_id = launcher.placement_group.id.hex()
        assert run_all(core) == reference
        actor = launcher.actors[0]
        core.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        core.step()
        local_ray.kill(actor)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(its Ray actor died\)"):
            for _ in range(MAX_STEPS):
                core.step()
    assert local_ray.util.placement_group_table()[group_id]["state"] == "REMOVED"
    with pytest.raises(local_ray.exceptions.RayActorError):
        local_ray.get(actor.run.remote(None, None, 0, ""), timeout=10)


def test_executor_backend_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="distributed_executor_backend must be one of mp, ray"):
        EngineArgs(distributed_executor_backend="spark").create_config()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"=ray needs the ray package: pip install ray"):
        EngineArgs(distributed_executor_backend="ray").create_config()
