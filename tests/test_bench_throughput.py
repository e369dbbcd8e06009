"""`photon bench throughput`: the standard workload, the roofline model and the CLI (CPU, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from photon.bench.roofline import roofline_tok_per_s, shape_costs, simulate_decode
from photon.bench.shapes import SHAPES, param_count
from photon.bench.workload import fit_vocab, standard_workload, totals
from photon.cli import main

# An H200's HBM bandwidth and dense bf16 matmul rate: the ceilings the roofline is checked at.
H200_BANDWIDTH = 4.23e12  # bytes/s
H200_BF16_FLOPS = 790e12  # FLOP/s
SMALL = ["--num-prompts", "6", "--input-len-range", "5", "20", "--output-len-range", "3", "9"]
SHORT = ["--input-len-range", "5", "20", "--output-len-range", "3", "9"]


@pytest.fixture(scope="module")
def requests() -> list[tuple[int, int]]:
    return [(len(ids), out) for ids, out in standard_workload()]


def test_standard_workload_totals() -> None:
    workload = standard_workload()
    assert len(workload) == 256
    assert totals(workload) == (142_827, 133_966)  # the standard workload's totals
    assert all(0 <= t <= 10_000 for ids, _ in workload for t in ids)
    assert standard_workload() == workload  # deterministic


def test_fit_vocab_keeps_lengths() -> None:
    workload = standard_workload(num_prompts=8)
    folded = fit_vocab(workload, 1024)
    assert [(len(i), o) for i, o in folded] == [(len(i), o) for i, o in workload]
    assert max(t for ids, _ in folded for t in ids) < 1024


def test_simulate_decode_counts() -> None:
    # prompt 3, 2 outputs: contexts 3, 4; prompt 5, 1 output: context 5 (both in step 1)
    traffic = simulate_decode([(3, 2), (5, 1)], max_num_seqs=8)
    assert (traffic.steps, traffic.kv_token_reads) == (2, 3 + 5 + 4)
    # one slot: the second request waits for the first
    assert simulate_decode([(3, 2), (5, 1)], max_num_seqs=1).steps == 3


# Reference rooflines of the standard workload on one H200 (decode bytes plus prefill FLOPs).
@pytest.mark.parametrize(("shape", "expected"), [("qwen3-0.6b", 35_400), ("llama-3.1-8b", 12_700)])
def test_roofline_of_the_standard_workload(requests: list[tuple[int, int]], shape: str,
                                           expected: float) -> None:
    roof = roofline_tok_per_s(requests, shape_costs(shape), H200_BANDWIDTH, 256, H200_BF16_FLOPS)
    assert roof == pytest.approx(expected, rel=0.02)
    decode_only = roofline_tok_per_s(requests, shape_costs(shape), H200_BANDWIDTH, 256)
    assert decode_only > roof  # prefill compute only adds time


def test_moe_shape_counts_all_experts_and_the_active_ones() -> None:
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (the model card's numbers)."""
    assert param_count("qwen3-30b-a3b") == pytest.approx(30.5e9, rel=0.01)
    assert param_count("qwen3-30b-a3b", active=True) == pytest.approx(3.3e9, rel=0.02)
    costs = shape_costs("qwen3-30b-a3b")
    assert costs.weight_bytes == 2 * param_count("qwen3-30b-a3b")
    assert costs.param_count == param_count("qwen3-30b-a3b", active=True)
    assert param_count("llama-3.1-8b", active=True) == param_count("llama-3.1-8b")
    from photon.model.qwen3_moe import Qwen3MoeForCausalLM
    from photon.model.sparse_moe import MoESettings

    cfg = SHAPES["qwen3-30b-a3b"]
    assert Qwen3MoeForCausalLM.moe_settings(cfg) == MoESettings(128, 8, 768, True)
    assert all(Qwen3MoeForCausalLM.is_sparse_layer(cfg, i) for i in range(48))


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict, str]:
    """(the JSON summary, stderr) of a CPU run."""
    code = main(["bench", "throughput", "--model-shape", "tiny", "--device", "cpu",
                 "--hbm-bandwidth", "1e11", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def _last_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    return _run(capsys, [*SMALL, "--warmup-prompts", "1", *argv])[0]


@pytest.fixture(scope="module")
def small_output_tokens() -> int:
    return totals(standard_workload(6, (5, 20), (3, 9)))[1]


def test_cli_pipelined(capsys: pytest.CaptureFixture[str], small_output_tokens: int) -> None:
    summary = _last_json(capsys, [])
    assert summary["output_tokens"] == small_output_tokens
    assert summary["pipelined"] is True
    for key in ("roofline_tok_per_s", "roofline_fraction", "hbm_bandwidth", "elapsed_s",
                "output_tok_per_s", "total_tok_per_s"):
        assert isinstance(summary[key], float) and summary[key] > 0, key
    assert summary["model_shape"] == "tiny" and summary["device"] == "cpu"
    assert summary["num_prompts"] == 6 and summary["max_model_len"] == 20 + 9
    for key in ("prompt_tokens", "torch_version", "model", "max_num_seqs",
                "max_num_batched_tokens", "attention_backend", "enforce_eager"):
        assert key in summary, key
    # Not on a GPU: the columns say "device", and no GPU memory was measured.
    assert summary["device_name"] == "cpu" and summary["peak_device_memory_bytes"] is None
    cost_keys = {"gpu_cost_per_hour", "num_gpus"}
    assert not [key for key in summary if "gpu" in key and key not in cost_keys]
    assert summary["gpu_cost_per_hour"] is None
    assert summary["dollars_per_million_output_tokens"] is None


def test_cli_blocking(capsys: pytest.CaptureFixture[str], small_output_tokens: int,
                      tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    summary = _last_json(capsys, ["--no-pipelined", "--output-json", str(path)])
    assert summary["pipelined"] is False
    assert summary["output_tokens"] == small_output_tokens
    assert json.loads(path.read_text()) == summary


def test_cpu_defaults_are_cpu_sized_and_show_progress(capsys: pytest.CaptureFixture[str]) -> None:
    from photon.bench.throughput import CPU_DEFAULTS

    assert CPU_DEFAULTS.num_prompts == 16 and CPU_DEFAULTS.output_len_range == (32, 256)
    # No --num-prompts / --warmup-prompts: the CPU defaults (the lengths are kept short here).
    summary, err = _run(capsys, SHORT)
    assert summary["num_prompts"] == CPU_DEFAULTS.num_prompts
    assert summary["output_tokens"] == totals(standard_workload(16, (5, 20), (3, 9)))[1]
    assert "warm-up: 1 prompts" in err
    assert "Processed prompts" in err and "16/16" in err  # the progress bar, on stderr


def test_cpu_defaults_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Requests (default 256 on CUDA, 16 on CPU)." in text
    assert "(default 100 1024 on CUDA, 32 256 on CPU)" in text


def test_cost_per_million_output_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    summary, err = _run(capsys, [*SMALL, "--warmup-prompts", "0", "--gpu-cost-per-hour", "3.6"])
    # $3.60 per hour = $0.001 per second: per million tokens, 1000 / (tokens per second).
    assert summary["gpu_cost_per_hour"] == 3.6 and summary["num_gpus"] == 1
    assert summary["dollars_per_million_output_tokens"] == pytest.approx(
        1e3 / summary["output_tok_per_s"])
    assert f"cost: ${summary['dollars_per_million_output_tokens']:.4f} per million" in err


def test_negative_cost_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--gpu-cost-per-hour", "-1"]) == 2
    assert "--gpu-cost-per-hour must be a number of dollars >= 0, got -1.0" in \
        capsys.readouterr().err
