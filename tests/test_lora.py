"""LoRA adapters through the whole engine (CPU, float32): greedy tokens equal transformers +
peft (adapter merged) for a batch mixing adapters of different ranks and the base model; slots
and KV blocks all free after drains with aborts, preemption and n > 1, and no slot reloaded while
a step in flight reads it; prefix-cache isolation between adapters; errors."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from typing import Any

import pytest

from photon import LLM, LoRARequest, SamplingParams
from photon.config import ConfigError
from photon.engine.request import Request
from photon.engine.scheduler import Scheduler
from tests.hf_models import make_engine_model
from tests.lora_util import make_adapter, peft_greedy

MAX_NEW = 8
RANKS = (2, 4, 8)  # the third adapter uses rslora scaling
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("lora"))
    model = make_engine_model(os.path.join(root, "model"), "LlamaForCausalLM")
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(model, os.path.join(root, f"a{i}"), r,
                                                      seed=i, rslora=i == 2))
             for i, r in enumerate(RANKS)]
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (1, 20, 4, 11)]
    prompts += [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 25, 7, 14)]
    choice = [None, *loras] * 2  # base, a0, a1, a2, base, ...
    refs = {None: peft_greedy(model, None, prompts, MAX_NEW)}
    for lora in loras:
        refs[lora.lora_int_id] = peft_greedy(model, lora.lora_path, prompts, MAX_NEW)
    return dict(root=root, model=model, loras=loras, prompts=prompts, choice=choice, refs=refs)


def _expected(setup: dict, choice: list) -> list[list[int]]:
    refs = setup["refs"]
    return [refs[None if c is None else c.lora_int_id][i] for i, c in enumerate(choice)]


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=n)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_greedy_matches_peft(setup: dict, pipelined: bool) -> None:
    refs = setup["refs"]
    # Every adapter changes the outputs: a layer that ignored them would fail here.
    for lora in setup["loras"]:
        assert refs[lora.lora_int_id] != refs[None]
    llm = LLM(setup["model"], pipelined=pipelined, **ENGINE)
    outs = llm.generate(setup["prompts"], _params(), use_tqdm=False,
                        lora_request=setup["choice"])
    assert [o.outputs[0].token_ids for o in outs] == _expected(setup, setup["choice"])
    llm.engine.assert_drained()
    # The same batch with every prompt on adapter a1 (the prefix cache now holds each adapter's
    # blocks): still exact, and the slots were reused.
    a1 = setup["loras"][1]
    outs = llm.generate(setup["prompts"], _params(), use_tqdm=False, lora_request=a1)
    assert [o.outputs[0].token_ids for o in outs] == refs[a1.lora_int_id]
    llm.engine.assert_drained()


def _audit_slots(sched: Scheduler) -> list[int]:
    """Wrap plan(): a slot is (re)loaded only when every request holding it was admitted by
    that very plan (none with a step in flight reads it). Returns the loads' slots."""
    plan, loads = sched.plan, []

    def audited():
        out = plan()
        for load in out.plan.lora_loads:
            loads.append(load.slot)
            for req in sched.requests.values():
                if req.lora_slot == load.slot:
                    assert any(req is a for a in out.admitted), "slot reloaded while in use"
                    assert req.lora_request.lora_int_id == load.lora_int_id
        return out

    sched.plan = audited
    return loads


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_slots_and_blocks_free_after_aborts_preemption_and_n(setup: dict,
                                                             pipelined: bool) -> None:
    extra = [LoRARequest("a0-copy", 7, setup["loras"][0].lora_path)]
    loras = [*setup["loras"], *extra]  # 4 adapters for 2 slots
    llm = LLM(setup["model"], pipelined=pipelined, **{**ENGINE, "max_model_len": 64},
              num_gpu_blocks_override=20)
    engine = llm.engine
    loads = _audit_slots(engine.scheduler)
    ids = []
    for i, prompt in enumerate(setup["prompts"] * 2):
        lora = (None, *loras)[i % 5]
        ids.append(engine.add_request(prompt, _params(n=2), lora_request=lora))
    for step in range(400):
        if not engine.has_unfinished():
            break
        engine.step()
        if step in (3, 9, 15):
            engine.abort(ids[step // 3])  # while its rows are in flight
    assert not engine.has_unfinished()
    assert engine.scheduler.num_preemptions > 0  # the small KV cache preempted requests
    assert len(loads) > 2  # adapters were evicted and reloaded
    engine.assert_drained()


def _admissions(sched: Scheduler) -> list[Request]:
    """Wrap plan(): the requests in the order plans admit them."""
    plan, order = sched.plan, []

    def recorded():
        out = plan()
        order.extend(out.admitted)
        return out

    sched.plan = recorded
    return order


def _finish(engine: Any, on_step: Callable[[int], None] = lambda step: None) -> dict[str, list]:
    """Step until done; each request's final token ids by id."""
    final = {}
    for step in range(400):
        if not engine.has_unfinished():
            break
        on_step(step)
        final.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert not engine.has_unfinished()
    return final


def test_a_request_waiting_for_a_slot_lets_the_others_run(setup: dict) -> None:
    """One slot, held by a0: a request for a1 waits (skipped, in its place) while the base-model
    and a0 requests queued behind it run; a1 runs once a0's last request is released."""
    llm = LLM(setup["model"], **{**ENGINE, "max_loras": 1})
    engine, prompts, refs = llm.engine, setup["prompts"], setup["refs"]
    a0, a1 = setup["loras"][:2]
    order = _admissions(engine.scheduler)
    loads = _audit_slots(engine.scheduler)
    choice = [a0, a1, None, a0, None]
    ids = [engine.add_request(prompts[0], _params(), lora_request=a0)]
    engine.step()  # a0's request runs: the only slot holds a0
    ids += [engine.add_request(prompts[i], _params(), lora_request=choice[i]) for i in (1, 2, 3, 4)]
    final = _finish(engine)
    assert [r.request_id for r in order] == [ids[0], ids[2], ids[3], ids[4], ids[1]]
    assert len(loads) == 2  # a0, then a1 once a0's slot was idle
    assert [final[i] for i in ids] == _expected(setup, choice)
    assert refs[a1.lora_int_id][1] != refs[None][1]
    engine.assert_drained()


def test_resident_adapters_overtake_a_waiting_request_a_bounded_number_of_times(
        setup: dict) -> None:
    """A steady stream of a0 requests would keep the only slot busy forever: at most
    max_num_seqs of them are admitted past the waiting a1 request; then they wait too, the slot
    drains and a1 gets it (before the a2 request queued after it)."""
    llm = LLM(setup["model"], **{**ENGINE, "max_loras": 1})
    engine, prompts = llm.engine, setup["prompts"]
    a0, a1, a2 = setup["loras"]
    order = _admissions(engine.scheduler)
    ids = {engine.add_request(prompts[0], _params(), lora_request=a0): 0}
    engine.step()
    waiter = engine.add_request(prompts[1], _params(), lora_request=a1)
    later = engine.add_request(prompts[2], _params(), lora_request=a2)
    ids |= {waiter: 1, later: 2}
    lora_of = {waiter: a1, later: a2}

    def add_a0(step: int) -> None:  # a new a0 request every other step, for 60 steps
        if step < 60 and step % 2 == 0:
            i = 3 + step // 2 % 5
            ids[engine.add_request(prompts[i], _params(), lora_request=a0)] = i

    final = _finish(engine, add_a0)
    admitted = [r.request_id for r in order]
    past = admitted[:admitted.index(waiter)]
    assert len(past) - 1 == ENGINE["max_num_seqs"]  # a0 requests admitted past the waiter
    assert admitted.index(later) > admitted.index(waiter)
    refs = setup["refs"]
    for rid, i in ids.items():
        assert final[rid] == refs[lora_of.get(rid, a0).lora_int_id][i]
    engine.assert_drained()


def test_prefix_cache_is_per_adapter(setup: dict) -> None:
    llm = LLM(setup["model"], **ENGINE)
    prompt = setup["prompts"][1]  # 29 tokens: 7 full blocks
    a0, a1 = setup["loras"][:2]

    def run(lora: LoRARequest | None) -> tuple[list[int], int]:
        out = llm.generate([prompt], _params(), use_tqdm=False, lora_request=lora)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    assert run(None) == (setup["refs"][None][1], 0)
    assert run(a0) == (setup["refs"][a0.lora_int_id][1], 0)  # base blocks are no hit
    assert run(a1) == (setup["refs"][a1.lora_int_id][1], 0)  # nor a0's for a1
    tokens, cached = run(a0)
    assert tokens == setup["refs"][a0.lora_int_id][1] and cached == 28
    tokens, cached = run(None)
    assert tokens == setup["refs"][None][1] and cached == 28
    llm.engine.assert_drained()


def _write(path: str, config: dict | None = None, weights_from: str | None = None) -> str:
    import shutil

    if weights_from is not None:
        shutil.copytree(weights_from, path)
    else:
        os.makedirs(path)
    if config is not None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    return path


def test_bad_adapters_are_refused_and_the_engine_survives(setup: dict) -> None:
    root, a0 = setup["root"], setup["loras"][0]
    with open(os.path.join(a0.lora_path, "adapter_config.json")) as f:
        good = json.load(f)
    bad = {
        "not a directory": (os.path.join(root, "missing"), "is not a directory"),
        "no config": (_write(os.path.join(root, "e1")), "has no adapter_config.json"),
        "peft_type": (_write(os.path.join(root, "e2"), {**good, "peft_type": "IA3"},
                             a0.lora_path + "/."), "'peft_type' must be \"LORA\""),
        "rank": (_write(os.path.join(root, "e3"), {**good, "r": 64}, None),
                 "= 64 is above max_lora_rank (--max-lora-rank) = 8"),
        "target": (_write(os.path.join(root, "e4"), {**good, "target_modules": ["embed_tokens"]}),
                   "names unsupported modules ['embed_tokens']"),
        "no weights": (_write(os.path.join(root, "e5"), good),
                       "has no adapter_model.safetensors"),
    }
    llm = LLM(setup["model"], **ENGINE)
    for i, (path, message) in enumerate(bad.values()):
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([[5, 6, 7]], _params(), use_tqdm=False,
                         lora_request=LoRARequest("bad", 10 + i, path))
    out = llm.generate([setup["prompts"][0]], _params(), use_tqdm=False, lora_request=a0)
    assert out[0].outputs[0].token_ids == setup["refs"][a0.lora_int_id][0]
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a0'"):
        llm.generate([[5, 6, 7]], _params(), use_tqdm=False,
                     lora_request=LoRARequest("other", 1, setup["loras"][1].lora_path))
    llm.engine.assert_drained()


def test_lora_request_needs_enable_lora(setup: dict) -> None:
    llm = LLM(setup["model"], max_model_len=64)
    with pytest.raises(ValueError, match=r"without enable_lora \(--enable-lora\)"):
        llm.generate([[5, 6]], _params(), use_tqdm=False, lora_request=setup["loras"][0])


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_lora_rank=300), r"max_lora_rank \(--max-lora-rank\) must be an integer in \[1, 256\]"),
    (dict(max_loras=0), r"max_loras \(--max-loras\) must be a positive integer"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(--max-cpu-loras\) must be an "
                                         r"integer >= max_loras \(4\)"),
    (dict(lora_modules=["nopath"]), r"expected name=path, got 'nopath'"),
])
def test_engine_args_are_checked(setup: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM(setup["model"], enable_lora=True, **kwargs)


def test_lora_modules_are_checked_at_start(setup: dict) -> None:
    missing = os.path.join(setup["root"], "nowhere")
    with pytest.raises(ValueError, match="lora_path .* is not a directory"):
        LLM(setup["model"], enable_lora=True, lora_modules=[f"x={missing}"])


def test_piecewise_graphs_with_adapters_match_peft(setup: dict) -> None:
    """Steps run in piecewise graphs' pieces (uncaptured on CPU; every piece groups its tokens
    by slot itself): a batch mixing adapters and the base model still gives PEFT's tokens."""
    from photon.worker.piecewise_graphs import PiecewiseGraphs

    llm = LLM(setup["model"], **ENGINE)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model.model, runner.kv_caches, runner.backend,
                                       runner.kv_scales, 64, runner.device, runner.lora.batch)
    runner.piecewise.capture(eager=True)
    outs = llm.generate(setup["prompts"], _params(), use_tqdm=False,
                        lora_request=setup["choice"])
    assert [o.outputs[0].token_ids for o in outs] == _expected(setup, setup["choice"])
    assert runner.piecewise.replays > 10
    llm.engine.assert_drained()
