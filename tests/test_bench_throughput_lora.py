"""`photon bench throughput --num-lora-adapters`: synthetic adapters, slot churn (CPU, fast)."""

from __future__ import annotations

import json

import pytest

from photon.bench.throughput_lora import assign
from photon.cli import main

SMALL = ["--num-prompts", "6", "--input-len-range", "5", "12", "--output-len-range", "2", "4",
         "--warmup-prompts", "0"]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict | None, str]:
    code = main(["bench", "throughput", "--model-shape", "tiny", "--device", "cpu", *SMALL,
                 *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else None), err


def test_three_adapters_two_slots(capsys: pytest.CaptureFixture[str]) -> None:
    code, summary, err = _run(capsys, ["--num-lora-adapters", "3", "--max-loras", "2",
                                       "--max-lora-rank", "8", "--lora-rank", "4"])
    assert code == 0, err
    assert summary is not None
    assert summary["num_lora_adapters"] == 3 and summary["max_loras"] == 2
    assert summary["max_lora_rank"] == 8 and summary["lora_rank"] == 4
    assert summary["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj"]
    assert summary["lora_assignment"] == "round-robin"
    # 3 adapters in 2 slots: at least one adapter had to be loaded again.
    assert summary["lora_slot_loads"] >= 3
    assert summary["num_prompts"] == 6 and summary["output_tokens"] > 0  # all completed
    assert 0 < summary["median_ttft_ms"] <= summary["p99_ttft_ms"] <= 1000 * summary["elapsed_s"]


def test_without_adapters_the_fields_say_none(capsys: pytest.CaptureFixture[str]) -> None:
    code, summary, err = _run(capsys, ["--num-prompts", "2"])
    assert code == 0, err
    assert summary is not None
    assert summary["num_lora_adapters"] == 0 and summary["lora_slot_loads"] == 0
    assert summary["max_loras"] is None and summary["lora_rank"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-lora-adapters", "-1"], "--num-lora-adapters must be >= 0, got -1"),
    (["--num-lora-adapters", "2", "--lora-rank", "32"],
     "--lora-rank must be in [1, --max-lora-rank = 16], got 32"),
    (["--num-lora-adapters", "2", "--lora-targets", "q,lm_head"],
     "--lora-targets: unknown projection(s) ['lm_head']; allowed: q, k, v, o, gate, up, down"),
])
def test_bad_lora_flags(capsys: pytest.CaptureFixture[str], argv: list[str],
                        message: str) -> None:
    code, _, err = _run(capsys, argv)
    assert code == 2 and message in err


def test_assignment() -> None:
    adapters = ["a", "b", "c"]
    assert assign(adapters, 5, "round-robin", 0) == ["a", "b", "c", "a", "b"]
    drawn = assign(adapters, 20, "random", 7)
    assert drawn == assign(adapters, 20, "random", 7) and set(drawn) == set(adapters)
    assert assign([], 3, "random", 0) is None
    many = [f"a{i}" for i in range(50)]
    zipf = assign(many, 2000, "zipf", 1)
    assert zipf == assign(many, 2000, "zipf", 1)
    # weight 1/i: the first adapter is drawn about twice as often as the second, 50x the last
    assert zipf.count("a0") > 1.5 * zipf.count("a1") > 0 and zipf.count("a0") > 10 * zipf.count("a49")
