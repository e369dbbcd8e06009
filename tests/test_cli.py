"""The `photon` command line: help texts, plain and JSON output, and agreement with the Python API."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from photon import LLM, SamplingParams
from photon.cli import main

PROMPT = "Hello"
ENGINE_FLAGS = ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                "--gpu-memory-utilization", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--num-gpu-blocks-override", "--pipelined",
                "--no-pipelined", "--enforce-eager", "--seed", "--dtype", "--model")


def _photon(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "photon.cli", *args], capture_output=True,
                          text=True, timeout=120, env=os.environ.copy())


def _generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    # --max-model-len 64 keeps the CPU KV cache small (fast); it does not change the tokens.
    code = main(["generate", "--no-progress", "--temperature", "0", "--max-tokens", "8",
                 "--max-model-len", "64", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


@pytest.fixture(scope="module")
def expected() -> tuple[str, list[int]]:
    """Greedy reference from the Python API (the CLI must print the same)."""
    out = LLM(max_model_len=64).generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    completion = out[0].outputs[0]
    return completion.text, completion.token_ids


def test_top_level_help() -> None:
    res = _photon("--help")
    assert res.returncode == 0, res.stderr
    assert "usage: photon" in res.stdout
    assert "generate" in res.stdout


def test_no_command_is_a_usage_error() -> None:
    res = _photon()
    assert res.returncode == 2
    assert "the following arguments are required: COMMAND" in res.stderr
    assert "Traceback" not in res.stderr


def test_generate_help_lists_vllm_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "engine arguments (vLLM names)" in out
    for flag in ENGINE_FLAGS:
        assert flag in out, flag
    for flag in ("--temperature", "--max-tokens", "--top-p", "--stop", "--json"):
        assert flag in out, flag


def test_generate_prints_prompt_and_completion(capsys: pytest.CaptureFixture[str],
                                               expected: tuple[str, list[int]]) -> None:
    out, err = _generate(capsys, PROMPT)
    text, _ = expected
    assert out == f"--- prompt: {PROMPT!r} [length, 8 tokens]\n{PROMPT}{text}\n"
    assert "[photon-tiny: RANDOM WEIGHTS - the text is meaningless]" in err


def test_generate_json(capsys: pytest.CaptureFixture[str],
                       expected: tuple[str, list[int]]) -> None:
    out, _ = _generate(capsys, "--json", PROMPT)
    lines = out.splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["prompt"] == PROMPT
    assert len(obj["completions"]) == 1
    completion = obj["completions"][0]
    assert len(completion["token_ids"]) == 8
    assert completion["finish_reason"] == "length"
    text, token_ids = expected
    assert completion["token_ids"] == token_ids
    assert completion["text"] == text


def test_generate_json_several_prompts_and_n(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = _generate(capsys, "--json", "--n", "2", "--temperature", "1", "--sampling-seed", "7",
                       "a", "b")
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["prompt"] for o in objs] == ["a", "b"]
    for o in objs:
        assert [len(c["token_ids"]) for c in o["completions"]] == [8, 8]


def test_no_pipelined_gives_same_tokens(capsys: pytest.CaptureFixture[str],
                                        expected: tuple[str, list[int]]) -> None:
    out, _ = _generate(capsys, "--json", "--no-pipelined", PROMPT)
    assert json.loads(out)["completions"][0]["token_ids"] == expected[1]


def test_seeded_sampling_is_reproducible_and_pipeline_independent(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--json", "--temperature", "1.0", "--sampling-seed", "123", PROMPT)
    runs = [json.loads(_generate(capsys, *args, *extra)[0])["completions"][0]["token_ids"]
            for extra in ((), (), ("--no-pipelined",))]
    assert runs[0] == runs[1] == runs[2]
    assert len(runs[0]) == 8


def test_console_script_subprocess(expected: tuple[str, list[int]]) -> None:
    """The README's command with default engine args, in a fresh process."""
    res = _photon("generate", "--temperature", "0", "--max-tokens", "8", "--json",
                  "--no-progress", PROMPT)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["completions"][0]["token_ids"] == expected[1]
    assert "RANDOM WEIGHTS" in res.stderr
