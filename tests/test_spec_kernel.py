"""The fused verification kernel (photon.kernels.spec_verify) against the torch path.

Without CUDA it runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the `gpu` test
runs on CUDA, where verify() picks the kernel by itself.
"""

from __future__ import annotations

import pytest
import torch

from photon.spec.rejection import verify, verify_torch
from tests.test_kernels import CUDA, DEVICE
from tests.test_kernels import pytestmark as kernel_marks
from tests.test_sampler import full, make_batch
from tests.test_spec_rejection import keys, randn

pytestmark = [
    *kernel_marks,
    # the interpreter's numpy warns on -inf - -inf, which the kernel masks out
    pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning"),
]

ROWS, K = 12, 3


def inputs(vocab: int, with_probs: bool, seed: int):
    logits = randn(ROWS, K + 1, vocab, seed=seed) * 2
    gen = torch.Generator().manual_seed(seed + 1)
    argmax = logits.argmax(dim=2)[:, :K]
    draft = torch.where(torch.rand(ROWS, K, generator=gen) < 0.5, argmax,
                        torch.randint(0, vocab, (ROWS, K), generator=gen))
    num_draft = torch.randint(0, K + 1, (ROWS,), generator=gen).int()
    probs = torch.softmax(logits[:, :K] + randn(ROWS, K, vocab, seed=seed + 2), dim=2) \
        if with_probs else None
    return logits, draft, num_draft, probs


def batch_for(filters: str, vocab: int):
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * (ROWS // 4))
    kw = {}
    if "k" in filters:
        kw["top_k"] = torch.tensor([0, 3, 5, vocab] * (ROWS // 4), dtype=torch.int32)
    if "p" in filters:
        kw["top_p"] = torch.tensor([1.0, 0.9, 0.6, 0.3] * (ROWS // 4))
    if "m" in filters:
        kw["min_p"] = torch.tensor([0.0, 0.05, 0.2, 0.0] * (ROWS // 4))
    return make_batch(ROWS, DEVICE, temperature=temperature, keys=keys(ROWS),
                      counters=torch.arange(ROWS) * 3, **kw)


def on_device(*tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


# Each filter set once, with and without draft probabilities alternately (interpreter time).
@pytest.mark.parametrize("filters,with_probs", [("", False), ("k", True), ("kp", False),
                                                ("mkp", True), ("mkp", False)])
def test_kernel_matches_torch(with_probs: bool, filters: str) -> None:
    vocab = 37
    for seed in (len(filters) + 10 * with_probs,):  # one draw per case: the cases vary it
        args = on_device(*inputs(vocab, with_probs, seed))
        batch = batch_for(filters, vocab)
        fused = verify(*args, batch, fused=True)
        ref = verify_torch(*args, batch)
        assert torch.equal(fused.tokens.cpu(), ref.tokens.cpu())
        assert torch.equal(fused.num_accepted.cpu(), ref.num_accepted.cpu())


def test_kernel_greedy_batch_and_no_drafts() -> None:
    logits, draft, _, _ = on_device(*inputs(20, False, 3))
    greedy = make_batch(ROWS, DEVICE, temperature=full(ROWS, 0.0))
    none = torch.zeros(ROWS, dtype=torch.int32, device=DEVICE)
    for num_draft in (none, none + K):
        fused = verify(logits, draft, num_draft, None, greedy, fused=True)
        assert torch.equal(fused.tokens, verify_torch(logits, draft, num_draft, None, greedy).tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_picks_the_kernel_and_matches_torch_on_a_large_vocabulary() -> None:
    logits, draft, num_draft, probs = on_device(*inputs(5000, True, 7))
    batch = batch_for("mkp", 5000)
    fused = verify(logits, draft, num_draft, probs, batch)
    ref = verify_torch(logits, draft, num_draft, probs, batch)
    assert torch.equal(fused.tokens, ref.tokens)
