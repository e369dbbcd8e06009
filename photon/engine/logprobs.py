"""Logprob entries as vLLM returns them: per token, a dict of token id -> `Logprob` holding the
token itself (its logprob and 1-based rank in the distribution) and the top-k alternatives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from photon.outputs import Logprob

if TYPE_CHECKING:
    from photon.tokenizer import Tokenizer

TokenText = Callable[[int], str]


class TokenTexts:
    """Each token's own text (special tokens included), decoded once per token id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id], skip_special_tokens=False)
        return text


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: Sequence[int],
                  top_logprobs: Sequence[float], text: TokenText | None) -> dict[int, Logprob]:
    """The token first, then its top alternatives (ranks 1, 2, ...) in order."""
    def make(tid: int, lp: float, r: int) -> Logprob:
        return Logprob(lp, r, text(tid) if text is not None else None)

    entry = {token_id: make(token_id, logprob, rank)}
    for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
        if tid not in entry:
            entry[tid] = make(tid, lp, r)
    return entry
