"""`photon bench serve --dataset-name multiturn`: the conversation plan (token counts, groups,
turns), the history each turn carries and the order turns are sent in (against a stub that
answers with a counter), the prefix-cache counters, and a small live run against one photon
server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from photon.bench.multiturn import (
    MultiTurnOptions,
    fit_plans,
    group_of,
    plan_conversations,
    render_transcript,
    turn_messages,
)
from photon.bench.serve_client import ClientConfig
from photon.bench.serve_multiturn import NOT_SENT, run_conversations, ttft_by_turn
from photon.bench.serve_prefix import PrefixCounters, parse_prefix_counters, prefix_fields
from photon.cli import main
from tests.server_util import live_server, serve_app

pytestmark = pytest.mark.timeout(300)

OPTS = MultiTurnOptions(num_conversations=6, num_turns=3, system_prompt_len=40, num_groups=2,
                        turn_len=8, output_len=4, seed=5)


# ---------------------------------------------------------------- the plan


def test_plan_groups_share_a_system_prompt_and_texts_have_their_lengths() -> None:
    plans = plan_conversations(OPTS)
    assert [p.group for p in plans] == [0, 0, 0, 1, 1, 1]  # contiguous groups
    assert [group_of(c, OPTS) for c in range(6)] == [0, 0, 0, 1, 1, 1]
    assert len({p.system_prompt for p in plans[:3]}) == 1
    assert plans[0].system_prompt != plans[3].system_prompt
    assert all(len(p.system_prompt.split()) == 40 for p in plans)
    assert all(len(p.user_messages) == 3 for p in plans)
    # Each user message: its "[conversation.turn]" tag and turn_len words.
    assert plans[4].user_messages[2].startswith("[4.2] ")
    assert all(len(m.split()) == 1 + 8 for p in plans for m in p.user_messages)
    assert plan_conversations(OPTS) == plans  # the seed alone decides

    async def first_words(text: str, n: int) -> str:  # a tokenizer of one token per word
        return " ".join(text.split()[:n])

    fitted = asyncio.run(fit_plans(plans, OPTS, first_words))
    assert all(len(p.system_prompt.split()) == 40 for p in fitted)
    assert all(len(m.split()) == 8 for p in fitted for m in p.user_messages)  # tag included


@pytest.mark.parametrize("change, words", [
    ({"num_turns": 0}, "--num-turns must be at least 1, got 0"),
    ({"system_prompt_len": -1}, "--system-prompt-len must be at least 0, got -1"),
    ({"num_groups": 7}, "--num-groups (7) cannot exceed --num-conversations (6)"),
])
def test_bad_options_name_the_flag(change: dict[str, int], words: str) -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_conversations(replace(OPTS, **change))


@pytest.mark.parametrize("args, words", [
    (["--dataset-name", "multiturn", "--num-groups", "100"],
     "--num-groups (100) cannot exceed --num-conversations (64)"),
    (["--dataset-name", "multiturn", "--num-prompts", "4"], "--num-prompts is not used by"),
    (["--dataset-name", "multiturn", "--sweep-concurrency", "1", "2"], "do not apply to"),
    (["--turn-len", "5", "--metrics-urls", "http://x"],
     "--turn-len, --metrics-urls: only for --dataset-name multiturn (this run's dataset is "
     "random)"),
])
def test_cli_rejects_bad_multiturn_flags_before_asking_the_server(
        args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 refuses connections: the flags must be refused before any request.
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", *args]) == 2
    assert words in capsys.readouterr().err


def test_each_turn_carries_the_history_and_extends_the_previous_prompt() -> None:
    plan = plan_conversations(OPTS)[1]
    answers = [" first answer", " second answer"]
    msgs = turn_messages(plan, answers)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant",
                                         "user"]
    assert [m["content"] for m in msgs[1:]] == [plan.user_messages[0], answers[0],
                                                plan.user_messages[1], answers[1],
                                                plan.user_messages[2]]
    for turn in range(2):
        before = render_transcript(turn_messages(plan, answers[:turn]))
        after = render_transcript(turn_messages(plan, answers[:turn + 1]))
        assert after.startswith(before + answers[turn])  # a prefix cache reuses all of it
    with pytest.raises(ValueError, match="turn 3 does not exist"):
        turn_messages(plan, [*answers, " third"])


# ---------------------------------------------------------------- order, against a stub


def _stub_app(bodies: list[dict[str, Any]], fail_at: int | None) -> FastAPI:
    """A chat endpoint whose n-th request (from 0) streams the answer " A<n>"; request number
    `fail_at` gets a 500."""
    app = FastAPI()
    app.state.engine = None  # serve_app reads these
    app.state.serving = SimpleNamespace(admission=None)

    async def chunks(n: int) -> AsyncIterator[str]:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': f' A{n}'}}]})}\n\n"
        usage = {"prompt_tokens": 10 + n, "completion_tokens": 1}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        bodies.append(await raw.json())
        n = len(bodies) - 1
        if n == fail_at:
            return StreamingResponse(iter([]), status_code=500)
        return StreamingResponse(chunks(n), media_type="text/event-stream")

    return app


def _run_stub(opts: MultiTurnOptions, fail_at: int | None = None
              ) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    bodies: list[dict[str, Any]] = []
    plans = plan_conversations(opts)
    with serve_app(_stub_app(bodies, fail_at)) as live:
        cfg = ClientConfig(live.base_url, "/v1/chat/completions", "stub", timeout_s=60)
        runs, _ = asyncio.run(run_conversations(cfg, plans, opts, [0.0] * len(plans), 2))
    return bodies, runs


def test_turns_wait_for_the_previous_answer_and_carry_it() -> None:
    bodies, runs = _run_stub(OPTS)
    assert len(bodies) == 18 and all(r.success for run in runs for r in run)
    for conv, run in enumerate(runs):
        answers = [r.text for r in run]
        for turn, record in enumerate(run):
            # The messages this turn sent hold the answers the stub gave its earlier turns.
            sent = next(b["messages"] for b in bodies
                        if b["messages"][-1]["content"].startswith(f"[{conv}.{turn}] "))
            assert [m["content"] for m in sent if m["role"] == "assistant"] == answers[:turn]
            if turn:  # sent only after the previous turn's stream had ended
                prev = run[turn - 1]
                assert record.start >= prev.start + prev.latency
    assert ttft_by_turn(runs)[0] is not None and len(ttft_by_turn(runs)) == 3


def test_a_failed_turn_ends_its_conversation() -> None:
    opts = MultiTurnOptions(num_conversations=1, num_turns=3, system_prompt_len=4,
                            num_groups=1, turn_len=2, output_len=1)
    bodies, runs = _run_stub(opts, fail_at=1)
    assert len(bodies) == 2  # the third turn was never sent
    assert [r.success for r in runs[0]] == [True, False, False]
    assert runs[0][2].error == NOT_SENT


# ---------------------------------------------------------------- prefix-cache counters


def test_prefix_counters_are_summed_and_differenced() -> None:
    text = ('photon:prefix_cache_queries_total{model_name="m"} 100.0\n'
            'photon:prefix_cache_hits_total{model_name="m"} 40.0\n'
            'photon:prompt_tokens_total{model_name="m"} 90.0\n'
            'photon:prompt_tokens_created{model_name="m"} 1.7e9\n'
            'vllm:prefix_cache_hits_total{model_name="x",engine="1"} 2.0\n')
    assert parse_prefix_counters(text) == PrefixCounters(100.0, 42.0, 90.0)
    before = [PrefixCounters(10, 5, 10), PrefixCounters(0, 0, 0)]
    after = [PrefixCounters(110, 45, 100), PrefixCounters(50, 0, 50)]
    fields = prefix_fields(before, after)
    assert fields["prefix_cache_queries"] == 150 and fields["prefix_cache_hits"] == 40
    assert fields["prefix_hit_rate"] == pytest.approx(40 / 150)
    assert fields["prefill_tokens"] == 140 - 40 and fields["prefix_hits_per_server"] == [40, 0]
    assert prefix_fields([None], after[:1])["prefix_hit_rate"] is None


# ---------------------------------------------------------------- live


def test_live_run_against_one_server(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with live_server({"model": "photon-tiny"}, api_servers=1) as live:
        rc = main(["bench", "serve", "--base-url", live.base_url, "--dataset-name", "multiturn",
                   "--endpoint", "/v1/chat/completions", "--num-conversations", "4",
                   "--num-turns", "3", "--system-prompt-len", "48", "--num-groups", "2",
                   "--turn-len", "8", "--output-len", "4", "--max-concurrency", "4",
                   "--save-requests", "--output-json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"], s["num_prompts"]) == (12, 0, 12)
    assert s["output_len_mismatches"] == 0
    assert s["server_prompt_tokens"] == s["total_input_tokens"]  # every prompt counted once
    # Turns 2 and 3 reuse their history, conversations their group's system prompt.
    assert s["prefix_cache_hits"] > 0 and 0 < s["prefix_hit_rate"] < 1
    assert s["prefill_tokens"] == s["server_prompt_tokens"] - s["prefix_cache_hits"]
    records = s["requests"]  # conversation by conversation, each in turn order
    for c in range(4):
        turns = records[3 * c:3 * c + 3]
        # Each turn's prompt holds the previous one, its 4-token answer and 8 more tokens.
        assert all(b["prompt_tokens"] - a["prompt_tokens"] >= 12
                   for a, b in zip(turns, turns[1:]))
        assert all(b["start"] >= a["start"] + a["latency"] for a, b in zip(turns, turns[1:]))
