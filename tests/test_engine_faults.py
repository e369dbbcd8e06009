"""No single request can stop the engine: a value that cannot be staged fails that request only,
and an exception out of `LLM.generate` leaves nothing of its requests behind."""

from __future__ import annotations

import os
import signal

import pytest

from photon import LLM, SamplingParams
from photon.core.step import NewRequest
from photon.engine.engine_core import EngineCore
from photon.outputs import RequestOutput
from photon.worker.request_table import RequestTable

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = {"a": [11, 12, 13], "bad": [21, 22, 23, 24, 25], "c": [31, 32], "late": [41, 42, 43, 44]}
FAULTY = {"bad", "late"}


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _drain(core: EngineCore, finals: dict[str, RequestOutput]) -> None:
    for _ in range(500):
        if not core.has_unfinished():
            return
        for out in core.step():
            finals[out.request_id] = out
    raise AssertionError("the engine did not drain")


def _fault_for(ids: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging a request of `ids` raises what a value too large for int64 raised."""
    real = RequestTable.add
    faulty = [PROMPTS[i] for i in ids]

    def add(self: RequestTable, new: NewRequest) -> None:
        if new.token_ids in faulty:  # a first admission: its tokens are its prompt
            raise OverflowError("Python int too large to convert to C long")
        real(self, new)

    monkeypatch.setattr(RequestTable, "add", add)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_staging_fault_fails_only_that_request(pipelined: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One request faults in its first step and another joins running decodes and faults: both
    end with ABORT and the error, the others produce their usual tokens, and every KV block and
    pool row is free after the drain."""
    llm = LLM("photon-tiny-random", max_model_len=64, block_size=4, max_num_seqs=4, pipelined=pipelined)
    core = llm.engine
    expected = {rid: _tokens(llm, p) for rid, p in PROMPTS.items()}
    _fault_for(FAULTY, monkeypatch)
    finals: dict[str, RequestOutput] = {}
    for rid in ("a", "bad", "c"):
        core.add_request(PROMPTS[rid], GREEDY, request_id=rid, stream=False)
    for _ in range(3):
        for out in core.step():
            finals[out.request_id] = out
    assert "a" not in finals  # still decoding when the next faulty request joins
    core.add_request(PROMPTS["late"], GREEDY, request_id="late", stream=False)
    _drain(core, finals)
    for rid in FAULTY:
        out = finals[rid]
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].token_ids == []  # its zombie row's token is never appended
        assert "could not be staged (OverflowError: Python int too large" in out.error
    for rid in ("a", "c"):
        assert finals[rid].error is None
        assert finals[rid].outputs[0].finish_reason == "length"
        assert finals[rid].outputs[0].token_ids == expected[rid]
    core.assert_drained()
    monkeypatch.undo()
    assert _tokens(llm, PROMPTS["bad"]) == expected["bad"]
    core.assert_drained()


def test_staging_fault_offline_raises_and_leaves_the_llm_usable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("photon-tiny-random", max_model_len=64, block_size=4, max_num_seqs=4)
    expected = _tokens(llm, PROMPTS["a"])
    _fault_for({"bad"}, monkeypatch)  # the batch's second request
    with pytest.raises(ValueError, match=r"request 2: internal error: the request's inputs could "
                                         r"not be staged \(OverflowError"):
        llm.generate([PROMPTS["a"], PROMPTS["bad"], PROMPTS["c"]], GREEDY, use_tqdm=False)
    llm.engine.assert_drained()
    assert llm.engine.parents == {}
    assert _tokens(llm, PROMPTS["a"]) == expected


def test_huge_top_k_is_capped_at_the_vocabulary() -> None:
    """A top_k past int64 is capped at the vocabulary when the request is added: it keeps every
    token, as top_k off does, so the seeded tokens are the same."""
    llm = LLM("photon-tiny-random", max_model_len=64)
    def seeded(top_k: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=5, top_k=top_k, max_tokens=8, ignore_eos=True)

    outs = llm.generate(["hi"] * 4, [seeded(k) for k in (2**63, 10**30, 1024, -1)],
                        use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    assert len(ids[0]) == 8 and ids[0] == ids[1] == ids[2] == ids[3]
    llm.engine.assert_drained()


def test_interrupted_generate_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt between steps of `generate` aborts that call's requests and drains
    the steps in flight: the next call runs only its own request."""
    llm = LLM("photon-tiny-random", max_model_len=64, max_num_seqs=4)
    core = llm.engine
    expected = _tokens(llm, PROMPTS["a"])
    real_step, steps = core.step, [0]

    def step() -> list[RequestOutput]:
        steps[0] += 1
        if steps[0] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(core, "step", step)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS["c"]] * 20, long, use_tqdm=False)
    assert not core.has_unfinished() and core.parents == {}
    core.assert_drained()
    monkeypatch.undo()
    assert _tokens(llm, PROMPTS["a"]) == expected
    core.assert_drained()


def test_ctrl_c_inside_a_step_is_taken_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT that arrives inside a step (here: in the commit's wait for the tokens)
    interrupts `generate` only after that step: the step's bookkeeping completes, the call's
    requests are aborted and drained, and the next call is clean."""
    # Ctrl-C's default handler, also when the suite runs where SIGINT is ignored (a shell's
    # background job): `generate` only takes over a default handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_inside_a_step(monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_inside_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("photon-tiny-random", max_model_len=64, max_num_seqs=4)
    core = llm.engine
    expected = _tokens(llm, PROMPTS["a"])
    real_wait, waits = core.runner.wait, [0]

    def wait(handle: object) -> object:
        waits[0] += 1
        if waits[0] == 4:
            os.kill(os.getpid(), signal.SIGINT)  # delivered before the next bytecode
        return real_wait(handle)

    monkeypatch.setattr(core.runner, "wait", wait)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS["c"]] * 20, long, use_tqdm=False)
    assert waits[0] >= 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    core.assert_drained()
    monkeypatch.undo()
    assert _tokens(llm, PROMPTS["a"]) == expected
    core.assert_drained()


def test_llm_abort_ends_only_those_requests() -> None:
    """`LLM.abort` (as vLLM's `abort_request`): the aborted requests produce nothing more, the
    others run on; their steps in flight end with the next steps."""
    llm = LLM("photon-tiny-random", max_model_len=64, max_num_seqs=4)
    core = llm.engine
    ids = [core.add_request(PROMPTS["a"], GREEDY, stream=False) for _ in range(3)]
    core.step()
    core.step()
    llm.abort([ids[0], "unknown"])
    llm.abort(ids[2])
    finals: dict[str, RequestOutput] = {}
    _drain(core, finals)
    assert [finals[i].outputs[0].finish_reason for i in ids] == ["abort", "length", "abort"]
    assert len(finals[ids[1]].outputs[0].token_ids) == GREEDY.max_tokens
    core.assert_drained()


# (raw JSON of one sampling field, the field the 400 names); the server's JSON parser accepts
# Infinity, as Python's does.
BAD_JSON = [('"seed": 18446744073709551616', "seed"), ('"temperature": 1e308', "temperature"),
            ('"temperature": Infinity', "temperature"),
            ('"repetition_penalty": 1e-45', "repetition_penalty"),
            ('"repetition_penalty": Infinity', "repetition_penalty")]


def test_server_huge_values_are_served_or_rejected_never_fatal() -> None:
    """top_k >= 2**63 is served (capped at the vocabulary), values out of range get a 400 naming
    the field, and the engine serves on (no 500, /health stays 200)."""
    import httpx

    from tests.server_util import live_server

    with live_server() as server:
        url = server.api_url + "/completions"
        body = '{"prompt": "hello", "max_tokens": 4, "temperature": 1.0, "seed": 1, %s}'
        with httpx.Client(timeout=60) as http:
            ok = http.post(url, content=body % '"top_k": 9223372036854775808',
                           headers={"content-type": "application/json"})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["finish_reason"] == "length"
            for field, param in BAD_JSON:
                r = http.post(url, content=body % field,
                              headers={"content-type": "application/json"})
                assert r.status_code == 400, (field, r.text)
                assert r.json()["error"]["param"] == param, r.text
            assert http.get(server.base_url + "/health").status_code == 200
