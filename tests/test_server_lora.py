"""LoRA adapters through the server (the engine core in its own process by default): the
request's `model` names an adapter (completions and chat equal LLM.generate with its
LoRARequest, greedy), /v1/models lists them with `parent`, adapters load and unload at run time
under load (an adapter in use is freed once its requests finish), every bad input gets its
error and the server goes on, the LoRA metrics, and several API servers see one registry."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from photon import LLM, LoRARequest, SamplingParams
from photon.server.errors import APIError
from photon.server.lora import AdapterNames
from tests.hf_models import make_engine_model
from tests.lora_util import make_adapter
from tests.server_util import (
    LiveServer,
    engine_paused,
    in_process_only,
    live_server,
    wait_drained,
    wait_until,
)

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NEW = 6
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              max_num_seqs=8, block_size=4)
PROMPTS = [[5, 17, 99, 300, 12], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("lora_server"))
    model = make_engine_model(os.path.join(root, "model"), "LlamaForCausalLM")
    paths = {name: make_adapter(model, os.path.join(root, name), rank, seed=i)
             for i, (name, rank) in enumerate((("a0", 2), ("a1", 4), ("big", 16)))}
    bad = os.path.join(root, "bad")
    os.mkdir(bad)
    with open(os.path.join(bad, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "PREFIX_TUNING", "r": 4}, f)
    paths["bad"] = bad
    paths["file"] = os.path.join(paths["a0"], "adapter_config.json")
    return dict(root=root, model=model, paths=paths)


@pytest.fixture(scope="module")
def reference(setup: dict[str, Any]) -> Iterator[dict[str | None, list[str]]]:
    """LLM.generate's greedy texts of PROMPTS (and of the chat prompt) per adapter."""
    llm = LLM(setup["model"], **ENGINE)
    paths = setup["paths"]
    loras = {None: None, "a0": LoRARequest("a0", 1, paths["a0"]),
             "a1": LoRARequest("a1", 2, paths["a1"])}
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    chat_ids = llm.engine.tokenizer.encode(llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True),
        add_special_tokens=False)
    out = {}
    for name, lora in loras.items():
        outs = llm.generate([*PROMPTS, chat_ids], params, use_tqdm=False, lora_request=lora)
        out[name] = [o.outputs[0].text for o in outs]
    yield out


@pytest.fixture(scope="module")
def server(setup: dict[str, Any]) -> Iterator[LiveServer]:
    args = {**ENGINE, "model": setup["model"],
            "lora_modules": [f"a0={setup['paths']['a0']}"]}
    with live_server(args, api_key=KEY) as live:
        yield live


def _post(live: LiveServer, path: str, body: dict[str, Any], auth: bool = True
          ) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, headers=AUTH if auth else {}, timeout=60)


def _complete(live: LiveServer, model: str, prompt: list[int]) -> httpx.Response:
    return _post(live, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0,
                                           "max_tokens": MAX_NEW, "ignore_eos": True})


def _text(live: LiveServer, model: str, prompt: list[int]) -> str:
    r = _complete(live, model, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def _load(live: LiveServer, name: str, path: str) -> httpx.Response:
    return _post(live, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def _unload(live: LiveServer, name: str) -> httpx.Response:
    return _post(live, "/v1/unload_lora_adapter", {"lora_name": name})


def test_completions_and_chat_by_adapter_name(server: LiveServer, reference: dict) -> None:
    base = server.app.state.config.served_model_name if server.app else None
    assert reference["a0"] != reference[None]  # the adapter changes the outputs
    for i, prompt in enumerate(PROMPTS):
        assert _text(server, "a0", prompt) == reference["a0"][i]
        if base is not None:
            assert _text(server, base, prompt) == reference[None][i]
    r = _post(server, "/v1/chat/completions", {
        "model": "a0", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "max_tokens": MAX_NEW, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "a0"
    assert r.json()["choices"][0]["message"]["content"] == reference["a0"][len(PROMPTS)]
    r = _post(server, "/tokenize", {"model": "a0", "prompt": "hi"})
    assert r.status_code == 200 and r.json()["count"] >= 1
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "hi"}).status_code == 404
    wait_drained(server.engine)


def test_without_enable_lora_adapters_are_refused() -> None:
    """No engine needed: without --enable-lora a load is a 400 naming the flag, and any model
    name but the base model's a 404."""
    names = AdapterNames(None, "base", enabled=False)  # type: ignore[arg-type]
    assert asyncio.run(names.resolve("base")) is None
    with pytest.raises(APIError) as e:
        asyncio.run(names.resolve("a0"))
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(APIError) as e:
        asyncio.run(names.load("a0", "/adapters/a0"))
    assert e.value.status == 400 and "--enable-lora" in e.value.message


def test_models_lists_adapters_with_parent(server: LiveServer, setup: dict) -> None:
    r = httpx.get(server.api_url + "/models", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    cards = {c["id"]: c for c in r.json()["data"]}
    base = next(c for c in cards.values() if c["parent"] is None)
    assert cards["a0"]["parent"] == base["id"]
    assert cards["a0"]["root"] == setup["paths"]["a0"]
    assert set(cards) == {base["id"], "a0"}


def test_bad_inputs_get_their_errors(server: LiveServer, setup: dict) -> None:
    paths = setup["paths"]
    cases = [  # (body, status, what the message says)
        ({"lora_name": "x", "lora_path": os.path.join(setup["root"], "nowhere")}, 404,
         "no adapter found"),
        ({"lora_name": "x", "lora_path": paths["file"]}, 400, "is not a directory"),
        ({"lora_name": "x", "lora_path": paths["bad"]}, 400, "peft_type"),
        ({"lora_name": "x", "lora_path": paths["big"]}, 400, "max_lora_rank"),
        ({"lora_name": "a0", "lora_path": paths["a1"]}, 400, "already been loaded"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "", "lora_path": paths["a1"]}, 400, "must be provided"),
    ]
    for body, status, words in cases:
        r = _post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    if server.app is not None:
        base = server.app.state.config.served_model_name
        r = _load(server, base, paths["a1"])
        assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    r = _unload(server, "nope")
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["a1"]},
              auth=False)
    assert r.status_code == 401
    r = _complete(server, "nope", PROMPTS[0])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # Nothing was registered by the refused loads, and the server goes on.
    models = httpx.get(server.api_url + "/models", headers=AUTH, timeout=30).json()["data"]
    assert {c["id"] for c in models if c["parent"] is not None} == {"a0"}
    assert _complete(server, "a0", PROMPTS[0]).status_code == 200
    wait_drained(server.engine)


def _stream(live: LiveServer, model: str, prompt: list[int], out: list[str]) -> None:
    """A streamed completion; appends its text (or the error status) to `out`."""
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": MAX_NEW,
            "ignore_eos": True, "stream": True}
    text = ""
    with httpx.stream("POST", live.api_url + "/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        if r.status_code != 200:
            out.append(f"status {r.status_code}")
            return
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    out.append(text)


def test_load_and_unload_under_load(server: LiveServer, setup: dict, reference: dict) -> None:
    """a1 is loaded while requests run, used, then unloaded while a request on it is queued:
    new requests for a1 get 404 at once, the queued one finishes with a1's output, and a1's
    slot and host copy are freed after it (the drain check)."""
    engine = server.engine
    # Loads and unloads while requests run: they keep their outputs.
    outs: list[str] = []
    busy = [threading.Thread(target=_stream, args=(server, model, PROMPTS[0], outs))
            for model in ("a0", "a0", "a0", "a0")]
    for t in busy:
        t.start()
    for _ in range(2):
        assert _load(server, "a1", setup["paths"]["a1"]).status_code == 200
        assert _unload(server, "a1").status_code == 200
    for t in busy:
        t.join(60)
    assert outs == [reference["a0"][0]] * 4
    results: dict[str, list[str]] = {"a0": [], "a1": []}
    with engine_paused(engine) as gate:
        busy = [threading.Thread(target=_stream, args=(server, "a0", PROMPTS[0], results["a0"]))
                for _ in range(3)]
        for t in busy:
            t.start()
        assert _load(server, "a1", setup["paths"]["a1"]).status_code == 200
        running = threading.Thread(target=_stream,
                                   args=(server, "a1", PROMPTS[1], results["a1"]))
        running.start()
        wait_until(lambda: engine.counters.num_waiting >= 4, "the requests are queued")
        r = _unload(server, "a1")
        assert r.status_code == 200 and "removed successfully" in r.text
        assert _complete(server, "a1", PROMPTS[0]).status_code == 404
        gate.set()
        for t in [*busy, running]:
            t.join(60)
    assert results["a0"] == [reference["a0"][0]] * 3
    assert results["a1"] == [reference["a1"][1]]
    wait_drained(server.engine)  # includes: the unloaded adapter's slot and host copy are free
    # Loaded again under the same name: a new adapter (a new id), served as before.
    assert _load(server, "a1", setup["paths"]["a1"]).status_code == 200
    assert _text(server, "a1", PROMPTS[1]) == reference["a1"][1]
    assert _unload(server, "a1").status_code == 200
    wait_drained(server.engine)


def _metrics(live: LiveServer) -> str:
    return httpx.get(live.base_url + "/metrics", timeout=30).text


def test_lora_metrics(server: LiveServer) -> None:
    """vLLM's lora_requests_info names the waiting request's adapter, and the slot series."""
    waiting = '{max_lora="2",running_lora_adapters="",waiting_lora_adapters="a0"}'
    idle = '{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    with engine_paused(server.engine) as gate:
        done: list[str] = []
        t = threading.Thread(target=_stream, args=(server, "a0", PROMPTS[0], done))
        t.start()
        wait_until(lambda: waiting in _metrics(server), "the metrics show the waiting adapter")
        gate.set()
        t.join(60)
    assert len(done) == 1 and not done[0].startswith("status")
    wait_until(lambda: idle in _metrics(server), "the metrics show no adapter in use")
    text = _metrics(server)
    loads = [line for line in text.splitlines() if line.startswith("photon:lora_slot_loads")]
    assert loads and float(loads[0].split()[-1]) >= 1
    assert "photon:lora_slots_loaded" in text


def test_every_front_end_sees_one_registry(server: LiveServer, setup: dict,
                                           reference: dict) -> None:
    """A second front end of the same core (as another API server is) sees what the server
    loaded and unloaded, and the server sees what the other one did."""
    other = AdapterNames(server.engine, "base", enabled=True)
    assert _load(server, "a1", setup["paths"]["a1"]).status_code == 200
    lora = asyncio.run(other.resolve("a1"))
    assert lora is not None and lora.lora_path == setup["paths"]["a1"]
    asyncio.run(other.unload("a1"))
    assert _complete(server, "a1", PROMPTS[0]).status_code == 404
    asyncio.run(other.load("a1", setup["paths"]["a1"]))
    assert _text(server, "a1", PROMPTS[1]) == reference["a1"][1]
    asyncio.run(other.unload("a1"))
    wait_drained(server.engine)


def test_a_request_racing_an_unload_gets_404(server: LiveServer, setup: dict,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Another API server unloads a1 while this server's copy of the names still has it (one
    message late; pinned here): the core refuses the request, and the client gets the 404 of
    an unknown model, streamed or not; the server goes on."""
    in_process_only()
    names = server.app.state.serving.adapters
    assert _load(server, "a1", setup["paths"]["a1"]).status_code == 200

    async def stale() -> None:  # this server never hears of the unload
        pass

    monkeypatch.setattr(names, "refresh", stale)
    other = AdapterNames(server.engine, "base", enabled=True)
    asyncio.run(other.unload("a1"))
    error = {"message": "The model `a1` does not exist.", "type": "invalid_request_error",
             "param": "model", "code": "model_not_found"}
    r = _complete(server, "a1", PROMPTS[0])
    assert (r.status_code, r.json()) == (404, {"error": error})
    body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", server.api_url + "/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        r.read()
        assert (r.status_code, r.json()) == (404, {"error": error})
    monkeypatch.undo()
    assert _text(server, "a0", PROMPTS[0]) is not None
    wait_drained(server.engine)
