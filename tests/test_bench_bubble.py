"""`photon bench bubble` and `photon bench profile` from the CLI on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from photon.cli import main


@pytest.mark.parametrize("mode", ["final", "delta"])
def test_bench_bubble_cpu(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    rc = main(["bench", "bubble", "--model-shape", "tiny", "--batch-sizes", "1", "4",
               "--steps", "4", "--warmup-steps", "1", "--prompt-len", "8", "--output-mode", mode,
               "--device", "cpu"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["output_mode"] == mode and summary["device_name"] == "cpu"
    assert [r["batch_size"] for r in summary["rows"]] == [1, 4]
    for row in summary["rows"]:
        for side in ("blocking", "pipelined"):
            stats = row[side]  # not on a GPU: "device" columns
            assert set(stats) == {"device_ms", "host_ms", "wall_ms", "device_busy",
                                  "decode_tok_per_s"}
            assert stats["wall_ms"] > 0 and stats["device_ms"] > 0 and stats["host_ms"] >= 0
            assert stats["decode_tok_per_s"] == pytest.approx(
                row["batch_size"] * 1e3 / stats["wall_ms"], rel=1e-6)
        assert row["measured_gain"] == pytest.approx(
            row["blocking"]["wall_ms"] / row["pipelined"]["wall_ms"])


def test_bench_bubble_cpu_defaults_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    from photon.bench.bubble import BATCH_SIZES

    # No --batch-sizes and no --model-shape: the CPU defaults (steps kept short here).
    rc = main(["bench", "bubble", "--device", "cpu", "--steps", "2", "--warmup-steps", "1",
               "--prompt-len", "8"])
    assert rc == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["model_shape"] == "tiny"
    assert [r["batch_size"] for r in summary["rows"]] == BATCH_SIZES[1] == [1, 8, 32]
    assert "bench bubble runs" in err and "6/6" in err  # the progress bar, on stderr
    assert "(device busy" in err
    with pytest.raises(SystemExit):
        main(["bench", "bubble", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 1 8 32 128 256 on CUDA, 1 8 32 on CPU)" in text
    assert "(default 64 on CUDA, 32 on CPU)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error exists only without CUDA")
def test_bench_profile_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "profile", "--model-shape", "tiny"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_profile_refills_make_mixed_steps() -> None:
    """The refills `photon bench profile --refills-per-step` adds are prefilled by the next step
    beside the running decode rows."""
    from photon import LLM, SamplingParams
    from photon.bench.profile import add_refills

    llm = LLM("photon-tiny", device="cpu", max_num_seqs=8)
    try:
        core = llm.engine
        core.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True))
        while not any(r.output_token_ids for r in core.scheduler.running):
            core.step()
        add_refills(core, 2, 9, 3, seed=0)
        assert len(core.scheduler.waiting) == 2
        core.step()
        running = core.scheduler.running
        assert not core.scheduler.waiting and len(running) == 3
        assert sorted(r.num_prompt_tokens for r in running) == [3, 9, 9]
        while core.scheduler.has_unfinished():
            core.step()
    finally:
        llm.engine.shutdown()


def test_host_profile_times_the_steps_and_names_the_engine_functions() -> None:
    """`--host-profile`: the steps' wall time, and cProfile's cumulative host time per step by
    function, the engine's step inside the loop that runs the steps."""
    import argparse

    from photon import LLM, SamplingParams
    from photon.bench.profile import host_profile

    llm = LLM("photon-tiny", device="cpu", max_num_seqs=16)
    try:
        core = llm.engine
        for i in range(3):
            core.add_request([5 + i, 6, 7], SamplingParams(temperature=0.0, max_tokens=40,
                                                           ignore_eos=True))
        ns = argparse.Namespace(steps=4, refills_per_step=1, refill_prompt_len=5)
        out = host_profile(core, ns, top=10)
        assert out["wall_ms_per_step"] > 0
        cum = out["cumulative_ms_per_step"]
        assert len(cum) == 10
        runs = [v for k, v in cum.items() if "(_run_steps)" in k]
        steps = [v for k, v in cum.items() if "engine_core.py" in k and "(step)" in k]
        assert len(runs) == len(steps) == 1 and 0 < steps[0] <= runs[0] == max(cum.values())
        assert core.scheduler.num_steps >= 8  # both rounds ran
        while core.scheduler.has_unfinished():
            core.step()
    finally:
        llm.engine.shutdown()


def test_lora_kernels_are_a_class_of_their_own() -> None:
    from photon.bench.profile import classify

    assert classify("_shrink_kernel") == classify("_expand_kernel") == "lora"
    assert classify("_decode_split_kernel") == "attention"


def test_profile_requests_run_the_synthetic_adapters(tmp_path: Path) -> None:
    """`photon bench profile --num-lora-adapters N`: the batch and the refills run the adapters
    round-robin, through slots (the LoRA kernels are in the profiled steps)."""
    import argparse

    from photon import LLM
    from photon.bench.bubble import _start_batch
    from photon.bench.profile import add_refills
    from photon.bench.throughput_lora import LoRABench, assign, write_adapters
    from photon.model.tiny import resolve_model_path

    bench = LoRABench(2, 4, ("q_proj", "v_proj"), "round-robin")
    adapters = write_adapters(bench, resolve_model_path("photon-tiny"), str(tmp_path))
    llm = LLM("photon-tiny", device="cpu", max_num_seqs=8, enable_lora=True, max_loras=2,
              max_lora_rank=4)
    try:
        core = llm.engine
        ns = argparse.Namespace(prompt_len=6, warmup_steps=1, steps=2, temperature=0.0,
                                output_mode="final")
        _start_batch(core, 3, ns, assign(adapters, 3, "round-robin", 0))
        running = sorted(core.scheduler.running, key=lambda r: r.arrival_time)
        assert [r.lora_request.lora_int_id for r in running] == [1, 2, 1]
        add_refills(core, 2, 5, 2, seed=1, loras=adapters)
        assert [r.lora_request.lora_int_id for r in core.scheduler.waiting] == [2, 1]
        while core.scheduler.has_unfinished():
            core.step()
        assert llm.engine.stats().lora.num_slot_loads == 2
    finally:
        llm.engine.shutdown()
