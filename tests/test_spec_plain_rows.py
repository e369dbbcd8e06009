"""Speculation switched off (K_eff = 0) runs the plain step: a speculative request whose length
the host knows (no row in flight verifies drafts) is planned as a plain row, so the step has no
device-resolved positions and no speculative sampling, and its device ops are those of the
engine without speculation. When the switch comes back on,
the request's next row proposes drafts and the row after it verifies them. Greedy tokens equal
those without speculation, pipelined equals blocking (schedules included), for ngram and
draft_model, with the switch flapping, preemption and aborts; every run ends with a drain audit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from photon import LLM, SamplingParams
from photon.worker.decode_inputs import is_plain_decode
from tests.hf_models import make_engine_model
from tests.test_pipeline import Audit, Spec, run
from tests.test_spec_adaptive import ExpensiveFrom, K, _specs, attach_policy
from tests.test_spec_engine import _accepted, _llm, _mixed_specs, _prompts

ASSETS = Path(__file__).resolve().parent.parent / "photon" / "assets"


class Flapping:
    """A policy turning speculation on for `on` plans, then off for `off` plans, and so on (the
    pipelined and the blocking loop plan the same sequence of steps)."""

    def __init__(self, k: int, on: int, off: int) -> None:
        self.k, self.on, self.off = k, on, off
        self.choices: list[int] = []  # K_eff of every plan

    def choose(self, batch_size: int) -> int:
        k = self.k if len(self.choices) % (self.on + self.off) < self.on else 0
        self.choices.append(k)
        return k

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool,
                  tokens: int) -> None:
        pass


def _flapping(llm: LLM, k: int = K, on: int = 3, off: int = 4) -> Flapping:
    policy = Flapping(k, on, off)
    llm.engine.scheduler.spec_policy = policy
    return policy


def _draft_llm(target: str, draft: str | None, pipelined: bool, **kw: object) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": K, "adaptive": False}
    return LLM(**{"model": target, "dtype": "float32", "pipelined": pipelined,
                  "max_model_len": 128, "speculative_config": spec, **kw})


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _check_decode_steps(llm: LLM) -> list[bool]:
    """Check at every commit that the plan's `decode_step` (set while planning, what the
    adaptive switch measures) is its definition over the step's rows: every row queries one
    token or verifies the step's K_eff drafts, and no speculative request runs a plain row in a
    step with K_eff > 0. Returns the flags in commit order."""
    sched, flags = llm.engine.scheduler, []
    commit = sched.commit

    def checked(step, tokens, *args):  # noqa: ANN001, ANN002, ANN202
        k = step.spec_k
        want = all(r.num_tokens == r.spec + 1 and (r.spec == k or not q.spec_k)
                   for r, q in zip(step.plan.rows, step.requests))
        assert step.decode_step == want
        flags.append(want)
        return commit(step, tokens, *args)

    sched.commit = checked
    return flags


def _count_ops(llm: LLM) -> dict[int, Counter]:
    """Per step number, the aten ops of the runner's launch and sample of that step."""
    runner = llm.engine.runner
    per_step: dict[int, Counter] = {}
    launch, sample = runner.launch, runner.sample

    def counted_launch(prep):  # noqa: ANN001, ANN202
        with _Ops(per_step.setdefault(prep.step, Counter())):
            return launch(prep)

    def counted_sample(h):  # noqa: ANN001, ANN202
        with _Ops(per_step[h.step]):
            return sample(h)

    runner.launch, runner.sample = counted_launch, counted_sample
    return per_step


def test_a_step_with_speculation_off_is_the_plain_step() -> None:
    """With the switch off from the first plan, a speculating engine plans exactly the no
    speculation engine's schedule, in plain rows, and each step's device ops are exactly the
    plain step's (no device-length update: no step proposes)."""
    specs = [Spec(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
             for p, m in zip(_prompts(5), (12, 10, 11, 9))]
    base = _llm(True)
    base_ops = _count_ops(base)
    out_b, audit_b = run(base, specs)
    spec = _llm(True, K)
    choices = attach_policy(spec, ExpensiveFrom(1))
    spec_ops = _count_ops(spec)
    plans: list[list] = []
    plan = spec.engine.scheduler.plan

    def recording_plan():  # noqa: ANN202
        out = plan()
        plans.append(list(out.plan.rows))
        return out

    spec.engine.scheduler.plan = recording_plan
    kv, shrinks = spec.engine.scheduler.kv, []
    shrink = kv.shrink
    kv.shrink = lambda *a: (shrinks.append(a), shrink(*a))[1]
    out_s, audit_s = run(spec, specs)
    assert not shrinks  # only a row that verified drafts reserves past the bound
    assert out_s == out_b
    assert audit_s.schedule == audit_b.schedule
    assert {k for _, k in choices} == {0}
    assert all(s is None for rows in audit_s.row_spec for s in rows)  # no speculative row
    decode = [rows for rows in plans if rows and all(r.num_tokens == 1 for r in rows)]
    assert len(decode) >= 8 and all(is_plain_decode(rows) for rows in decode)
    assert set(spec_ops) == set(base_ops) and len(base_ops) >= 9
    for step, ops in base_ops.items():
        assert spec_ops[step] == ops, step
    assert spec.engine.runner.spec.counters.num_drafts == 0



def _kinds(audit: Audit, choices: list[int]) -> Counter:
    """Rows of requests after their first sampling row, by (speculative, the plan's K_eff > 0);
    every speculative row verifies its plan's K_eff, the switch's choice (also beside a prompt
    chunk)."""
    seen: set[str] = set()
    kinds: Counter = Counter()
    for rows, specs, k, choice in zip(audit.schedule, audit.row_spec, audit.spec_k, choices,
                                      strict=True):
        assert k == choice
        for (rid, _, _, sample), s in zip(rows, specs):
            assert s is None or s == k
            if rid in seen:
                kinds[s is not None, k > 0] += 1
            if sample:
                seen.add(rid)
    return kinds


def _assert_every_kind(kinds: Counter) -> None:
    assert kinds[False, False] > 0  # plain rows while the switch is off
    assert kinds[True, False] > 0  # off, with drafts verified by the row in flight: 1-token rows
    assert kinds[False, True] > 0  # back on: a plain row proposes the drafts ...
    assert kinds[True, True] > 0  # ... the next row verifies


def test_a_flapping_switch_with_ngram(on: int = 2, off: int = 2) -> None:
    specs = _specs()
    base, _ = run(_llm(False), specs)
    llm_p, llm_b = _llm(True, K), _llm(False, K)
    policy_p, policy_b = _flapping(llm_p, on=on, off=off), _flapping(llm_b, on=on, off=off)
    flags = _check_decode_steps(llm_p)
    pipelined, audit_p = run(llm_p, specs)
    assert True in flags and False in flags
    blocking, audit_b = run(llm_b, specs)
    assert pipelined == blocking == base
    assert audit_p.schedule == audit_b.schedule and audit_p.row_spec == audit_b.row_spec
    assert policy_p.choices == policy_b.choices
    _assert_every_kind(_kinds(audit_p, policy_p.choices))
    assert _accepted(llm_p) == _accepted(llm_b) > 0


def test_preemption_and_aborts_with_a_flapping_switch() -> None:
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=40,
              max_model_len=128)
    specs = _mixed_specs(17)
    base, _ = run(_llm(False, **kw), specs)
    llms = [_llm(pipelined, K, **kw) for pipelined in (True, False)]
    policies = [_flapping(llm) for llm in llms]
    flags = _check_decode_steps(llms[0])
    (first, audit), (blocking, audit_b) = [run(llm, specs) for llm in llms]
    assert True in flags and False in flags
    assert first == blocking
    assert audit.schedule == audit_b.schedule and audit.row_spec == audit_b.row_spec
    assert audit.core.scheduler.num_preemptions > 0 and audit.zombie_rows > 0
    assert first["r5"][0][1] == "abort" and first["r6"][0][1] == "abort"
    for rid in ("r3", "r4", "r7", "r8", "r9"):  # greedy, not aborted
        assert first[rid] == base[rid]
    _assert_every_kind(_kinds(audit, policies[0].choices))
    assert _accepted(llms[0]) > 0


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("target") / "model"
    return make_engine_model(str(path), "Qwen3ForCausalLM", hidden_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, seed=1)


def _spec_rows(audit: Audit) -> list[int]:
    """The drafts of every speculative row verifying some (zombie rows included)."""
    return [s for rows in audit.row_spec for s in rows if s]


def test_a_draft_equal_to_the_target_verifies_drafts_right_after_the_switch(
        target: str, pipelined: bool = True) -> None:
    """A draft model that is the target proposes the target's tokens, so every draft of every
    speculative row is accepted, the first rows after the switch comes back on included: the
    plain row before them proposed, and the draft's KV covers the plain rows' positions."""
    specs = _specs()
    base, _ = run(_draft_llm(target, None, True), specs)
    llm = _draft_llm(target, target, pipelined, block_size=4)
    policy = _flapping(llm)
    out, audit = run(llm, specs)
    assert out == base
    _assert_every_kind(_kinds(audit, policy.choices))
    drafts = _spec_rows(audit)
    counters = llm.engine.runner.spec.counters
    assert counters.num_drafts == len(drafts) > 0
    assert counters.num_accepted_tokens == sum(drafts)


def test_the_trained_pair_with_the_switch_off_then_on() -> None:
    """The committed pair, the batch shrinking 4 -> 1: off (plain rows), then on."""
    target, draft = str(ASSETS / "photon-tiny"), str(ASSETS / "photon-tiny-draft")
    specs = _specs()
    base, _ = run(_draft_llm(target, None, True), specs)
    llms = [_draft_llm(target, draft, pipelined) for pipelined in (True, False)]
    choices = [attach_policy(llm, ExpensiveFrom(2)) for llm in llms]
    (pipelined, audit_p), (blocking, audit_b) = [run(llm, specs) for llm in llms]
    assert pipelined == blocking == base
    assert audit_p.schedule == audit_b.schedule and audit_p.row_spec == audit_b.row_spec
    assert choices[0] == choices[1]
    kinds = _kinds(audit_p, [k for _, k in choices[0]])
    assert kinds[False, False] > 0 and kinds[False, True] > 0 and kinds[True, True] > 0
    assert kinds[True, False] == 0  # off from the first plan: no row in flight verified drafts
    assert llms[0].engine.runner.spec.counters.num_accepted_tokens > 0


def test_preemption_and_aborts_with_a_draft_model(target: str) -> None:
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=48)
    specs = _mixed_specs(17)
    base, _ = run(_draft_llm(target, None, True, **kw), specs)
    llms = [_draft_llm(target, target, pipelined, **kw) for pipelined in (True, False)]
    policies = [_flapping(llm) for llm in llms]
    flags = _check_decode_steps(llms[0])
    (first, audit), (blocking, audit_b) = [run(llm, specs) for llm in llms]
    assert True in flags and False in flags
    assert first == blocking
    assert audit.schedule == audit_b.schedule and audit.row_spec == audit_b.row_spec
    assert audit.core.scheduler.num_preemptions > 0 and audit.zombie_rows > 0
    for rid in ("r3", "r4", "r7", "r8", "r9"):
        assert first[rid] == base[rid]
    _assert_every_kind(_kinds(audit, policies[0].choices))
    counters = llms[0].engine.runner.spec.counters  # every speculative row got K drafts
    assert counters.num_draft_tokens == sum(_spec_rows(audit)) > 0
    assert counters.num_accepted_tokens > 0


def test_steps_with_speculation_off_replay_the_decode_graphs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With graphs (CPU stand-ins), every decode step of a switched-off engine replays a decode
    graph and resolves nothing on the device."""
    from tests.test_spec_graphs import _install_graphs

    specs = _specs()
    base, _ = run(_llm(False, dtype="float32"), specs)
    llm = _llm(True, K, dtype="float32", max_num_seqs=4)
    attach_policy(llm, ExpensiveFrom(1))
    graphs = _install_graphs(llm, monkeypatch)
    spec = llm.engine.runner.spec
    resolved: list[int] = []
    resolve = spec.resolve
    spec.resolve = lambda dev, num_rows, k: resolved.append(k) or resolve(dev, num_rows, k)
    out, audit = run(llm, specs)
    assert out == base
    decode_steps = sum(bool(rows) and all(n == 1 for _, _, n, _ in rows)
                       for rows in audit.schedule)
    assert graphs.decode.replays == decode_steps > 0
    assert graphs.spec_replays == 0 and resolved == []
