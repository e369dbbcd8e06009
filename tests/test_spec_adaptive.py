"""The adaptive switch: each step verifies K_eff in 0..K drafts, chosen on the host from the
measured acceptance and a step-time cost model. With a cost model that makes speculation
expensive from a batch size on, large batches run K_eff = 0 (plain rows) and greedy tokens stay
those of the engine without speculation; speculation comes back when the batch shrinks;
pipelined equals blocking with switching."""

from __future__ import annotations

import pytest

from photon import LLM, SamplingParams
from photon.spec.adaptive import AdaptiveSpec, MeasuredCostModel, bucket
from tests.test_pipeline import Spec, run
from tests.test_spec_engine import _accepted, _llm, _prompts

K = 3


class ExpensiveFrom:
    """Speculation costs 10x a plain step from `n` rows on, half a plain step below."""

    def __init__(self, n: int) -> None:
        self.n = n

    def step_time(self, batch_size: int, k: int) -> float:
        return 1.0 if k == 0 else (10.0 if batch_size >= self.n else 0.5)

    def knows_plain_step(self) -> bool:
        return True

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        pass


def _adaptive(pipelined: bool, n: int) -> tuple[LLM, list[tuple[int, int]]]:
    """An engine whose policy uses ExpensiveFrom(n); the (batch size, K_eff) of every choice."""
    llm = _llm(pipelined, K)
    return llm, attach_policy(llm, ExpensiveFrom(n))


def attach_policy(llm: LLM, cost: object, k: int = K) -> list[tuple[int, int]]:
    """Give `llm`'s scheduler an AdaptiveSpec with the cost model `cost`; return the list the
    (batch size, K_eff) of every choice (one per plan) goes to."""
    sched = llm.engine.scheduler
    policy = AdaptiveSpec(k, llm.engine.runner.spec.counters, cost)
    choices: list[tuple[int, int]] = []
    choose = policy.choose

    def record(batch_size: int) -> int:
        k = choose(batch_size)
        choices.append((batch_size, k))
        return k

    policy.choose = record
    sched.spec_policy = policy
    return choices


def _specs() -> list[Spec]:
    """Four requests of different lengths: the batch shrinks from 4 to 1."""
    return [Spec(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            for p, m in zip(_prompts(5), (40, 10, 14, 18))]


def test_large_batches_switch_speculation_off_and_small_ones_back_on() -> None:
    specs = _specs()
    base, _ = run(_llm(False), specs)
    llm_p, choices_p = _adaptive(True, 2)
    llm_b, choices_b = _adaptive(False, 2)
    pipelined, audit_p = run(llm_p, specs)
    blocking, audit_b = run(llm_b, specs)
    assert pipelined == base and blocking == base  # greedy: identical tokens
    assert pipelined == blocking and audit_p.schedule == audit_b.schedule
    assert choices_p == choices_b
    assert all(k == (0 if b >= 2 else K) for b, k in choices_p)
    big = [i for i, (b, _) in enumerate(choices_p) if b >= 2]
    small = [i for i, (b, _) in enumerate(choices_p) if b == 1]
    assert big and small and max(big) < min(small)  # off while 4..2 run, then back on
    assert _accepted(llm_p) == _accepted(llm_b) > 0
    # Rows planned while off verify no draft: every row of a request that speculates queries
    # one token, and is a plain row (the switch is off from the first plan on).
    widths = {n for rows in audit_p.schedule[:len(big)] for _, _, n, s in rows if s}
    assert K + 1 not in widths
    assert all(s is None for rows in audit_p.row_spec[:len(big)] for s in rows)


def test_an_expensive_cost_everywhere_keeps_speculation_off() -> None:
    specs = _specs()
    base, _ = run(_llm(False), specs)
    llm, choices = _adaptive(True, 1)
    proposer = llm.engine.runner.spec.proposer
    calls: list[int] = []
    propose = proposer.propose
    proposer.propose = lambda ctx: calls.append(1) or propose(ctx)
    out, audit = run(llm, specs)
    assert out == base
    # Steps verifying no drafts propose none for the next step: the proposer never runs
    # (the first prefill step's choice is 0 too: its batch counts the waiting requests).
    assert calls == []
    assert {k for _, k in choices} == {0} and _accepted(llm) == 0
    assert llm.engine.runner.spec.counters.num_drafts == 0
    assert all(r.spec_k == K for r in audit.requests.values())  # requests that speculate ...
    assert all(s is None for rows in audit.row_spec for s in rows)  # ... in plain rows only


def test_measured_cost_model_predicts_from_its_prior_then_measurements() -> None:
    model = MeasuredCostModel(saturation_tokens=64, window=3)
    assert model.step_time(8, 3) == 1.0 and model.step_time(64, 3) == 4.0  # the roofline prior
    model.observe(8, 3, 0.02)
    assert model.step_time(7, 3) == 0.02 and not model.knows_plain_step()
    assert model.step_time(7, 0) == 1.0  # a speculative step is no reference for the plain one
    model.observe(8, 0, 0.01)  # a plain step: the reference of every unmeasured entry
    assert model.knows_plain_step() and model.step_time(8, 7) == pytest.approx(0.01)
    assert model.step_time(64, 3) == pytest.approx(0.01 * 4)  # another bucket: the prior's ratio
    model.observe(64, 0, 0.05)
    assert model.step_time(128, 1) == pytest.approx(0.05 * 4)  # the nearest bucket's plain step
    for t in (0.04, 0.5):  # the median of the last `window`: one long step does not move it
        model.observe(8, 3, t)
    assert model.step_time(8, 3) == 0.04
    for t in (0.5, 0.5):
        model.observe(8, 3, t)
    assert model.step_time(8, 3) == 0.5  # 0.02 and 0.04 left the window
    assert bucket(1) == 1 and bucket(5) == 8 and bucket(8) == 8


def test_the_policy_weighs_acceptance_against_step_time() -> None:
    from photon.spec.stats import SpecDecodingStats

    stats = SpecDecodingStats(100, 300, 150, [80, 50, 20])
    policy = AdaptiveSpec(3, stats, ExpensiveFrom(1 << 30))
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(3) == pytest.approx(
        1 + sum((a + 8 * 0.6 ** (j + 1)) / 108 for j, a in enumerate([80, 50, 20])))
    assert policy.choose(4) == 3  # at half a plain step's cost any drafts pay
    policy.cost = MeasuredCostModel(saturation_tokens=4)  # the roofline prior: saturated
    assert policy.choose(1) == 0  # no plain step measured yet
    policy.cost.observe(1, 0, 1.0)
    assert policy.choose(1) == 3 and policy.choose(64) == 0


@pytest.mark.parametrize("pipelined", [True, False])
def test_steps_carrying_a_prompt_chunk_verify_drafts(pipelined: bool) -> None:
    """With the switch on (speculation always pays here), a step that carries a prompt chunk
    (an admission, a chunked prompt) verifies the switch's K beside it, like a decode step (it
    runs in piecewise graphs, where the K + 1 positions of a row cost little more than one, and
    its rows' drafts are proposed anyway). Greedy tokens equal the engine without
    speculation."""
    kw = dict(max_num_seqs=2, max_num_batched_tokens=12)
    specs = _specs()  # 4 requests, 2 at a time: refills while others decode
    base, _ = run(_llm(pipelined, **kw), specs)
    llm = _llm(pipelined, K, **kw)
    attach_policy(llm, ExpensiveFrom(1 << 30))
    out, audit = run(llm, specs)
    assert out == base
    chunks = [i for i, rows in enumerate(audit.schedule)
              if any(n > 1 and spec is None for (_, _, n, _), spec in zip(rows, audit.row_spec[i]))]
    assert chunks and all(s in (None, 0, K) for i in chunks for s in audit.row_spec[i])
    assert any(len(audit.schedule[i]) > 1 for i in chunks)  # chunks beside decoding requests
    assert any(K in audit.row_spec[i] for i in chunks)  # beside a chunk, rows verify K drafts
    assert all(audit.spec_k[i] == K for i in chunks)
    assert _accepted(llm) > 0


class _Times:
    """Fixed step times per K_eff."""

    def __init__(self, times: dict[int, float]) -> None:
        self.times = times

    def step_time(self, batch_size: int, k: int) -> float:
        return self.times[k]

    def knows_plain_step(self) -> bool:
        return True

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        pass


def test_speculation_needs_a_margin_over_the_plain_step() -> None:
    """K_eff > 0 only when its predicted rate beats K_eff = 0's by more than the margin: a
    K_eff the model rates about even (the case that lost in practice, its side costs left out)
    keeps the plain step."""
    from photon.spec.stats import SpecDecodingStats

    stats = SpecDecodingStats(1000, 1000, 900, [900])  # draft 1 accepted 90% of the time
    even = _Times({0: 1.0, 1: 1.88})  # E(1) = 1.9: 1.9 / 1.88 = 1.01x the plain rate
    assert AdaptiveSpec(1, stats, even).choose(64) == 0
    assert AdaptiveSpec(1, stats, even, margin=0.0).choose(64) == 1
    clear = _Times({0: 1.0, 1: 1.5})  # 1.27x
    assert AdaptiveSpec(1, stats, clear).choose(64) == 1


def _drive(policy: AdaptiveSpec, cost: dict[int, float], steps: int,
           slow: frozenset[int] = frozenset()) -> list[int]:
    """Run `policy` over `steps` decode steps of 64 rows on a simulated clock, step i taking
    `cost[K_eff]` seconds (10 s for the steps in `slow`: a pause of the host); the K_eff of
    each step."""
    now = [0.0]
    policy.clock = lambda: now[0]
    chosen = []
    for i in range(steps):
        k = policy.choose(64)
        now[0] += 10.0 if i in slow else cost[k]
        policy.committed(i, 64, k, True, 64)
        chosen.append(k)
    return chosen


def test_the_switch_measures_the_plain_step_first_and_a_pause_does_not_flip_it() -> None:
    """A host-bound engine: every speculative step costs 1.7-2.6x a plain one, more than its
    acceptance pays for. The switch measures the plain step, tries each K_eff once (the prior
    prices them near a plain step), then stays at 0; a single 10 s step (a garbage collection)
    among the plain ones does not make it speculate again."""
    from photon.spec.stats import SpecDecodingStats

    stats = SpecDecodingStats(1000, 3000, 1300, [650, 400, 250])  # E(1..3) = 1.65, 2.05, 2.3
    cost = {0: 1.0, 1: 1.7, 2: 2.2, 3: 2.6}
    chosen = _drive(AdaptiveSpec(3, stats), cost, 60, slow=frozenset({40}))
    assert chosen[:2] == [0, 0]  # a plain step measured first (the first is not timed)
    explored = [i for i, k in enumerate(chosen) if k]
    assert explored and max(explored) < 30  # each K_eff tried (its steps timed), then 0
    assert set(chosen[30:]) == {0}


def test_rows_without_drafts_count_in_the_expected_tokens() -> None:
    """An ngram row without a match verifies nothing and emits one token: with half the
    speculative rows of the committed steps having drafts, E'(k) - 1 is half of E(k) - 1."""
    from photon.spec.stats import SpecDecodingStats

    stats = SpecDecodingStats(0, 0, 0, [0])
    policy = AdaptiveSpec(1, stats, _Times({0: 1.0, 1: 1.0}))
    full = policy.expected_tokens(1) - 1  # the prior only: 0.6
    policy.committed(0, 992, 1, True, 992)  # 992 speculative rows, 496 of them with a draft
    stats.num_drafts, stats.num_accepted_tokens_per_pos = 496, [int(496 * 0.6)]
    assert policy.expected_tokens(1) - 1 == pytest.approx(full / 2, rel=0.01)


def test_the_switch_is_asked_about_the_batch_the_scheduler_may_run() -> None:
    """With fewer running places than requests (`max_running`, as `photon bench spec` sets it),
    the batch the switch is asked about is at most that: the rows of the steps it times. Asked
    about the whole queue, it chose for batch sizes whose steps it never measured."""
    llm = _llm(True, K, max_num_seqs=4)
    llm.engine.scheduler.max_running = 1
    choices = attach_policy(llm, ExpensiveFrom(1 << 30))
    out, _ = run(llm, _specs())
    assert out == run(_llm(False), _specs())[0]
    assert {b for b, _ in choices} <= {0, 1} and K in {k for _, k in choices}


def test_a_batch_whose_steps_are_not_timed_is_priced_from_the_nearest_plain_step() -> None:
    """Asked about 64 requests while the steps run 16 rows (the KV cache holds no more), the
    switch prices bucket 64 from bucket 16's plain step: it speculates where that pays."""
    from photon.spec.stats import SpecDecodingStats

    policy = AdaptiveSpec(3, SpecDecodingStats(1000, 3000, 2400, [900, 800, 700]))
    policy.cost.observe(16, 0, 1.0)
    assert policy.choose(64) == 3  # E(3) = 3.4 at the plain step's cost (unsaturated)
