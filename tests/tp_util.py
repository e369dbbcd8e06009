"""Helpers of the tensor-parallel tests: engines over tiny random checkpoints, run to the end."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from photon.config import EngineConfig
from photon.engine.engine_core import EngineCore
from photon.engine_args import EngineArgs
from photon.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42] * 20]
MAX_STEPS = 500  # every run here ends far sooner; a bound instead of a hang


def tp_config(path: str, tp: int, pipelined: bool = True, timeout_s: float | None = None,
              expert_parallel: bool = False, backend: str = "mp") -> EngineConfig:
    config = EngineArgs(model=path, tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4,
                        pipelined=pipelined, structured_outputs_worker="inline",
                        enable_expert_parallel=expert_parallel,
                        distributed_executor_backend=backend).create_config()
    if timeout_s is not None:
        parallel = dataclasses.replace(config.parallel, collective_timeout_s=timeout_s)
        config = dataclasses.replace(config, parallel=parallel)
    return config


@contextmanager
def engine(config: EngineConfig) -> Iterator[EngineCore]:
    core = EngineCore(config)
    try:
        yield core
    finally:
        core.shutdown()
        core.structured.shutdown()


def requests() -> dict[str, SamplingParams]:
    """Greedy requests, and seeded sampled ones (counter-based noise: equal on every rank)."""
    reqs = {f"g{i}": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            for i in range(len(PROMPTS))}
    reqs["s0"] = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
                                ignore_eos=True)
    reqs["s1"] = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=11,
                                ignore_eos=True, logprobs=2)
    return reqs


def prompt_of(request_id: str) -> list[int]:
    return PROMPTS[int(request_id[1:]) % len(PROMPTS)]


def run_all(core: EngineCore, abort: str | None = None) -> dict[str, list[int]]:
    """Every request of `requests()` to the end (`abort`: aborted after two steps); the drain
    is audited on every rank."""
    for rid, params in requests().items():
        core.add_request(prompt_of(rid), params, request_id=rid)
    tokens: dict[str, list[int]] = {}
    for step in range(MAX_STEPS):
        if not core.has_unfinished():
            break
        if step == 2 and abort is not None:
            core.abort(abort)
        for out in core.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert not core.has_unfinished(), "the engine did not finish its requests"
    core.assert_drained()
    return tokens
