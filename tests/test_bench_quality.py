"""`photon bench quality` on photon-tiny with tiny sizes: the JSON fields and sane values; the
unquantized model against itself gives KL 0, agreement 1 and no flips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from photon.cli import main

DATA = str(Path(__file__).parent / "data" / "heldout_code.json")
TINY = ["--model", "photon-tiny", "--device", "cpu", "--data", DATA, "--num-windows", "2",
        "--window-len", "48", "--num-prompts", "3", "--prompt-len", "16", "--greedy-tokens", "6"]
FIELDS = ("kl_mean", "kl_p99", "top1_agreement", "perplexity_ref", "perplexity",
          "perplexity_delta", "greedy_flips", "tokens", "windows", "prompts")


def _quality(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["bench", "quality", *TINY, *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


def test_unquantized_against_itself(capsys: pytest.CaptureFixture[str]) -> None:
    r = _quality(capsys)
    assert r["benchmark"] == "quality" and r["kv_cache_dtype"] == "auto"
    assert all(name in r for name in FIELDS)
    assert r["kl_mean"] == 0.0 and r["kl_p99"] == 0.0
    assert r["top1_agreement"] == 1.0 and r["greedy_flips"] == 0.0
    assert r["perplexity"] == r["perplexity_ref"] and r["perplexity_delta"] == 0.0
    assert r["tokens"] == 2 * 48 and r["windows"] == 2 and r["prompts"] == 3


def test_fp8_kv_cache_costs_a_little(capsys: pytest.CaptureFixture[str]) -> None:
    r = _quality(capsys, "--kv-cache-dtype", "fp8", "--calculate-kv-scales")
    assert r["kv_cache_dtype"] == "fp8" and r["calculate_kv_scales"] is True
    assert 0.0 < r["kl_mean"] < 0.1 and r["kl_p99"] >= r["kl_mean"]
    assert 0.8 <= r["top1_agreement"] <= 1.0
    assert 0.0 <= r["greedy_flips"] <= 1.0
    # photon-tiny predicts its held-out Python well: perplexity far below the vocabulary's
    assert 1.0 < r["perplexity_ref"] < 100.0 and abs(r["perplexity_delta"]) < 0.1


@pytest.mark.parametrize("argv,message", [
    (["--window-len", "0"], "--window-len must be at least 1, got 0"),
    (["--data", "/nonexistent/heldout"], "neither a prepared data directory nor a file"),
    (["--window-len", "4096"], "longer than the held-out stream|stream has"),
])
def test_bad_sizes_and_data(capsys: pytest.CaptureFixture[str], argv: list[str],
                            message: str) -> None:
    assert main(["bench", "quality", *TINY, *argv]) != 0
    assert re.search(message, capsys.readouterr().err)
