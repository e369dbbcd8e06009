"""The `photon` command line: help texts, plain and JSON output, and agreement with the Python API."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from photon import LLM, SamplingParams
from photon.cli import main
from photon.outputs import Logprob

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
    code = main(["generate", "--no-progress", "--model", "photon-tiny-random", "--temperature",
                 "0", "--max-tokens", "8", "--max-model-len", "64", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


@pytest.fixture(scope="module")
def expected() -> tuple[str, list[int]]:
    """Greedy reference from the Python API (the CLI must print the same)."""
    out = LLM("photon-tiny-random", max_model_len=64).generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
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
    assert "[photon-tiny-random: RANDOM WEIGHTS - the text is meaningless]" in err


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


def test_console_script_subprocess() -> None:
    """The README's command with default engine args, in a fresh process: the default model is
    the trained photon-tiny, so no random-weights label, and the tokens are the Python API's."""
    params = SamplingParams(temperature=0, max_tokens=8)
    want = LLM(max_model_len=64).generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    res = _photon("generate", "--temperature", "0", "--max-tokens", "8", "--json",
                  "--no-progress", PROMPT)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["completions"][0]["token_ids"] == want.token_ids
    assert "RANDOM WEIGHTS" not in res.stderr


# ---------------------------------------------------------------- logprobs


@pytest.fixture(scope="module")
def expected_logprobs() -> tuple[list[int], list[dict[int, Logprob]], float]:
    """Greedy reference with 3 top logprobs per token from the Python API."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    (completion,) = LLM("photon-tiny-random", max_model_len=64).generate(PROMPT, params, use_tqdm=False)[0].outputs
    return completion.token_ids, completion.logprobs, completion.cumulative_logprob


def test_generate_json_prints_logprobs(capsys: pytest.CaptureFixture[str],
                                       expected_logprobs: tuple) -> None:
    token_ids, entries, cumulative = expected_logprobs
    out, _ = _generate(capsys, "--json", "--logprobs", "3", PROMPT)
    (completion,) = json.loads(out)["completions"]
    assert completion["token_ids"] == token_ids
    assert completion["cumulative_logprob"] == pytest.approx(cumulative)
    rows = completion["logprobs"]
    assert [r["token_id"] for r in rows] == token_ids
    for row, entry in zip(rows, entries):
        assert row["logprob"] == pytest.approx(entry[row["token_id"]].logprob)
        assert row["rank"] == entry[row["token_id"]].rank == 1  # greedy
        top = row["top_logprobs"]
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert [(t["token_id"], t["logprob"], t["rank"]) for t in top] == [
            (tid, pytest.approx(lp.logprob), i) for i, (tid, lp) in enumerate(best, start=1)]
        assert top[0]["token_id"] == row["token_id"]  # greedy: the sampled token is the best
        assert all(isinstance(t["token"], str) for t in top)
    assert sum(r["logprob"] for r in rows) == pytest.approx(cumulative, abs=1e-4)


def test_generate_text_prints_logprobs(capsys: pytest.CaptureFixture[str],
                                       expected_logprobs: tuple) -> None:
    from photon.model.tiny import ensure_photon_tiny_random
    from photon.tokenizer import Tokenizer

    token_ids, entries, cumulative = expected_logprobs
    out, _ = _generate(capsys, "--logprobs", "2", PROMPT)
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("--- logprobs"))
    assert lines[start] == (f"--- logprobs (cumulative {cumulative:.4f}): sampled token, "
                            "then the top 2")
    rows = lines[start + 1:]
    assert len(rows) == len(token_ids) == 8
    tok = Tokenizer.from_pretrained(ensure_photon_tiny_random())
    for i, (row, tid, entry) in enumerate(zip(rows, token_ids, entries)):
        fields = row.split()
        assert fields[0] == str(i)
        assert repr(tok.decode([tid], skip_special_tokens=False)) in row
        assert f"{entry[tid].logprob:.4f}" in row
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:2]
        assert row.endswith(f"{best[-1][1].logprob:.4f}")


# ---------------------------------------------------------------- --chat


def test_generate_chat_prints_the_templated_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM("photon-tiny-random", max_model_len=64)
    tok = llm.get_tokenizer()
    templated = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    assert templated != PROMPT and PROMPT in templated
    ids = tok.encode(templated, add_special_tokens=False)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    completion = ref[0].outputs[0]

    out, _ = _generate(capsys, "--json", "--chat", PROMPT)
    obj = json.loads(out)
    assert obj["prompt"] == templated  # what the model saw, as vLLM's RequestOutput.prompt
    assert obj["messages"] == [{"role": "user", "content": PROMPT}]
    assert obj["completions"][0]["token_ids"] == completion.token_ids

    out, _ = _generate(capsys, "--chat", PROMPT)
    header = f"--- prompt: {PROMPT!r} (chat template applied) [length, 8 tokens]"
    assert out == f"{header}\n{templated}{completion.text}\n"


# ---------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(("argv", "prefix", "says"), [
    (["generate", "--bogus-flag", "hi"], "photon generate",
     "unrecognized arguments: --bogus-flag"),
    (["generate", "--max-tokens", "abc", "hi"], "photon generate",
     "argument --max-tokens: invalid int value: 'abc'"),
    (["generate"], "photon generate", "the following arguments are required: PROMPT"),
    (["bench", "serve", "--num-prompts", "x"], "photon bench serve",
     "argument --num-prompts: invalid int value: 'x'"),
    (["bench", "throughput", "--bogus"], "photon bench throughput",
     "unrecognized arguments: --bogus"),
    (["bench", "bubble", "--model-shape", "huge"], "photon bench bubble",
     "argument --model-shape: invalid choice: 'huge'"),
    (["bench"], "photon bench", "the following arguments are required: BENCHMARK"),
    (["serve", "--port", "eighty"], "photon serve", "argument --port: invalid int value"),
])
def test_usage_errors_are_one_line(argv: list[str], prefix: str, says: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"{prefix}: error: {says}"), line
    assert line.endswith(f"(see `{prefix} --help`)")


def test_usage_error_in_a_fresh_process_is_one_line() -> None:
    res = _photon("generate", "--max-tokens", "abc", "hi")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "photon generate: error: argument --max-tokens: invalid int value: 'abc' "
        "(see `photon generate --help`)"]


def test_runtime_error_names_the_innermost_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--num-prompts", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "photon bench throughput: error: --num-prompts must be positive, got 0"]


# ---------------------------------------------------------------- --help


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # one line: wrapping does not matter


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "throughput"]])
def test_help_shows_engine_defaults_and_choices(command: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, *command)
    for shown in ("--max-num-seqs MAX_NUM_SEQS Most requests in one step. (default: 256)",
                  "(weights + activations + KV cache). (default: 0.9)",
                  "--block-size BLOCK_SIZE Tokens per KV-cache block. (default: 16)",
                  "(default: 8192)", "(default: --pipelined)", "(default: --enable-prefix-caching)",
                  "--dtype {auto,float32,float,bfloat16,float16,half}",
                  "--device {auto,cuda,cpu}", "--load-format {auto,dummy}",
                  "--structured-outputs-worker {process,inline}",
                  "--structured-outputs-mask-wait {device,host}"):
        assert shown in text, shown


def test_help_describes_structured_outputs_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "generate")
    section = text[text.index("--structured-outputs-backend"):]
    for internal in ("fence", "batch call", "rows dealt", "matchers", "mask words"):
        assert internal not in section, internal
    assert "JSON schema, regex, choice list or grammar" in section
    assert "Outputs are the same." in section


def test_help_of_bench_options_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "bench", "structured")
    assert "--batch-sizes BATCH_SIZES [BATCH_SIZES ...] Batch sizes B to time. (default: 32 128)" \
        in text
    assert "--model-shape {qwen3-0.6b,llama-3.1-8b,qwen3-30b-a3b,tiny}" in text
    text = _help(capsys, "bench", "serve")
    assert "--random-input-len RANDOM_INPUT_LEN Prompt tokens of a random request. " \
           "(default: 1024)" in text
