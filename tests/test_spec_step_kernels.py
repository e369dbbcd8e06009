"""The speculative step's bookkeeping kernels (photon.kernels.spec_step) against SpecDecoder's
torch path, on staged inputs: every field they write must come out identical.

Without CUDA they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); on CUDA
SpecDecoder picks them by itself.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from photon.core.inputs import StepInputs
from photon.spec.config import SpeculativeConfig
from photon.worker.spec_step import NO_DRAFT, SpecDecoder
from tests.test_kernels import CUDA, DEVICE
from tests.test_kernels import pytestmark as kernel_marks
from tests.test_sampler import make_batch
from tests.test_spec_rejection import keys, randn

pytestmark = kernel_marks

MAX_MODEL_LEN, POOL_WIDTH, BLOCK_SIZE, TABLE_WIDTH, NUM_REQS = 40, 44, 4, 9, 12


def decoder(k: int, fused: bool) -> SpecDecoder:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                               prompt_lookup_max=2)
    return SpecDecoder(config, MAX_MODEL_LEN, NUM_REQS, POOL_WIDTH, BLOCK_SIZE,
                       torch.device(DEVICE), fused=fused)


def staged(k: int, seed: int) -> tuple[StepInputs[torch.Tensor], torch.Tensor, int]:
    """(inputs, dev_len, staged rows): rows alternately plain (1 token) and speculative (k + 1),
    in a random order of requests; every other field random garbage."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = 7
    spec = torch.tensor([r % 2 == 0 for r in range(num_rows)])
    widths = torch.where(spec, k + 1, 1)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), widths.cumsum(0)])
    tokens, vrows = int(qsl[-1]), int(widths.sum())
    reqs = torch.randperm(NUM_REQS, generator=gen)[:num_rows]
    # Lengths from 1 to past max_model_len, the pool row and the block table (zombie rows).
    dev_len = torch.randint(1, POOL_WIDTH + 6, (NUM_REQS,), generator=gen)
    dev_len[reqs[0]], dev_len[reqs[2]] = 1, TABLE_WIDTH * BLOCK_SIZE

    def rand(n: int) -> torch.Tensor:
        return torch.randint(0, 1000, (n,), generator=gen)

    sizes = {"positions": tokens, "pool_idx": tokens, "slot_mapping": tokens,
             "seq_lens": num_rows, "block_tables": num_rows * TABLE_WIDTH}
    values = {f.name: rand(sizes.get(f.name, vrows)) for f in fields(StepInputs)}
    values.update(query_start_loc=qsl, spec_rows=spec.nonzero()[:, 0],
                  spec_reqs=reqs[spec], spec_vrows=qsl[:-1][spec])
    on = {name: t.to(DEVICE) for name, t in values.items()}
    return StepInputs(**on), dev_len.to(DEVICE), num_rows


def clone(dev: StepInputs[torch.Tensor]) -> StepInputs[torch.Tensor]:
    return StepInputs(**{f.name: getattr(dev, f.name).clone() for f in fields(StepInputs)})


def assert_same(a: StepInputs[torch.Tensor], b: StepInputs[torch.Tensor]) -> None:
    for f in fields(StepInputs):
        assert torch.equal(getattr(a, f.name).cpu(), getattr(b, f.name).cpu()), f.name


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_resolve_kernel_matches_torch(k: int) -> None:
    for seed in range(3):
        dev, dev_len, num_rows = staged(k, seed)
        ref, fused = clone(dev), clone(dev)
        for spec, out in ((decoder(k, False), ref), (decoder(k, True), fused)):
            spec.dev_len.copy_(dev_len)
            for k_eff in range(1, k + 1) if k > 1 else [k]:
                spec.resolve(out, num_rows, k_eff)
        assert_same(fused, ref)
        assert not torch.equal(ref.positions.cpu(), dev.positions.cpu())  # it wrote something


def test_resolve_without_speculative_rows_writes_nothing() -> None:
    dev, dev_len, num_rows = staged(2, 0)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    dev.spec_rows, dev.spec_reqs, dev.spec_vrows = none, none, none
    out = clone(dev)
    decoder(2, True).resolve(out, num_rows, 2)
    assert_same(out, dev)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_picks_the_resolve_kernel_without_a_sync() -> None:
    dev, dev_len, num_rows = staged(3, 1)
    ref = clone(dev)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    spec = SpecDecoder(config, MAX_MODEL_LEN, NUM_REQS, POOL_WIDTH, BLOCK_SIZE,
                       torch.device("cuda"))
    assert spec.fused
    spec.dev_len.copy_(dev_len)
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec.resolve(dev, num_rows, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch_path = decoder(3, False)
    torch_path.dev_len.copy_(dev_len)
    torch_path.resolve(ref, num_rows, 3)
    assert_same(dev, ref)


# ---- verification, advance and proposals: a step of speculative rows only ------------------

VOCAB, NUM_SPEC = 29, 5


def spec_only(k: int, seed: int) -> tuple[StepInputs[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(inputs resolved by the torch path, dev_len, token pool) of a step whose NUM_SPEC rows
    are all speculative (k + 1 sampling rows each, in row order), live requests (lengths leave
    room for k more tokens); the pool holds short repeating patterns (n-gram matches)."""
    gen = torch.Generator().manual_seed(seed)
    widths = torch.full((NUM_SPEC,), k + 1)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), widths.cumsum(0)])
    n = int(qsl[-1])
    reqs = torch.randperm(NUM_REQS, generator=gen)[:NUM_SPEC]
    dev_len = torch.randint(1, MAX_MODEL_LEN - k, (NUM_REQS,), generator=gen)
    values = {f.name: torch.zeros(n, dtype=torch.int64) for f in fields(StepInputs)}
    values.update(query_start_loc=qsl, spec_rows=torch.arange(NUM_SPEC), spec_reqs=reqs,
                  spec_vrows=qsl[:-1], pool_rows=reqs.repeat_interleave(k + 1),
                  block_tables=torch.randint(1, 50, (NUM_SPEC * TABLE_WIDTH,), generator=gen),
                  seq_lens=torch.zeros(NUM_SPEC, dtype=torch.int64))
    dev = StepInputs(**{name: t.to(DEVICE) for name, t in values.items()})
    spec = decoder(k, False)
    spec.dev_len.copy_(dev_len)
    spec.resolve(dev, NUM_SPEC, k)
    pool = torch.randint(0, 4, (NUM_REQS, POOL_WIDTH), generator=gen, dtype=torch.int32)
    return dev, dev_len.to(DEVICE), pool.to(DEVICE)


def verified_tokens(k: int, seed: int) -> torch.Tensor:
    """[NUM_SPEC * (k+1)] tokens as verification leaves them: each row's emitted tokens (an
    accepted prefix and one more), then -1 up to its drafts, then NO_DRAFT."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(NUM_SPEC):
        drafts = int(torch.randint(0, k + 1, (1,), generator=gen))
        emitted = int(torch.randint(1, drafts + 2, (1,), generator=gen))
        row = [int(t) for t in torch.randint(0, VOCAB, (emitted,), generator=gen)]
        out.append(row + [-1] * (drafts + 1 - emitted) + [NO_DRAFT] * (k - drafts))
    return torch.tensor([t for row in out for t in row], device=DEVICE)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_advance_kernel_matches_torch(k: int) -> None:
    for seed in range(3):
        dev, dev_len, pool = spec_only(k, seed)
        tokens = verified_tokens(k, seed)
        results = []
        for fused in (False, True):
            spec, p = decoder(k, fused), pool.clone()
            spec.dev_len.copy_(dev_len)
            spec.advance(tokens, dev, p, k, only_spec=True)
            results.append((p.cpu(), spec.dev_len.cpu()))
        (ref_pool, ref_len), (pool_f, len_f) = results
        assert torch.equal(pool_f, ref_pool) and torch.equal(len_f, ref_len)
        assert not torch.equal(ref_pool, pool.cpu())  # it wrote tokens
        assert (ref_len[dev.spec_reqs.cpu()] > dev_len.cpu()[dev.spec_reqs.cpu()]).all()


@pytest.mark.parametrize("k", [1, 3])
def test_proposal_writes_match_torch(k: int) -> None:
    for seed in range(3):
        dev, dev_len, pool = spec_only(k, seed)
        results = []
        for fused in (False, True):
            spec, p = decoder(k, fused), pool.clone()
            spec.dev_len.copy_(dev_len)
            spec.propose(dev.spec_reqs, p)
            results.append((p.cpu(), spec.num_draft.cpu()))
        (ref_pool, ref_num), (pool_f, num_f) = results
        assert torch.equal(pool_f, ref_pool) and torch.equal(num_f, ref_num)
        assert ref_num.sum() > 0  # the patterns gave proposals


@pytest.mark.parametrize(("k", "sampled"), [(3, False), (3, True), (1, True)])
def test_fused_verification_matches_torch(k: int, sampled: bool) -> None:
    """SpecDecoder's fused verification (drafts gathered in one launch; in a step of speculative
    rows only, the parameters read per position) against its torch path."""
    for seed in range(2):
        dev, dev_len, pool = spec_only(k, seed)
        rows = NUM_SPEC * (k + 1)
        temperature = torch.tensor([0.0, 0.8, 1.0, 1.3, 0.0] if sampled else [0.0] * NUM_SPEC)
        per_row = dict(temperature=temperature, top_k=torch.tensor([0, 4, 0, 7, 0]).int(),
                       keys=keys(NUM_SPEC), counters=torch.arange(NUM_SPEC) * 5)
        batch = make_batch(rows, DEVICE, **{name: t.repeat_interleave(k + 1)
                                            for name, t in per_row.items()})
        scores = randn(NUM_SPEC, k + 1, VOCAB, seed=seed).to(DEVICE) * 3
        num_draft = torch.randint(0, k + 1, (NUM_REQS,), generator=torch.Generator()
                                  .manual_seed(seed)).to(DEVICE)
        num_draft[dev.spec_reqs[0]] = 0  # a row without drafts: NO_DRAFT past its first token
        req = int(dev.spec_reqs[1])  # a row whose k drafts the scores favour: all accepted
        num_draft[req] = k
        for j in range(k):
            scores[1, j, int(pool[req, int(dev_len[req]) + j])] += 100.0
        out = []
        for fused, only_spec in ((False, True), (True, True), (True, False)):
            spec = decoder(k, fused)
            spec.dev_len.copy_(dev_len)
            spec.num_draft.copy_(num_draft)
            verify = spec._verify_fused if fused else spec._verify
            args = (scores, batch, dev, pool, k) + ((only_spec,) if fused else ())
            out.append(verify(*args).cpu())
        assert torch.equal(out[1], out[0]) and torch.equal(out[2], out[0])
        assert (out[0] == NO_DRAFT).any() and (out[0] >= 0).sum() > NUM_SPEC  # some accepted
