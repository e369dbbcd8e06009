"""Request text <-> token ids for the server, off the event loop.

Tokenizing a long text takes a while, so it runs in a worker thread through `encode_batch`, which
releases the GIL while the Rust tokenizer works (`encode` does not): the event loop keeps
answering other requests (/health included) meanwhile.

Before that, a text too long to fit the context is refused by its length in characters alone.
`CharBound` is an upper bound on the characters one token can stand for, derived from the
tokenizer itself, so the check never refuses a prompt that would fit: no token covers more
characters than its longest vocabulary string (byte-level strings spell one character per byte;
other vocabularies spell at least the characters they decode to), times what the normalizer can
merge. A tokenizer that can drop or fuse characters without bound (whitespace splitting, a
stripping normalizer, unknown-token fusion, truncation) has no bound, and its prompts are only
checked after tokenizing.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from photon.server.errors import bad_request
from photon.tokenizer import Tokenizer

# Characters a normalizer can merge into one. Unicode composition merges at most a full
# canonical decomposition (4 code points) into one character, and leaves ASCII unchanged.
_NORMALIZER_MERGE = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1}
_COMPOSING = frozenset({"NFC", "NFKC"})
# Pre-tokenizers that split text without removing characters.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


@dataclass(frozen=True)
class CharBound:
    """At most `chars_per_token` characters of ASCII text per token, and `chars_per_token *
    unicode_merge` of other text."""

    chars_per_token: int
    unicode_merge: int = 1

    def max_chars(self, text: str, max_tokens: int) -> int:
        merge = 1 if text.isascii() else self.unicode_merge
        return max_tokens * self.chars_per_token * merge


def char_bound(tokenizer: Tokenizer) -> CharBound | None:
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None or not _model_bounded(spec.get("model") or {}):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None  # such added tokens swallow the whitespace around them
    if not _keeps_chars(spec.get("pre_tokenizer")):
        return None
    merge = _normalizer_merge(spec.get("normalizer"))
    if merge is None:
        return None
    longest = max((len(s) for s in tokenizer.get_vocab()), default=1)
    return CharBound(longest * merge[0], merge[1])


def _model_bounded(model: dict[str, Any]) -> bool:
    kind = model.get("type")
    if kind == "BPE":  # fuse_unk turns a run of unknown characters into one token
        return not (model.get("unk_token") is not None and model.get("fuse_unk"))
    if kind == "Unigram":  # runs of unknown characters become one token without byte fallback
        return model.get("unk_id") is None or bool(model.get("byte_fallback"))
    return False  # WordPiece: an over-long word is one [UNK]; WordLevel: any unknown word


def _keeps_chars(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_chars(p) for p in pre.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _normalizer_merge(norm: dict[str, Any] | None) -> tuple[int, int] | None:
    """(merge factor for any text, extra factor for non-ASCII text), or None if unbounded."""
    if norm is None:
        return 1, 1
    kind = norm.get("type")
    if kind == "Sequence":
        total, unicode = 1, 1
        for part in norm.get("normalizers") or []:
            factors = _normalizer_merge(part)
            if factors is None:
                return None
            total, unicode = total * factors[0], unicode * factors[1]
        return total, unicode
    if kind == "Replace":
        pattern, content = (norm.get("pattern") or {}).get("String"), norm.get("content") or ""
        if not isinstance(pattern, str) or not content:
            return None  # a regex, or a replacement by nothing
        return -(-len(pattern) // len(content)), 1
    if kind in _NORMALIZER_MERGE:
        return (1, _NORMALIZER_MERGE[kind]) if kind in _COMPOSING else (1, 1)
    return None  # Strip, StripAccents, BertNormalizer, Precompiled...: can remove characters


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bound = char_bound(tokenizer)

    def check_length(self, text: str, param: str) -> None:
        """400 for a text that cannot fit max_model_len tokens, judged without tokenizing."""
        if self.bound is None:
            return
        limit = self.bound.max_chars(text, self.max_model_len)
        if len(text) > limit:
            raise bad_request(
                f"the prompt is {len(text)} characters long; this model's maximum context "
                f"length of {self.max_model_len} tokens holds at most {limit} characters", param)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await asyncio.to_thread(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    async def decode(self, ids: list[int]) -> str:
        return await asyncio.to_thread(self.tokenizer.decode, ids)
