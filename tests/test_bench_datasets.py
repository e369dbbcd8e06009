"""`photon bench serve` datasets: ShareGPT as vLLM reads it, flag errors, chat prompts sized to
their token length against a live photon-tiny server (CPU)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from photon.bench.datasets import load_sharegpt, sample_sharegpt
from photon.bench.serve_workload import random_requests
from photon.cli import main
from tests.server_util import live_server

CHAT = "/v1/chat/completions"


class WordTokenizer:
    """One token per whitespace-separated word."""

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))

    async def decode(self, ids: Sequence[int]) -> str:
        return " ".join("w" for _ in ids)

    async def chat_len(self, content: str) -> int:
        return len(content.split()) + 2


def _words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def _entry(i: int, prompt_words: int, reply_words: int) -> dict[str, Any]:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": _words(prompt_words, f"p{i}_")},
        {"from": "gpt", "value": _words(reply_words, "r")},
        {"from": "human", "value": "a later turn is never used"}]}


def _sharegpt_file(tmp_path: Path) -> Path:
    good = [_entry(i, 4 + i, 5 + 2 * i) for i in range(6)]  # c0..c5 pass the filter
    rejected = [_entry(10, 3, 10),       # prompt under 4 tokens
                _entry(11, 10, 3),       # reply under 4 tokens (kept with a fixed output length)
                _entry(12, 1025, 10),    # prompt over 1024 tokens
                _entry(13, 1000, 1049)]  # prompt + reply over 2048 tokens
    odd = [{"id": "one-turn", "conversations": [{"from": "human", "value": "alone here ok"}]},
           {"id": "gpt-first", "conversations": [
               {"from": "gpt", "value": "a greeting the model sent first"},
               {"from": "human", "value": _words(6, "q")},
               {"from": "gpt", "value": _words(9, "r")}]},
           {"id": "no-conversations"}, "not an object"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(good + rejected + odd))
    return path


def _sample(path: Path, num: int, output_len: int | None, seed: int) -> list[Any]:
    pairs = load_sharegpt(str(path), seed)
    return asyncio.run(sample_sharegpt(pairs, WordTokenizer(), num, output_len, seed))


def _vllm_order(path: Path, seed: int) -> list[str]:
    """Entry ids in the order vLLM visits them: >= 2 turns, then random.seed(seed); shuffle."""
    entries = [e for e in json.loads(path.read_text())
               if isinstance(e, dict) and len(e.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(entries)
    return [e["id"] for e in entries]


def _ids(specs: list[Any]) -> list[str]:
    """The entry of each request, from its prompt's words (p3_0 ... -> c3; q0 ... -> gpt-first)."""
    return ["gpt-first" if s.prompt.startswith("q") else "c" + s.prompt.split("_")[0][1:]
            for s in specs]


def test_sharegpt_prompts_output_lengths_filter_and_seeded_order(tmp_path: Path) -> None:
    path = _sharegpt_file(tmp_path)
    specs = _sample(path, 7, None, seed=3)
    kept = {f"c{i}" for i in range(6)} | {"gpt-first"}
    assert _ids(specs) == [i for i in _vllm_order(path, 3) if i in kept]
    for spec in specs:
        name = _ids([spec])[0]
        i = int(name[1:]) if name != "gpt-first" else None
        expected = (6, 9) if i is None else (4 + i, 5 + 2 * i)
        assert (spec.prompt_len, spec.output_len) == expected
        assert len(spec.prompt.split()) == spec.prompt_len
    assert _ids(_sample(path, 7, None, seed=3)) == _ids(specs)  # seeded: the same order again
    assert _ids(_sample(path, 7, None, seed=4)) != _ids(specs)
    # The first human turn is the prompt even after a gpt turn; later turns are never used.
    assert next(s for s in specs if s.prompt.startswith("q")).prompt == _words(6, "q")


def test_sharegpt_output_len_override_and_oversampling(tmp_path: Path) -> None:
    path = _sharegpt_file(tmp_path)
    fixed = _sample(path, 100, 7, seed=0)
    # A fixed output length skips the reply checks: c11's short reply and c13's long one pass;
    # c10's short prompt and c12's long one still do not.
    assert {s.output_len for s in fixed} == {7}
    first = _ids(fixed[:9])
    assert first == [i for i in _vllm_order(path, 0) if i not in ("c10", "c12")]
    assert set(_ids(fixed[9:])) <= set(first) and len(fixed) == 100  # topped up from the sample
    assert _ids(_sample(path, 2, None, seed=0)) == _ids(_sample(path, 8, None, seed=0))[:2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line usage error of `photon bench serve ARGV` (nothing listens at its URL)."""
    url = f"http://127.0.0.1:{_free_port()}"
    assert main(["bench", "serve", "--base-url", url, *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # progress lines, then the error
    assert lines[-1].startswith("photon bench serve: error: ")
    assert not any("Traceback" in line or "error:" in line for line in lines[:-1])
    return lines[-1]


@pytest.mark.parametrize(("content", "says"), [
    (None, "--dataset-path: no such file: "),
    ("{not json", "not valid JSON"),
    ('{"conversations": []}', "expected a JSON list of ShareGPT entries"),
    ('[{"id": "x", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "gpt", '
     '"value": "there"}]}]', "no ShareGPT conversation with a 'human' turn"),
    ('[{"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", '
     '"value": "there"}]}]', "no ShareGPT conversation passes the length filter"),
])
def test_bad_sharegpt_files(content: str | None, says: str, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    argv = ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--tokenizer"]
    from photon.model.tiny import ensure_photon_tiny_random

    assert says in _error(capsys, *argv, ensure_photon_tiny_random(), "--model", "m",
                          "--random-vocab-size", "100")


@pytest.mark.parametrize(("argv", "says"), [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path FILE"),
    (["--dataset-path", "x.json"], "--dataset-path is read only with --dataset-name sharegpt, "
                                   "not random"),
    (["--dataset-name", "standard", "--dataset-path", "x.json"], "not standard"),
    (["--dataset", "standard", "--dataset-name", "random"], "not both"),
    (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--sharegpt-output-len", "0"],
     "--sharegpt-output-len must be positive, got 0"),
    (["--dataset", "missing.jsonl"], "--dataset: no such file: missing.jsonl"),
])
def test_bad_dataset_flags(argv: list[str], says: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    assert says in _error(capsys, *argv, "--model", "m", "--random-vocab-size", "100")


def test_chat_prompts_shorter_than_the_template_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    from photon.model.tiny import ensure_photon_tiny_random

    line = _error(capsys, "--endpoint", CHAT, "--random-input-len", "6", "--tokenizer",
                  ensure_photon_tiny_random(), "--model", "m", "--random-vocab-size", "100")
    assert line.endswith("chat prompts of 6 tokens are too short: the chat template alone is 9 "
                         "tokens; ask for more (--random-input-len)")


def test_unknown_dataset_name_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's own error
        main(["bench", "serve", "--dataset-name", "sonnet"])
    assert exc.value.code == 2
    assert "choose from 'random', 'sharegpt', 'standard'" in capsys.readouterr().err


# ---------------------------------------------------------------- against photon-tiny


def _run(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> dict[str, Any]:
    code = main(["bench", "serve", "--base-url", url, "--save-requests", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_chat_prompts_have_exactly_the_requested_tokens(
        capsys: pytest.CaptureFixture[str]) -> None:
    from photon.model.tiny import ensure_photon_tiny_random

    asked = [len(s.prompt) for s in random_requests(12, 60, 2, 0.6, 1024, seed=5)]
    argv = ["--endpoint", CHAT, "--num-prompts", "12", "--random-input-len", "60",
            "--random-output-len", "2", "--random-range-ratio", "0.6", "--seed", "5"]
    with live_server() as srv:
        runs = [_run(capsys, srv.base_url, *argv),  # counted by the server's /tokenize
                _run(capsys, srv.base_url, *argv, "--tokenizer", ensure_photon_tiny_random())]
    for s in runs:
        assert (s["completed"], s["failed"]) == (12, 0)
        assert [r["prompt_tokens"] for r in s["requests"]] == asked  # the server's usage
        assert s["mean_input_tokens"] == pytest.approx(sum(asked) / 12)
        assert s["median_input_tokens"] == statistics.median(asked)


def test_sharegpt_against_a_live_server(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from photon.model.tiny import ensure_photon_tiny_random
    from photon.tokenizer import Tokenizer

    texts = ["the model reads this prompt", "please write a short story about a cat",
             "what is the capital of France?", "list three prime numbers", "hi"]
    data = [{"id": str(i), "conversations": [{"from": "human", "value": t},
                                             {"from": "gpt", "value": t + " and so on"}]}
            for i, t in enumerate(texts)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tok = Tokenizer.from_pretrained(ensure_photon_tiny_random())
    argv = ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4",
            "--sharegpt-output-len", "3", "--seed", "1"]
    with live_server() as srv:
        s = _run(capsys, srv.base_url, *argv)
    order = [texts[int(e["id"])] for e in data]
    random.Random(1).shuffle(order)
    kept = [t for t in order if len(tok.encode(t)) >= 4][:4]
    assert [r["prompt_tokens"] for r in s["requests"]] == [len(tok.encode(t)) for t in kept]
    assert [r["output_tokens"] for r in s["requests"]] == [3] * 4
    assert (s["dataset_name"], s["dataset_path"], s["sharegpt_output_len"]) == \
        ("sharegpt", str(path), 3)
