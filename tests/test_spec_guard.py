"""The adaptive switch's realized-rate guard (photon.spec.guard): per batch-size bucket, a window
of plain steps, a window with speculation allowed, then the verdict held (longer while it
repeats); every committed step counts, mixed ones included."""

from __future__ import annotations

import pytest

from photon import SamplingParams
from photon.spec.adaptive import AdaptiveSpec
from photon.spec.guard import Phase, RealizedGuard
from photon.spec.stats import SpecDecodingStats
from tests.test_spec_adaptive import ExpensiveFrom


def _feed(guard: RealizedGuard, bucket: int, steps: int, tokens: int, seconds: float) -> None:
    for _ in range(steps):
        guard.observe(bucket, tokens, seconds)


def test_a_new_bucket_measures_plain_steps_then_allows_speculation() -> None:
    guard = RealizedGuard(window=4, first_hold=8)
    assert not guard.allows(64) and guard.verdict(64) is None
    _feed(guard, 64, 4, 64, 1.0)  # the plain window
    assert guard.allows(64) and guard.verdict(64) is None  # the speculating window
    _feed(guard, 16, 1, 16, 1.0)
    assert not guard.allows(16)  # buckets are independent: 16 measures its plain steps
    # asked about 256 requests whose steps run in bucket 64 (a full KV cache): 64 decides
    assert guard.allows(256) and not guard.allows(8)


def test_the_verdict_follows_the_realized_rates_and_skips_steps_in_flight() -> None:
    guard = RealizedGuard(window=4, first_hold=8, in_flight=1)
    _feed(guard, 64, 4, 64, 1.0)  # plain: 64 tokens/s
    # the first commit after the switch is a step planned plain: not counted (else 1e9 tok/s)
    guard.observe(64, 10**9, 1.0)
    _feed(guard, 64, 4, 128, 3.0)  # speculating: 43 tokens/s (mixed steps cost it)
    assert guard.verdict(64) is False and not guard.allows(64)
    assert guard.verdicts() == {64: False}
    guard2 = RealizedGuard(window=4, first_hold=8, in_flight=1)
    _feed(guard2, 64, 4, 64, 1.0)
    guard2.observe(64, 0, 1.0)
    _feed(guard2, 64, 4, 128, 1.5)  # 85 tokens/s
    assert guard2.verdict(64) is True and guard2.allows(64)


def test_the_hold_doubles_while_the_verdict_repeats_and_resets_when_it_changes() -> None:
    guard = RealizedGuard(window=2, first_hold=4, max_hold=16, in_flight=0)
    holds = []  # narrow verdicts (10%)
    for spec_seconds in (1.1, 1.1, 1.1, 1.1, 0.9):  # four vetoes, then speculation pays
        _feed(guard, 8, 2, 8, 1.0)  # PLAIN
        _feed(guard, 8, 2, 8, spec_seconds)  # SPEC
        state = guard._buckets[8]
        assert state.phase is Phase.HOLD
        holds.append((state.allow, state.hold))
        _feed(guard, 8, state.hold, 8, 1.0)
        assert state.phase is Phase.PLAIN  # measured again after the hold
    assert holds == [(False, 4), (False, 8), (False, 16), (False, 16), (True, 4)]
    # a clear verdict (here 2x) holds the longest at once
    _feed(guard, 8, 2, 8, 1.0)
    _feed(guard, 8, 2, 8, 0.5)
    assert (guard._buckets[8].allow, guard._buckets[8].hold) == (True, 16)


def _drive(policy: AdaptiveSpec, steps: int, spec_mixed_seconds: float) -> list[int]:
    """64-row steps on a simulated clock (the cost model, `ExpensiveFrom(1 << 30)`, favours
    speculating on every decode step): every 4th step is a mixed step of 64 tokens, which costs
    1 s plain and `spec_mixed_seconds` while the switch speculates (the refills its staggered
    finishes bring: no decode step shows them); a decode step costs 1 s and emits 64 tokens
    plain, 64 * E'(1) at K_eff = 1 (every row drafts, half the drafts are accepted)."""
    now, stats = [0.0], policy.acceptance
    policy.clock = lambda: now[0]
    chosen = []
    speculating = False
    for i in range(steps):
        k = policy.choose(64)
        mixed = i % 4 == 3
        speculating = k > 0 or (speculating and mixed)
        if mixed:
            now[0] += spec_mixed_seconds if speculating else 1.0
            policy.committed(i, 64, 0, False, 64)
        else:
            now[0] += 1.0
            if k:
                stats.num_drafts += 64
                stats.num_accepted_tokens_per_pos[0] += 32
            policy.committed(i, 64, k, True, round(64 * policy.expected_tokens(k)))
        chosen.append(0 if mixed else k)
    return chosen


def _stats() -> SpecDecodingStats:
    return SpecDecodingStats(1000, 1000, 500, [500])  # E(1) = 1.5


def test_the_guard_vetoes_speculation_whose_mixed_steps_cost_more_than_it_gains() -> None:
    """Decode steps gain 1.5x speculating; mixed steps cost 4x while it speculates: per 4 steps
    plain emits 256 tokens in 4 s, speculating 352 in 7 s. The cost model alone speculates on
    every decode step; with the guard the switch stops after its probe and stays off (but for
    one more probe)."""
    alone = _drive(AdaptiveSpec(1, _stats(), ExpensiveFrom(1 << 30)), 800, spec_mixed_seconds=4.0)
    assert sum(k > 0 for k in alone) == 600  # every decode step
    guarded = _drive(AdaptiveSpec(1, _stats(), ExpensiveFrom(1 << 30), guard=RealizedGuard()), 800,
                     spec_mixed_seconds=4.0)
    assert sum(k > 0 for k in guarded) < 100
    assert set(guarded[100:300]) == {0}  # the held veto


def test_the_guard_keeps_speculation_that_pays() -> None:
    """The same decode steps with mixed steps costing 1.5 s speculating: 352 tokens in 4.5 s
    against 256 in 4 s. The switch speculates on all but the probes' plain steps."""
    guarded = _drive(AdaptiveSpec(1, _stats(), ExpensiveFrom(1 << 30), guard=RealizedGuard()), 800,
                     spec_mixed_seconds=1.5)
    decode = [k for i, k in enumerate(guarded) if i % 4 != 3]
    assert sum(k == 0 for k in decode) < 100  # two plain windows of 48 steps, at most
    assert set(guarded[100:300]) == {1} | {0} and guarded[100:300].count(1) == 150


@pytest.mark.parametrize("pipelined", [True, False])
def test_an_engine_speculates_after_its_plain_window_with_the_tokens_of_none(
        pipelined: bool) -> None:
    """A speculative engine (ngram, a cost model that always favours speculating) with the
    guard: the first 48 committed steps of its bucket are plain, the plan after the 48th
    commit (plan(t + 2) follows commit(t)) may speculate, and the greedy tokens are those of
    the engine without speculation, pipelined and blocking alike."""
    from tests.test_spec_engine import _llm, _prompts

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = _prompts(0)[0]
    llm = _llm(pipelined, 3)
    sched = llm.engine.scheduler
    policy = AdaptiveSpec(3, llm.engine.runner.spec.counters, ExpensiveFrom(1 << 30),
                          guard=RealizedGuard())
    choices: list[int] = []
    choose = policy.choose

    def record(batch_size: int) -> int:
        choices.append(choose(batch_size))
        return choices[-1]

    policy.choose = record  # type: ignore[method-assign]
    sched.spec_policy = policy
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    want = _llm(pipelined).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    first = next(i for i, k in enumerate(choices) if k)
    assert first == 50 and set(choices[:first]) == {0}
    assert llm.engine.runner.spec.counters.num_drafts > 0
