"""The MoE layer: routing, the torch path against a naive per-token reference, expert ranges,
the fused Triton kernel against the torch path (in Triton's interpreter without CUDA), and the
MoE families' layer layout and checkpoint errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from photon.model.layers.moe import ExpertRange, FusedMoE, fused_moe_torch, select_experts
from photon.model.llama import DecoderMLP
from photon.model.loader import load_model
from photon.model.sparse_moe import SparseMoeBlock
from tests.hf_models import MIXTRAL, QWEN3_MOE, make_hf_model
from tests.test_models import assert_missing_weight_named, model_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _inputs(tokens: int, experts: int, hidden: int = 32, inter: int = 24, top_k: int = 2,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g) * 2
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _naive(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
           ids: torch.Tensor) -> torch.Tensor:
    """One token and one routed slot at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (7, 8, 2), (33, 8, 3), (5, 6, 6)])
def test_torch_path_equals_naive_reference(tokens: int, experts: int, top_k: int) -> None:
    x, w13, w2, weights, ids = _inputs(tokens, experts, top_k=top_k)
    got = fused_moe_torch(x, w13, w2, weights, ids, ExpertRange.whole(experts))
    torch.testing.assert_close(got, _naive(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_router_normalizations() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 0.0, -2.0]])
    w, ids = select_experts(logits, 2, renormalize=False)  # Qwen3-MoE without norm_topk_prob
    assert ids.tolist() == [[1, 3], [0, 1]]
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, ids))
    w, ids = select_experts(logits, 2, renormalize=True)  # Mixtral: softmax over the top-k logits
    torch.testing.assert_close(w, torch.softmax(logits.gather(1, ids), -1))
    assert w.dtype == torch.float32


def test_expert_ranges_partition_the_output() -> None:
    """Experts split into [0, 3) and [3, 8) (as expert-parallel ranks would): the parts sum to
    the whole and each part only computes its own experts."""
    x, w13, w2, weights, ids = _inputs(9, 8)
    whole = fused_moe_torch(x, w13, w2, weights, ids, ExpertRange.whole(8))
    low = fused_moe_torch(x, w13[:3], w2[:3], weights, ids, ExpertRange(8, 0, 3))
    high = fused_moe_torch(x, w13[3:], w2[3:], weights, ids, ExpertRange(8, 3, 8))
    torch.testing.assert_close(low + high, whole, atol=1e-6, rtol=1e-5)
    only_high = (ids >= 3).all(dim=1)
    assert torch.equal(low[only_high], torch.zeros_like(low[only_high]))


def test_weight_loader_checks_the_expert_and_its_shape() -> None:
    moe = FusedMoE(4, 2, hidden_size=8, intermediate_size=6, renormalize=True,
                   experts=ExpertRange(4, 2, 4))
    moe.w13_weight.data.zero_()  # torch.empty may hold NaNs, which never compare equal
    gate = torch.randn(6, 8)
    moe.weight_loader(moe.w13_weight, gate, (3, "w1"))
    assert torch.equal(moe.w13_weight[1, :6], gate)
    before = moe.w13_weight.clone()
    moe.weight_loader(moe.w13_weight, gate, (0, "w3"))  # another rank's expert: skipped
    assert torch.equal(moe.w13_weight, before)
    with pytest.raises(ValueError, match="expert id 4 is out of range: the model has 4 experts"):
        moe.weight_loader(moe.w13_weight, gate, (4, "w1"))
    with pytest.raises(ValueError, match="shape mismatch"):
        moe.weight_loader(moe.w2_weight, gate, (2, "w2"))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        FusedMoE(4, 5, hidden_size=8, intermediate_size=6, renormalize=True)


# ----------------------------------------------------------------------------- fused kernel


@needs_triton
def test_moe_align_groups_slots_by_expert_in_padded_blocks() -> None:
    from photon.kernels.fused_moe import moe_align

    ids = torch.tensor([[5, 1], [1, 2], [7, 1], [2, 6]])
    experts = ExpertRange(8, 1, 5)  # local experts 1..4; 5, 6, 7 go to the extra bucket
    sorted_ids, block_expert, rows_used = moe_align(ids, experts, block_m=4)
    n = ids.numel()
    rows = int(rows_used)
    assert rows % 4 == 0 and rows == 4 + 4 + 4  # expert 1 (3 slots), 2 (2), out-of-range (3)
    flat = ids.reshape(-1)
    for b in range(rows // 4):
        block = [int(s) for s in sorted_ids[4 * b: 4 * b + 4] if s < n]
        local = int(block_expert[b])
        want = [i for i in range(n) if (int(flat[i]) - 1 if 1 <= flat[i] < 5 else 4) == local]
        assert block == want
    assert sorted(int(s) for s in sorted_ids if s < n) == list(range(n))


@needs_triton
@pytest.mark.parametrize("tokens,experts,top_k,first,last",
                         [(1, 4, 2, 0, 4), (13, 8, 2, 0, 8), (150, 8, 2, 0, 8), (20, 8, 3, 2, 6)])
def test_fused_kernel_equals_torch_path(tokens: int, experts: int, top_k: int, first: int,
                                        last: int) -> None:
    from photon.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _inputs(tokens, experts, hidden=40, inter=24, top_k=top_k)
    rng = ExpertRange(experts, first, last)
    w13, w2 = w13[first:last], w2[first:last]
    want = fused_moe_torch(x, w13, w2, weights, ids, rng)
    got = fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), rng)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- model families


def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers(tmp_path) -> None:  # noqa: ANN001
    extra = dict(QWEN3_MOE, decoder_sparse_step=2, mlp_only_layers=[3])
    path = make_hf_model(str(tmp_path), "Qwen3MoeForCausalLM", num_layers=6, extra=extra)
    model = load_model(model_config(path), "cpu")
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [DecoderMLP, SparseMoeBlock, DecoderMLP, DecoderMLP, DecoderMLP,
                     SparseMoeBlock]


def test_missing_expert_weight_is_named(tmp_path) -> None:  # noqa: ANN001
    path = make_hf_model(str(tmp_path), "MixtralForCausalLM", extra=MIXTRAL)
    assert_missing_weight_named(path, "model.layers.1.block_sparse_moe.experts.2.w3.weight",
                                r"model\.layers\.1\.mlp\.experts\.w13_weight")
