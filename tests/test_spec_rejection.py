"""Verification of draft tokens: greedy identity, the sampler's own draw without drafts,
reproducibility, and the target distribution preserved (chi-square, 20k seeded draws)."""

from __future__ import annotations

import math

import pytest
import torch

from photon.core.sampling import derive_key
from photon.spec import rejection
from photon.spec.rejection import VerifyOutput, verify_torch
from photon.worker.sampler import Sampler, SamplingBatch
from tests.test_sampler import full, make_batch

V = 8
N = 20_000
Z_999 = 3.090232  # the standard normal's 0.999 quantile


def critical(df: int) -> float:
    """The chi-square 0.999 quantile (Wilson-Hilferty; within 1% for df >= 3)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_999 * math.sqrt(c)) ** 3


def chi2_vs(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against probabilities; a token with
    probability 0 must never occur."""
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept].double() * counts.sum()
    stat = ((counts[kept].double() - expected) ** 2 / expected).sum().item()
    return stat, int(kept.sum()) - 1


def chi2_two_sample(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    a, b = a.double(), b.double()
    kept = (a + b) > 0
    a, b = a[kept], b[kept]
    ka, kb = math.sqrt(b.sum() / a.sum()), math.sqrt(a.sum() / b.sum())
    return ((ka * a - kb * b) ** 2 / (a + b)).sum().item(), int(kept.sum()) - 1


def keys(n: int, offset: int = 0) -> torch.Tensor:
    return torch.tensor([derive_key(offset + i) for i in range(n)], dtype=torch.int64)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run(logits: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor,
        draft_probs: torch.Tensor | None, batch: SamplingBatch) -> VerifyOutput:
    out = verify_torch(logits, draft_ids, num_draft, draft_probs, batch)
    rows, width = logits.shape[:2]
    assert out.tokens.shape == (rows, width) and out.tokens.dtype == torch.int64
    assert out.num_accepted.shape == (rows,) and out.num_accepted.dtype == torch.int32
    j = torch.arange(width)[None, :]
    a = out.num_accepted.long()[:, None]
    assert (out.tokens[j > a] == -1).all() and (out.tokens[j <= a] >= 0).all()
    assert torch.equal(out.tokens[:, :-1][j[:, :-1] < a], draft_ids[j[:, :-1] < a])
    return out


# ----------------------------------------------------------------------------- greedy


def test_greedy_accepts_the_argmax_prefix_and_emits_the_argmax() -> None:
    rows, k = 64, 4
    logits = randn(rows, k + 1, 50, seed=1)
    argmax = logits.argmax(dim=2)
    draft = argmax[:, :k].clone()
    wrong = torch.rand(rows, k, generator=torch.Generator().manual_seed(2)) < 0.3
    draft[wrong] = (draft[wrong] + 1) % 50
    num_draft = torch.randint(0, k + 1, (rows,), generator=torch.Generator().manual_seed(3))
    batch = make_batch(rows, temperature=full(rows, 0.0))
    out = run(logits, draft, num_draft.int(), None, batch)
    for b in range(rows):
        a = 0
        while a < num_draft[b] and draft[b, a] == argmax[b, a]:
            a += 1
        assert out.num_accepted[b] == a
        assert out.tokens[b, :a + 1].tolist() == argmax[b, :a + 1].tolist()
    # Greedy rows in a batch with random rows (and draft probabilities) decide the same.
    mixed = make_batch(rows, temperature=torch.where(torch.arange(rows) % 2 == 0, 0.0, 1.0))
    probs = torch.softmax(randn(rows, k, 50, seed=4), dim=2)
    out_mixed = run(logits, draft, num_draft.int(), probs, mixed)
    assert torch.equal(out_mixed.tokens[::2], out.tokens[::2])


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}])
def test_without_drafts_the_sampler_token_is_drawn(filters: dict) -> None:
    rows, k = 32, 3
    logits = randn(rows, k + 1, 40, seed=5) * 2
    kw = {name: torch.full((rows,), value) for name, value in filters.items()}
    kw["top_k"] = kw["top_k"].int() if "top_k" in kw else torch.zeros(rows, dtype=torch.int32)
    batch = make_batch(rows, temperature=full(rows, 0.9), keys=keys(rows),
                       counters=torch.arange(rows) * 7, **kw)
    out = run(logits, torch.zeros(rows, k, dtype=torch.int64), torch.zeros(rows, dtype=torch.int32),
              None, batch)
    assert torch.equal(out.tokens[:, 0], Sampler(fused=False)(logits[:, 0], batch).token_ids)
    assert (out.num_accepted == 0).all()


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    rows, k = 24, 3
    logits = randn(rows, k + 1, 16, seed=6)
    draft = torch.randint(0, 16, (rows, k), generator=torch.Generator().manual_seed(7))
    probs = torch.softmax(randn(rows, k, 16, seed=8), dim=2)
    num_draft = torch.full((rows,), k, dtype=torch.int32)
    batch = make_batch(rows, temperature=full(rows, 1.0), keys=keys(rows),
                       counters=torch.arange(rows) + 100)
    out = run(logits, draft, num_draft, probs, batch)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(9))
    sub = make_batch(rows, temperature=full(rows, 1.0), keys=keys(rows)[perm],
                     counters=(torch.arange(rows) + 100)[perm])
    again = run(logits[perm], draft[perm], num_draft, probs[perm], sub)
    assert torch.equal(again.tokens, out.tokens[perm])
    assert torch.equal(again.num_accepted, out.num_accepted[perm])
    # Another counter is another draw.
    moved = make_batch(rows, temperature=full(rows, 1.0), keys=keys(rows),
                       counters=torch.arange(rows) + 101)
    assert not torch.equal(run(logits, draft, num_draft, probs, moved).tokens, out.tokens)


def test_meta_device_runs_without_reading_values() -> None:
    """Shapes alone decide the work: on the meta device (no data) any host sync would raise."""
    rows, k = 4, 3
    meta = {"device": "meta"}
    batch = make_batch(rows, "meta", temperature=torch.ones(rows), top_k=torch.full((rows,), 3),
                       top_p=torch.full((rows,), 0.9))
    out = verify_torch(torch.empty(rows, k + 1, 10, **meta),
                       torch.empty(rows, k, dtype=torch.int64, **meta),
                       torch.empty(rows, dtype=torch.int32, **meta),
                       torch.empty(rows, k, 10, **meta), batch)
    assert out.tokens.shape == (rows, k + 1) and out.num_accepted.shape == (rows,)


# ----------------------------------------------------------------------------- distribution


class Case:
    """N rows verifying K=2 drafts against fixed target distributions p_0, p_1, p_2."""

    def __init__(self, with_probs: bool, temperature: float = 1.0, top_k: int = 0) -> None:
        self.logits = randn(3, V, seed=10) * 1.5
        scaled = self.logits / temperature
        if top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[:, -1:], -math.inf)
        self.p = torch.softmax(scaled, dim=1)
        if with_probs:  # drafts drawn from q_j, a distribution near p_j but unlike it
            self.q = torch.softmax(self.logits[:2] + randn(2, V, seed=11), dim=1)
            gen = torch.Generator().manual_seed(12)
            self.draft = torch.stack([torch.multinomial(self.q[j], N, True, generator=gen)
                                      for j in range(2)], dim=1)
            self.draft_probs: torch.Tensor | None = self.q.expand(N, 2, V)
        else:  # a fixed proposal: q is one-hot at it
            self.draft = self.p[:2].argmax(dim=1)[None, :].expand(N, 2)
            self.draft_probs = None
        kw = {"top_k": torch.full((N,), top_k, dtype=torch.int32)} if top_k else {}
        self.batch = make_batch(N, temperature=full(N, temperature), keys=keys(N),
                                counters=torch.arange(N) % 997, **kw)

    def run(self) -> VerifyOutput:
        return verify_torch(self.logits.expand(N, 3, V), self.draft,
                            torch.full((N,), 2, dtype=torch.int32), self.draft_probs, self.batch)

    def stats(self) -> list[tuple[float, int]]:
        """chi-square of position 0's tokens against p_0, and of position 1's (rows that
        accepted x_0) against p_1."""
        out = self.run()
        first = torch.bincount(out.tokens[:, 0], minlength=V)
        second = torch.bincount(out.tokens[out.num_accepted >= 1, 1], minlength=V)
        assert second.sum() > N // 4  # enough rows reach position 1 to test it
        return [chi2_vs(first, self.p[0]), chi2_vs(second, self.p[1])]


CASES = [(True, 1.0, 0), (False, 1.0, 0), (True, 0.8, 5), (False, 0.8, 5)]


@pytest.mark.parametrize("with_probs,temperature,top_k", CASES)
def test_speculative_tokens_follow_the_target_distribution(with_probs: bool, temperature: float,
                                                           top_k: int) -> None:
    for stat, df in Case(with_probs, temperature, top_k).stats():
        assert stat < critical(df), (stat, df)


@pytest.mark.parametrize("with_probs", [True, False])
def test_speculative_tokens_match_non_speculative_sampling(with_probs: bool) -> None:
    case = Case(with_probs)
    spec = torch.bincount(case.run().tokens[:, 0], minlength=V)
    plain_batch = make_batch(N, temperature=full(N, 1.0), keys=keys(N, offset=N))
    plain = Sampler(fused=False)(case.logits[0].expand(N, V), plain_batch).token_ids
    stat, df = chi2_two_sample(spec, torch.bincount(plain, minlength=V))
    assert stat < critical(df), stat


@pytest.mark.parametrize("rule", ["q_over_p", "always"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_a_broken_acceptance_rule_fails_the_same_test(monkeypatch: pytest.MonkeyPatch, rule: str,
                                                      with_probs: bool) -> None:
    broken = {"q_over_p": lambda u, p, q: u * p < q,
              "always": lambda u, p, q: torch.ones_like(u, dtype=torch.bool)}[rule]
    monkeypatch.setattr(rejection, "accept_rule", broken)
    stat, df = Case(with_probs).stats()[0]
    assert stat > critical(df), stat
