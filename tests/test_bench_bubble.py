"""`photon bench bubble` and `photon bench profile` from the CLI on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from photon.cli import main


@pytest.mark.parametrize("mode", ["final", "delta"])
def test_bench_bubble_cpu(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    rc = main(["bench", "bubble", "--model-shape", "tiny", "--batch-sizes", "1", "4",
               "--steps", "4", "--warmup-steps", "1", "--prompt-len", "8", "--output-mode", mode])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["output_mode"] == mode
    assert [r["batch_size"] for r in summary["rows"]] == [1, 4]
    for row in summary["rows"]:
        for side in ("blocking", "pipelined"):
            stats = row[side]
            assert stats["wall_ms"] > 0 and stats["gpu_ms"] > 0 and stats["host_ms"] >= 0
            assert stats["decode_tok_per_s"] == pytest.approx(
                row["batch_size"] * 1e3 / stats["wall_ms"], rel=1e-6)
        assert row["measured_gain"] == pytest.approx(
            row["blocking"]["wall_ms"] / row["pipelined"]["wall_ms"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error exists only without CUDA")
def test_bench_profile_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "profile", "--model-shape", "tiny"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
