"""--generation-config: the model's generation_config.json gives the defaults of what a request
leaves unset (offline, `photon generate` and the server); `vllm` ignores it; a folder replaces it."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from photon import LLM, SamplingParams
from photon.cli import main
from photon.config import ConfigError
from photon.engine_args import EngineArgs
from photon.model.tiny import ensure_photon_tiny_random
from photon.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_util import LiveServer, in_process_only, live_server

MODEL_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                  "repetition_penalty": 1.1, "max_new_tokens": 7}
PHOTON_DEFAULTS = SamplingParams()
PROMPT = [5, 17, 42, 99, 7]


def model_with(tmp_path: Path, name: str, **fields: Any) -> Path:
    """photon-tiny with `fields` added to its generation_config.json."""
    dst = tmp_path / name
    shutil.copytree(ensure_photon_tiny_random(), dst)
    write_generation_config(dst, **fields)
    return dst


def write_generation_config(folder: Path, **fields: Any) -> None:
    path = folder / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **fields}))


def defaults_of(model: Path, setting: str = "auto") -> dict[str, Any]:
    config = EngineArgs(model=str(model), generation_config=setting).create_config()
    return config.model.generation_defaults.as_kwargs()


def test_auto_vllm_and_folder(tmp_path: Path) -> None:
    model = model_with(tmp_path, "model", do_sample=True, **MODEL_DEFAULTS)
    expected = {**MODEL_DEFAULTS, "max_tokens": 7}
    del expected["max_new_tokens"]
    assert defaults_of(model) == expected
    assert defaults_of(model, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, temperature=0.3, max_new_tokens=2, eos_token_id=1)
    assert defaults_of(model, str(other)) == {"temperature": 0.3, "max_tokens": 2}
    # photon-tiny's own file sets no sampling field.
    assert defaults_of(Path(ensure_photon_tiny_random())) == {}


def test_bad_generation_config(tmp_path: Path) -> None:
    model = model_with(tmp_path, "model")
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=re.escape(f"{missing!r} is not a folder")):
        defaults_of(model, missing)
    with pytest.raises(ConfigError, match="has no generation_config.json"):
        defaults_of(model, str(tmp_path))
    bad = model_with(tmp_path, "bad", temperature=-1)
    with pytest.raises(ConfigError, match=r"bad/generation_config\.json: temperature: "
                                          r"temperature must be a number in \[0, 100\]"):
        defaults_of(bad)
    bad_length = model_with(tmp_path, "bad-length", max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"max_new_tokens: max_tokens must be an integer >= 1"):
        defaults_of(bad_length)


def test_offline_defaults_apply_only_without_sampling_params(tmp_path: Path) -> None:
    model = model_with(tmp_path, "model", temperature=0.0, max_new_tokens=5)
    llm = LLM(str(model), max_model_len=64)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.max_tokens) == (0.0, 5)
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(temperature=0.0, max_tokens=5)
    assert out.token_ids == llm.generate([PROMPT], explicit, use_tqdm=False)[0].outputs[0].token_ids
    # Given SamplingParams are used as they are (vLLM): photon's max_tokens=16, not the model's 5.
    given = llm.generate([PROMPT], SamplingParams(ignore_eos=True, seed=1), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 16
    vllm = LLM(str(model), max_model_len=64, generation_config="vllm")
    assert vllm.get_default_sampling_params() == PHOTON_DEFAULTS


def generated(capsys: pytest.CaptureFixture[str], *args: str) -> list[int]:
    code = main(["generate", "--no-progress", "--json", "--ignore-eos", "--max-model-len", "64",
                 *args, "hello"])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)["completions"][0]["token_ids"]


def test_cli_generate_flags_win_over_model_defaults(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = str(model_with(tmp_path, "model", temperature=0.0, max_new_tokens=3))
    main(["generate", "--no-progress", "--max-model-len", "64", "--model", model, "hello"])
    assert "[model: default sampling parameters from generation_config.json: temperature=0.0, " \
           "max_tokens=3 (--generation-config vllm ignores them)]" in capsys.readouterr().err
    greedy = generated(capsys, "--model", model)
    assert len(greedy) == 3
    assert generated(capsys, "--model", model, "--temperature", "0") == greedy
    assert len(generated(capsys, "--model", model, "--max-tokens", "5")) == 5
    assert len(generated(capsys, "--model", model, "--generation-config", "vllm")) == 16


# ---- server -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = model_with(tmp_path_factory.mktemp("gen"), "model", **MODEL_DEFAULTS)
    with live_server({"model": str(model), "max_model_len": 64}) as s:
        yield s


def params_for(server: LiveServer, req: CompletionRequest | ChatCompletionRequest
               ) -> SamplingParams:
    """What the server makes of a request (the same conversion the handlers call)."""
    in_process_only()
    serving = server.app.state.serving
    if isinstance(req, CompletionRequest):
        return serving.sampling_params(req, req.max_tokens, req.logprobs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    return serving.sampling_params(req, max_tokens, None)


def sampled(p: SamplingParams) -> tuple[Any, ...]:
    return p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.max_tokens


MODEL_SAMPLED = (0.6, 20, 0.95, 0.05, 1.1, 7)


def test_server_fills_unset_fields_from_the_model(server: LiveServer) -> None:
    assert sampled(params_for(server, CompletionRequest(prompt="x"))) == MODEL_SAMPLED
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert sampled(params_for(server, ChatCompletionRequest(**chat))) == MODEL_SAMPLED
    # Explicit null is unset, as in vLLM.
    req = CompletionRequest(prompt="x", temperature=None, max_tokens=None)
    assert sampled(params_for(server, req)) == MODEL_SAMPLED


def test_server_request_values_win(server: LiveServer) -> None:
    req = CompletionRequest(prompt="x", temperature=0.2, top_k=-1, max_tokens=3)
    assert sampled(params_for(server, req)) == (0.2, 0, 0.95, 0.05, 1.1, 3)
    req = CompletionRequest(prompt="x", top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    assert sampled(params_for(server, req)) == (0.6, 20, 1.0, 0.0, 1.0, 7)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert params_for(server, ChatCompletionRequest(**chat, max_completion_tokens=4)) \
        .max_tokens == 4
    assert params_for(server, ChatCompletionRequest(**chat, max_tokens=5)).max_tokens == 5


def test_server_http(server: LiveServer) -> None:
    """Over HTTP: no max_tokens -> the model's 7; an explicit one wins."""
    url = server.api_url + "/completions"
    body = {"prompt": PROMPT, "ignore_eos": True, "seed": 3}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    r = httpx.post(url, json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_model_max_tokens_is_a_cap(tmp_path: Path) -> None:
    """The model's max_new_tokens larger than the context leaves is shortened (as vLLM), where
    the same request's own too-large max_tokens is a 400."""
    model = model_with(tmp_path, "model", max_new_tokens=1000)
    with live_server({"model": str(model), "max_model_len": 32}) as s:
        body = {"prompt": PROMPT, "ignore_eos": True, "temperature": 0}
        r = httpx.post(s.api_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32 - 5
        r = httpx.post(s.api_url + "/completions", json={**body, "max_tokens": 999}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
