from __future__ import annotations

import random

import pytest

from photon.engine.detokenizer import IncrementalDetokenizer
from photon.model.tiny import ensure_photon_tiny_random
from photon.sampling_params import SamplingParams
from photon.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_photon_tiny_random(str(tmp_path_factory.mktemp("cache"))))


PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def _run(tok: Tokenizer, ids: list[int], params: SamplingParams
         ) -> tuple[IncrementalDetokenizer, list[str], str | None, int]:
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), params)
    deltas: list[str] = []
    stop, used = None, 0
    for token in ids:
        used += 1
        stop = detok.update(token)
        if stop is not None:
            break
        deltas.append(detok.get_delta())
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop, used


def _byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so multi-byte characters are split across tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    mapping = _gpt2_byte_map()
    assert set(mapping.values()) == set(ByteLevel.alphabet())
    return [tok.token_to_id(mapping[b]) for b in text.encode("utf-8")]


def _gpt2_byte_map() -> dict[int, str]:
    """GPT-2 byte map: printable bytes map to themselves, the others to chr(256 + k)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    mapping, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@pytest.mark.parametrize("seed", range(20))
def test_random_tokens_match_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size + 24) for _ in range(rng.randrange(1, 60))]  # + padding
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, max_tokens=None)
        detok, deltas, stop, _ = _run(tok, ids, params)
        assert stop is None
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == detok.output_text


@pytest.mark.parametrize("text", ["日本語 🚀 café", "👩‍👩‍👧 ok", "\u00e9\u4e2d\U0001f600"])
def test_split_multibyte_chars(tok: Tokenizer, text: str) -> None:
    ids = _byte_tokens(tok, text)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), SamplingParams())
    pieces = []
    for token in ids:
        detok.update(token)
        assert "\ufffd" not in detok.get_delta()  # never half a character
        pieces.append(detok.get_delta())
    pieces.append(detok.get_delta(finished=True))
    assert detok.output_text == text
    assert "\ufffd" not in detok.output_text


def test_trailing_invalid_bytes_flushed(tok: Tokenizer) -> None:
    ids = _byte_tokens(tok, "ab") + [_byte_tokens(tok, "中")[0]]  # a dangling lead byte
    detok, deltas, _, _ = _run(tok, ids, SamplingParams())
    assert detok.output_text == tok.decode(ids) == "ab\ufffd"
    assert "".join(deltas) == "ab\ufffd"


@pytest.mark.parametrize("include", [False, True])
def test_stop_across_token_boundary(tok: Tokenizer, include: bool) -> None:
    ids = _byte_tokens(tok, "Hello STOP here") + tok.encode(" and more text")
    params = SamplingParams(stop=["xyz", "STOP"], include_stop_str_in_output=include)
    detok, deltas, stop, used = _run(tok, ids, params)
    assert stop == "STOP"
    assert used == len("Hello STOP")  # detected on the token that completed it
    expected = "Hello STOP" if include else "Hello "
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.update(tok.encode("x")[0]) is None  # finished: further tokens are ignored
    assert detok.output_text == expected


def test_earliest_stop_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    params = SamplingParams(stop=["four", "two three"])
    detok, _, stop, _ = _run(tok, ids, params)
    assert stop == "two three"
    assert detok.output_text == "one "


def test_delta_never_leaks_stop_prefix(tok: Tokenizer) -> None:
    text = "abc <<END>> tail"
    ids = _byte_tokens(tok, text)
    params = SamplingParams(stop=["<<END>>"])
    detok = IncrementalDetokenizer(tok, [], params)
    streamed = ""
    for token in ids:
        stop = detok.update(token)
        streamed += detok.get_delta(finished=stop is not None)
        assert "<" not in streamed  # no piece of the stop string is ever streamed
        if stop:
            break
    assert streamed == detok.output_text == "abc "


def test_stop_in_first_token_and_random_stops(tok: Tokenizer) -> None:
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", " ", "\n", "日本", "🚀", "x"]
    for _ in range(50):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 15)))
        stop = rng.choice(words[:3] + ["a b", "\n\n", "本🚀"])
        ids = tok.encode(text) if rng.random() < 0.5 else _byte_tokens(tok, text)
        for include in (False, True):
            params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
            detok, deltas, got, _ = _run(tok, ids, params)
            idx = text.find(stop)
            if idx == -1:
                assert got is None and detok.output_text == text
            else:
                assert got == stop
                assert detok.output_text == text[: idx + len(stop) if include else idx]
            assert "".join(deltas) == detok.output_text


def test_no_detokenize(tok: Tokenizer) -> None:
    ids = tok.encode("hello world")
    detok, deltas, stop, _ = _run(tok, ids, SamplingParams(detokenize=False))
    assert stop is None and detok.output_text == "" and deltas == [""] * (len(ids) + 1)
    detok, _, stop, _ = _run(tok, ids, SamplingParams(detokenize=False, stop=["wor"]))
    assert stop == "wor"

