"""`photon bench structured` runs on CPU and reports grammar-bounded outputs."""

from __future__ import annotations

import json

import pytest

from photon.cli import main


def test_bench_structured_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "structured", "--model-shape", "tiny", "--batch-sizes", "3",
               "--max-output-tokens", "300", "--prompt-len", "16"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = summary["rows"]
    assert row["batch_size"] == 3
    assert 0 < row["mean_output_tokens"] < 300  # the grammar, not max_tokens, ended them
    for key in ("json_blocking", "json_pipelined", "plain_blocking", "plain_pipelined"):
        assert row[f"{key}_tok_per_s"] > 0
