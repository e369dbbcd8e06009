"""Reasoning parsers on canned model text: the whole output and the same text streamed in pieces
(token by token, character by character) split alike, as vLLM's qwen3 / deepseek_r1 parsers do."""

from __future__ import annotations

import pytest

from photon.reasoning import ReasoningSplit, get_reasoning_parser, reasoning_parser_names

IDS = {"<think>": 1001, "</think>": 1002}


class Vocab:
    def token_to_id(self, token: str) -> int | None:
        return IDS.get(token)


def parser(name: str):  # noqa: ANN201 - a ReasoningParser
    return get_reasoning_parser(name)(Vocab())


# (model output, qwen3 split, deepseek_r1 split)
CASES = [
    ("<think>\nplan it\n</think>\n\nThe answer.",
     ReasoningSplit("\nplan it\n", "\n\nThe answer."), ReasoningSplit("\nplan it\n", "\n\nThe answer.")),
    # no think block: qwen3 needs <think>; deepseek_r1's template opened the block in the prompt
    ("Just an answer.", ReasoningSplit(None, "Just an answer."), ReasoningSplit("Just an answer.", "")),
    ("reasons</think>answer", ReasoningSplit(None, "reasons</think>answer"),
     ReasoningSplit("reasons", "answer")),
    # stopped inside the block (max_tokens): all reasoning, for both
    ("<think>still thinking", ReasoningSplit("still thinking", ""),
     ReasoningSplit("still thinking", "")),
    ("<think></think>answer", ReasoningSplit("", "answer"), ReasoningSplit("", "answer")),
    ("<think>r</think>", ReasoningSplit("r", ""), ReasoningSplit("r", "")),
    ("", ReasoningSplit(None, ""), ReasoningSplit("", "")),
    # text that only looks like the start of a tag stays text
    ("<think>a < b and </thin</think>c <", ReasoningSplit("a < b and </thin", "c <"),
     ReasoningSplit("a < b and </thin", "c <")),
]


def pieces_of(text: str, tokens: bool) -> list[str]:
    """The text as a stream would deliver it: tags whole (added tokens), the rest char by char;
    or every character alone (a detokenizer holding back a stop-string prefix can cut a tag)."""
    if not tokens:
        return list(text)
    out: list[str] = []
    while text:
        tag = next((t for t in IDS if text.startswith(t)), None)
        step = len(tag) if tag else 1
        out.append(text[:step])
        text = text[step:]
    return out


@pytest.mark.parametrize("case", CASES, ids=[repr(c[0])[:30] for c in CASES])
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_split_whole_and_streamed(case: tuple, name: str) -> None:
    text, want = case[0], case[1] if name == "qwen3" else case[2]
    p = parser(name)
    assert p.split(text) == want
    for tokens in (True, False):
        splitter = p.splitter()
        reasoning = content = ""
        pieces = pieces_of(text, tokens)
        for i, piece in enumerate(pieces):
            delta = splitter.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + delta.reasoning, content + delta.content
        assert ReasoningSplit(reasoning if splitter.reasoning_seen else None, content) == want


def test_streamed_reasoning_comes_before_content() -> None:
    splitter = parser("qwen3").splitter()
    deltas = [splitter.feed(p) for p in ("<think>", "ab", "</think>", "cd")]
    assert [(d.reasoning, d.content) for d in deltas] == [("", ""), ("ab", ""), ("", ""), ("", "cd")]
    # a piece ending in a tag's beginning is held until the next piece decides
    splitter = parser("qwen3").splitter()
    assert (splitter.feed("<think>x</th").reasoning, splitter.feed("ink>y").content) == ("x", "y")


def test_is_reasoning_end_looks_at_the_last_tag() -> None:
    p = parser("qwen3")
    assert not p.is_reasoning_end([5, 6])
    assert p.is_reasoning_end([5, 1001, 7, 1002, 8])  # enable_thinking=false: an empty block
    assert not p.is_reasoning_end([1001, 1002, 9, 1001, 4])  # an earlier turn's block, then a new one


def test_registry_and_missing_tokens() -> None:
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; available: deepseek_r1, qwen3"):
        get_reasoning_parser("r1")

    class NoThink:
        def token_to_id(self, token: str) -> int | None:
            return None

    with pytest.raises(ValueError, match="needs <think> and </think> as single tokens"):
        get_reasoning_parser("qwen3")(NoThink())
