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
from photon.worker.spec_step import SpecDecoder
from tests.test_kernels import CUDA, DEVICE
from tests.test_kernels import pytestmark as kernel_marks

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
