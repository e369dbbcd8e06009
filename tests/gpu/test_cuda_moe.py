"""The fused MoE kernel on the GPU: bf16 against the torch path at a Qwen3-30B-A3B layer's shape,
no host sync and replayable in a CUDA graph; tiny MoE models' greedy tokens through the engine
(fused kernels on) equal transformers'."""

from __future__ import annotations

import pytest
import torch

from photon import LLM, SamplingParams
from photon.model.layers.moe import ExpertRange, fused_moe_torch, select_experts
from tests.hf_models import MIXTRAL, QWEN3_MOE, hf_greedy, make_engine_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B's MoE layer


def _layer(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(bf)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") * 0.02).to(bf)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") * 0.02).to(bf)
    logits = torch.randn(tokens, EXPERTS, generator=g, device="cuda")
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 32, 513])
def test_bf16_kernel_equals_torch_path(tokens: int) -> None:
    from photon.kernels.fused_moe import fused_moe

    args = _layer(tokens)
    got = fused_moe(*args, ExpertRange.whole(EXPERTS)).float()
    want = fused_moe_torch(*args, ExpertRange.whole(EXPERTS)).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_kernel_has_no_host_sync_and_replays_in_a_cuda_graph() -> None:
    from photon.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _layer(16)
    rng = ExpertRange.whole(EXPERTS)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, weights, ids, rng)  # compile + warm up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x, w13, w2, weights, ids, rng)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    new = _layer(16, seed=1)
    for t, n in zip((x, weights, ids), (new[0], new[3], new[4]), strict=True):
        t.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, w13, w2, weights, ids, rng))


@pytest.mark.parametrize("arch,extra", [("Qwen3MoeForCausalLM", QWEN3_MOE),
                                        ("MixtralForCausalLM", MIXTRAL)])
def test_moe_greedy_equals_transformers_with_fused_kernels(tmp_path, arch: str,  # noqa: ANN001
                                                           extra: dict) -> None:
    path = make_engine_model(str(tmp_path), arch, num_layers=3, head_dim=32, extra=extra)
    prompts = [[5, 77, 300, 12], list(range(40, 90)), [9]]
    reference = hf_greedy(path, prompts, 12)
    llm = LLM(path, device="cuda", dtype="float32", block_size=16, max_num_seqs=4,
              max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    llm.engine.assert_drained()
