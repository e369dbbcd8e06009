"""The xgrammar backend. Tokenizer info is built from photon's own tokenizer (tokenizer.json's
vocabulary and decoder type), so `transformers` is never needed at run time.

xgrammar is told the tokenizer's id range, not the model's (often padded) vocabulary: it treats
every id without a string as special, and its `accept_token` scans the special ids, so padding
ids would make every accept scan them. Ids past the tokenizer can never be produced under a
grammar: mask rows are the tokenizer's words wide (`mask_words`), and the apply treats the ids
past them as disallowed.

A step's masks are filled by xgrammar's `BatchGrammarMatcher`: no Python per row, the GIL released.
Its own threaded mode starts threads on every call, which costs more than most rows' fills (a
row is cheap unless its matcher sits inside a bounded string or a ranged number). `SplitFill`
instead deals the rows round-robin to persistent threads, each running a one-thread batch call
(`--structured-outputs-threads`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from photon.structured.backend import GrammarError, bitmask_width
from photon.structured.params import StructuredOutputsParams
from photon.tokenizer import Tokenizer


def _vocab_type(tokenizer: Tokenizer) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) from the tokenizer.json decoder."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in types:
        return xgr.VocabType.BYTE_FALLBACK, any(t in types for t in ("Metaspace", "Strip"))
    return xgr.VocabType.RAW, False


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """Over ids [0, min(model vocab, tokenizer id range))."""
    vocab = tokenizer.get_vocab()
    size = min(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * size
    special = set(tokenizer.all_special_ids)
    for token, idx in vocab.items():
        # Special tokens (chat markers...) must never appear inside constrained text: an empty
        # entry makes xgrammar treat them as special. Stop tokens are allowed separately.
        if idx < size and idx not in special:
            encoded[idx] = token
    vocab_type, prefix_space = _vocab_type(tokenizer)
    stops = sorted(i for i in tokenizer.eos_token_ids if i < size) or None
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=size,
                             stop_token_ids=stops, add_prefix_space=prefix_space)


class XGrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.handle = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return self.handle.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.handle.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.handle.rollback(num_tokens)  # xgrammar keeps every step: no rollback limit


MIN_ROWS_PER_PART = 8  # fewer rows than this per thread: dispatch costs more than it saves


class SplitFill:
    def __init__(self, threads: int) -> None:
        self.batches = [xgr.BatchGrammarMatcher(1) for _ in range(threads)]  # one per thread
        self.pool = (ThreadPoolExecutor(threads - 1, thread_name_prefix="photon-mask-fill")
                     if threads > 1 else None)

    def __call__(self, handles: list[xgr.GrammarMatcher], bitmask: torch.Tensor,
                 indices: list[int]) -> None:
        """Returns once every row is written (or re-raises a part's error)."""
        parts = min(len(self.batches), len(handles) // MIN_ROWS_PER_PART)
        if parts <= 1 or self.pool is None:
            self.batches[0].batch_fill_next_token_bitmask(handles, bitmask, indices)
            return
        futures = [self.pool.submit(self.batches[p].batch_fill_next_token_bitmask,
                                    handles[p::parts], bitmask, indices[p::parts])
                   for p in range(1, parts)]
        try:
            self.batches[0].batch_fill_next_token_bitmask(handles[::parts], bitmask,
                                                          indices[::parts])
        finally:
            for f in futures:
                f.result()


class XGrammarBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, threads: int) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size)
        # photon's manager caches compiled grammars by spec; one cache is enough.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.fill = SplitFill(threads)
        self.mask_words = bitmask_width(self.info.vocab_size)
        self.stop_token_ids = frozenset(self.info.stop_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return self._compile(spec)
        except Exception as e:  # noqa: BLE001 - any compile failure is the request's fault
            raise GrammarError(f"invalid {spec.kind} for structured outputs: "
                               f"{_clean(str(e))}") from None

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        ws: dict[str, Any] = {"any_whitespace": spec.any_whitespace,
                              "max_whitespace_cnt": spec.max_whitespace}
        if spec.json is not None:
            return self.compiler.compile_grammar(_json_schema_grammar(spec.json, ws))
        if spec.json_object:
            return self.compiler.compile_grammar(
                _json_schema_grammar({"type": "object"}, {**ws, "strict_mode": False}))
        if spec.regex is not None:
            return self.compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return self.compiler.compile_grammar(f"root ::= {alts}")
        return self.compiler.compile_grammar(spec.grammar)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def memory_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)

    def accept_tokens(self, matchers: list[XGrammarMatcher], tokens: list[int]) -> list[bool]:
        return xgr.BatchGrammarMatcher.batch_accept_token([m.handle for m in matchers], tokens)

    def fill_bitmasks(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor,
                      indices: list[int]) -> None:
        if matchers:
            self.fill([m.handle for m in matchers], bitmask, indices)


# xgrammar (0.2.x) spells a character of a length-bounded JSON string (maxLength/minLength) with a
# class that excludes only the quote, backslash, CR and LF, so raw control characters (which JSON
# forbids; json.loads rejects them) get through; its unbounded strings exclude 0x00-0x1f. Patch the
# bounded class to match.
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_schema_grammar(schema: Any, options: dict[str, Any]) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **options)
    text = str(grammar)
    if _BOUNDED_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHAR, _JSON_CHAR))


def _clean(message: str) -> str:
    """Drop xgrammar's '[time] /path/file.cc:line: ' prefix from an error message."""
    head, sep, rest = message.partition(".cc:")
    if sep and head.startswith("["):
        return rest.split(": ", 1)[-1].strip()
    return message.strip()

