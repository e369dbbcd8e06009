"""The server's character bound: no text longer than max_model_len tokens can hold is ever
tokenized, and no text that fits is refused (the bound never undercounts characters per token)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from photon.model.tiny import ensure_photon_tiny_random
from photon.server.tokenization import CharBound, char_bound
from photon.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_photon_tiny_random())


def variant(tok: Tokenizer, **changes: Any) -> Tokenizer:
    """photon-tiny's tokenizer with top-level tokenizer.json entries replaced."""
    spec = {**json.loads(tok.to_str()), **changes}
    return Tokenizer(HFTokenizer.from_str(json.dumps(spec)))


def test_byte_level_bound_is_the_longest_token(tiny: Tokenizer) -> None:
    longest = max(len(s) for s in tiny.get_vocab())
    assert char_bound(tiny) == CharBound(longest, 1)


def test_bound_holds_for_random_text(tiny: Tokenizer) -> None:
    bound = char_bound(tiny)
    assert bound is not None
    rng = random.Random(0)
    pieces = [tiny.decode([i]) for i in range(tiny.vocab_size)] + [
        " " * 40, "\n\n\n", "ééé", "日本語", "🙂", "<|im_start|>", "a" * 50]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        num_tokens = len(tiny.encode(text, add_special_tokens=False))
        assert len(text) <= bound.max_chars(text, num_tokens), text


@pytest.mark.parametrize(("changes", "expected"), [
    ({"normalizer": {"type": "NFC"}}, (1, 4)),
    ({"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Replace", "pattern": {"String": "  "}, "content": " "}]}},
     (2, 4)),
    ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, None),
    ({"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}}, None),
    ({"pre_tokenizer": {"type": "Whitespace"}}, None),
    ({"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed",
                        "invert": False}}, None),
    ({"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                     "stride": 0}}, None),
])
def test_what_the_bound_allows(tiny: Tokenizer, changes: dict[str, Any],
                               expected: tuple[int, int] | None) -> None:
    bound = char_bound(variant(tiny, **changes))
    longest = max(len(s) for s in tiny.get_vocab())
    if expected is None:
        assert bound is None
    else:
        assert bound == CharBound(longest * expected[0], expected[1])


def test_unknown_fusion_and_whitespace_eating_tokens_have_no_bound(tiny: Tokenizer) -> None:
    spec = json.loads(tiny.to_str())
    fused = {**spec["model"], "unk_token": "<|endoftext|>", "fuse_unk": True}
    assert char_bound(variant(tiny, model=fused)) is None
    eating = [{**spec["added_tokens"][0], "lstrip": True}, *spec["added_tokens"][1:]]
    assert char_bound(variant(tiny, added_tokens=eating)) is None
