"""The benchmark BPE tokenizer of the large shapes: a realistic vocabulary, built once, cached."""

from __future__ import annotations

import os

import pytest

from photon.bench.shapes import materialize_shape
from photon.bench.tokenizer import ensure_bench_tokenizer
from photon.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def test_bench_tokenizer_is_large_round_trips_and_is_cached(cache: str) -> None:
    path = ensure_bench_tokenizer(cache)
    tok = Tokenizer.from_pretrained(path)
    vocab = tok.get_vocab()
    assert 100_000 <= len(vocab) <= 151_643
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    text = 'def f(x):\n    return {"id": 42, "name": "ok"}  # a comment'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text) // 2  # real merges, not bytes
    stamp = os.path.getmtime(os.path.join(path, "tokenizer.json"))
    assert ensure_bench_tokenizer(cache) == path
    assert os.path.getmtime(os.path.join(path, "tokenizer.json")) == stamp  # not rebuilt


def test_large_shape_gets_the_bench_tokenizer(cache: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PHOTON_CACHE_DIR", cache)
    big = Tokenizer.from_pretrained(materialize_shape("qwen3-0.6b", str(tmp_path)))
    tiny = Tokenizer.from_pretrained(materialize_shape("tiny", str(tmp_path)))
    assert len(big.get_vocab()) > 100_000 and len(tiny.get_vocab()) == 1000
