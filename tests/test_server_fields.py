"""Sampling fields through the live server: logit_bias, echo / prompt_logprobs (lm-eval's
loglikelihood request), best_of, vLLM's guided_* aliases, and a 400 for every known field photon
does not implement."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from photon import LLM, SamplingParams
from photon.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_util import LiveServer, live_server, openai_client

MODEL = "photon-tiny-random"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as s:
        yield s


def _prompt_ids(server: LiveServer, text: str) -> list[int]:
    return server.engine.frontend.tokenizer.encode(text)


def _reference_prompt_logprobs(ids: list[int]) -> list[dict]:
    out = LLM("photon-tiny-random", max_model_len=256, seed=0).generate(
        [ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return out.prompt_logprobs


def test_echo_max_tokens_0_returns_the_prompt_logprobs(server: LiveServer) -> None:
    client = openai_client(server)
    """lm-eval's loglikelihood request: the prompt, its tokens' logprobs (None first), top-1."""
    ids = _prompt_ids(server, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1,
                                  max_tokens=0, temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPT
    lp = choice.logprobs
    tok = server.engine.frontend.tokenizer
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _reference_prompt_logprobs(ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i][ids[i]].logprob, abs=1e-4)
        (top_text, top_lp), = lp.top_logprobs[i].items()
        best = min(ref[i].values(), key=lambda e: e.rank)
        assert top_lp == pytest.approx(best.logprob, abs=1e-4) and best.rank == 1
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(PROMPT) - len(lp.tokens[-1])
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


def test_echo_with_generation_prepends_the_prompt(server: LiveServer) -> None:
    client = openai_client(server)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logprobs=2, echo=True, extra_body={"ignore_eos": True})
    n = len(_prompt_ids(server, PROMPT))
    assert echo.choices[0].text == PROMPT + plain.choices[0].text
    assert echo.choices[0].logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
    assert echo.choices[0].logprobs.token_logprobs[n:] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs)
    assert len(echo.choices[0].logprobs.tokens) == n + 4
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == echo.choices[0].text


def test_prompt_logprobs_field(server: LiveServer) -> None:
    client = openai_client(server)
    ids = _prompt_ids(server, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_logprobs": 0})
    got = r.choices[0].model_extra["prompt_logprobs"]
    ref = _reference_prompt_logprobs(ids)
    assert got[0] is None and len(got) == len(ids)
    for tid, entry, want in zip(ids[1:], got[1:], ref[1:]):  # prompt_logprobs=0: the token only
        (e,) = entry.values()
        assert list(entry) == [str(tid)] and e["rank"] == want[tid].rank
        assert e["logprob"] == pytest.approx(want[tid].logprob, abs=1e-4)
        assert e["decoded_token"] == want[tid].decoded_token


def test_logit_bias_forces_and_bans(server: LiveServer) -> None:
    client = openai_client(server)
    tok = server.engine.frontend.tokenizer
    (forced_id,) = tok.encode("A")
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == "AAA"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == "AA"
    greedy = LLM("photon-tiny-random", max_model_len=256, seed=0).generate(
        [_prompt_ids(server, PROMPT)], SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(greedy): -100})
    assert banned.choices[0].text != tok.decode([greedy])


@pytest.mark.parametrize(("bias", "message"), [
    ({"x": 1}, "logit_bias keys must be token ids"),
    ({"-1": 1}, "logit_bias keys must be token ids"),
    ({"99999999": 1}, "outside the vocabulary"),
    ({"5": 100.5}, "logit_bias values must be numbers in [-100, 100]"),
    ({str(i): 1 for i in range(1025)}, "at most 1024"),
])
def test_bad_logit_bias_is_400(server: LiveServer, bias: dict, message: str) -> None:
    r = httpx.post(server.api_url + "/completions",
                   json={"prompt": "hi", "max_tokens": 1, "logit_bias": bias}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == "logit_bias"


def _unsupported(model: type) -> list[tuple[str, object]]:
    """A value asking for something, per known unimplemented field."""
    return [(name, {"x": 1} if not neutral or not isinstance(neutral[0], (bool, int, float, str,
                                                                          list))
             else _other(neutral[0])) for name, neutral in model.UNSUPPORTED.items()]


def _other(neutral: object) -> object:
    if isinstance(neutral, bool):
        return not neutral
    if isinstance(neutral, (int, float)):
        return neutral + 1
    if isinstance(neutral, str):
        return "flex"
    return ["audio"]


@pytest.mark.parametrize(("field", "value"), _unsupported(CompletionRequest))
def test_unimplemented_completion_field_is_400(server: LiveServer, field: str,
                                               value: object) -> None:
    r = httpx.post(server.api_url + "/completions",
                   json={"prompt": "hi", "max_tokens": 1, field: value}, timeout=60)
    assert r.status_code == 400, (field, r.text)
    err = r.json()["error"]
    assert err["param"] == field and f"`{field}` is not supported by photon" in err["message"]


def test_chat_prompt_logprobs_is_400(server: LiveServer) -> None:
    r = httpx.post(server.api_url + "/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize(("field", "value"), _unsupported(ChatCompletionRequest))
def test_unimplemented_chat_field_is_400(server: LiveServer, field: str, value: object) -> None:
    r = httpx.post(server.api_url + "/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                         field: value}, timeout=60)
    assert r.status_code == 400, (field, r.text)
    assert r.json()["error"]["param"] == field


def test_neutral_values_and_unknown_fields_pass(server: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "use_beam_search": False, "best_of": 1,
            "spaces_between_special_tokens": True, "priority": 0, "store": False,
            "length_penalty": 1.0, "some_future_field": {"a": 1}, "user": "u"}
    r = httpx.post(server.api_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_best_of_above_1_is_400(server: LiveServer) -> None:
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="best_of") as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=2, best_of=3)
    assert e.value.body["param"] == "best_of"


def test_guided_aliases_map_onto_structured_outputs(server: LiveServer) -> None:
    client = openai_client(server)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["red", "green"]})
    assert r.choices[0].text in ("red", "green")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "n"}],
                                       max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(r.choices[0].message.content) == 3 and r.choices[0].message.content.isdigit()
    with pytest.raises(openai.BadRequestError, match="give only one of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={
            "guided_choice": ["a"], "guided_regex": "a"})
