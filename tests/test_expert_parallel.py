"""MoE models under tensor parallelism on CPU (gloo, two ranks): with --enable-expert-parallel
(each rank holds half of the experts) and without (each expert's intermediate dimension split),
the tokens equal those of one rank; each rank loads only its share of the expert weights."""

from __future__ import annotations

import pytest
import torch

from photon.config import ConfigError
from photon.distributed.group import TPGroup
from photon.engine_args import EngineArgs
from photon.model.layers.moe import ExpertRange, FusedMoE
from photon.model.loader import load_model
from tests.hf_models import MIXTRAL, QWEN3_MOE, make_engine_model, read_checkpoint
from tests.test_models import model_config
from tests.tp_util import engine, run_all, tp_config

pytestmark = pytest.mark.timeout(300)

MODELS = {"Qwen3MoeForCausalLM": QWEN3_MOE, "MixtralForCausalLM": MIXTRAL}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_reference(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    arch = request.param
    path = make_engine_model(str(tmp_path_factory.mktemp(arch)), arch, extra=MODELS[arch])
    with engine(tp_config(path, 1)) as core:
        return path, run_all(core)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_ep2_tokens_equal_one_rank(model_and_reference: tuple[str, dict], pipelined: bool) -> None:
    """Greedy and seeded sampled requests: the same tokens with the experts over two ranks as
    on one rank (drained on both ranks)."""
    path, reference = model_and_reference
    assert len(set(map(tuple, reference.values()))) > 1  # varied outputs: the check can fail
    with engine(tp_config(path, 2, pipelined, expert_parallel=True)) as core:
        assert core.workers is not None and len(core.workers.procs) == 1
        moe = _first_experts(core.runner.model)
        assert moe.expert_parallel and moe.experts.num_local < moe.experts.num_experts
        assert run_all(core) == reference


def test_tp2_without_ep_tokens_equal_one_rank(model_and_reference: tuple[str, dict]) -> None:
    """Without expert parallelism each expert's intermediate dimension is split: same tokens."""
    path, reference = model_and_reference
    with engine(tp_config(path, 2)) as core:
        moe = _first_experts(core.runner.model)
        assert not moe.expert_parallel and moe.experts.num_local == moe.experts.num_experts
        assert run_all(core) == reference


def _first_experts(model: torch.nn.Module) -> FusedMoE:
    return next(m for m in model.modules() if isinstance(m, FusedMoE))


def _expert(hf: dict[str, torch.Tensor], layer: int, e: int, proj: str) -> torch.Tensor:
    """One expert's projection (gate, up or down) under either family's checkpoint names."""
    mixtral = {"gate": "w1", "up": "w3", "down": "w2"}
    for name in (f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight",
                 f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mixtral[proj]}.weight"):
        if name in hf:
            return hf[name]
    raise KeyError(f"expert {e} {proj} of layer {layer}")


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_only_its_experts(tmp_path, arch: str, rank: int) -> None:
    """Expert parallel: rank r of 2 holds experts [r*E/2, (r+1)*E/2), whole. Without it: every
    expert, rows/columns [r*I/2, (r+1)*I/2) of its intermediate dimension."""
    path = make_engine_model(str(tmp_path / "m"), arch, extra=MODELS[arch])
    hf = read_checkpoint(path)
    tp = TPGroup(rank, 2)  # loading runs no collective: no process group needed
    ep = _first_experts(load_model(model_config(path), "cpu", tp, expert_parallel=True))
    num_experts, inter, hidden = ep.experts.num_experts, ep.intermediate_size, ep.hidden_size
    half = num_experts // 2
    assert ep.experts == ExpertRange(num_experts, rank * half, (rank + 1) * half)
    assert ep.w13_weight.shape == (half, 2 * inter, hidden)
    assert ep.w2_weight.shape == (half, hidden, inter)
    for local in range(half):
        e = rank * half + local
        want = torch.cat([_expert(hf, 0, e, "gate"), _expert(hf, 0, e, "up")])
        assert torch.equal(ep.w13_weight[local], want)
        assert torch.equal(ep.w2_weight[local], _expert(hf, 0, e, "down"))
    split = _first_experts(load_model(model_config(path), "cpu", tp))
    i = inter // 2
    assert split.w13_weight.shape == (num_experts, 2 * i, hidden)
    assert split.w2_weight.shape == (num_experts, hidden, i)
    rows = slice(rank * i, (rank + 1) * i)
    for e in range(num_experts):
        want = torch.cat([_expert(hf, 0, e, "gate")[rows], _expert(hf, 0, e, "up")[rows]])
        assert torch.equal(split.w13_weight[e], want)
        assert torch.equal(split.w2_weight[e], _expert(hf, 0, e, "down")[:, rows])


def test_expert_ranges_of_ranks_cover_the_experts() -> None:
    ranges = [ExpertRange.of_rank(7, r, 3) for r in range(3)]
    assert [(r.first, r.last) for r in ranges] == [(0, 2), (2, 4), (4, 7)]


@pytest.mark.parametrize(("arch", "extra", "kwargs", "message"), [
    ("LlamaForCausalLM", {}, {"enable_expert_parallel": True},
     r"enable_expert_parallel \(--enable-expert-parallel\): LlamaForCausalLM has no experts"),
    ("MixtralForCausalLM", dict(MIXTRAL, intermediate_size=100),
     {"tensor_parallel_size": 8},
     r"must divide the model's intermediate_size=100 .*--enable-expert-parallel"),
    ("MixtralForCausalLM", MIXTRAL, {"tensor_parallel_size": 8, "enable_expert_parallel": True},
     "num_local_experts=4, fewer experts than ranks"),
])
def test_expert_parallel_config_errors(tmp_path, arch: str, extra: dict, kwargs: dict,
                                       message: str) -> None:
    path = make_engine_model(str(tmp_path / "m"), arch, num_heads=8, num_kv_heads=8, extra=extra)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=path, **kwargs).create_config()


def test_expert_parallel_flag_and_llm_argument() -> None:
    import argparse

    from photon.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--enable-expert-parallel"]).enable_expert_parallel is True
    assert parser.parse_args([]).enable_expert_parallel is False
    assert "enable_expert_parallel" in EngineArgs.field_names()
