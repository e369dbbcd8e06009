"""The grammar-backend interface and its registry.

A backend compiles a `StructuredOutputsParams` into an opaque compiled grammar (thread-safe: the
manager calls `compile` from a thread pool) and makes one `GrammarMatcher` per sequence from it.
A matcher is advanced with committed tokens, a step's at once (`accept_tokens`); a speculative
row's drafts are accepted only while its masks are filled, then rolled back. The backend fills a step's next-token masks for
many matchers at once (`fill_bitmasks`, on its own threads): rows of a packed int32 bitmask, bit
`v % 32` of word `v // 32` set = token v allowed, `mask_words` words wide. A backend's rows may cover
fewer ids than the model's vocabulary (a padded embedding); ids past `32 * mask_words` are never
allowed under a grammar.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from photon.registry import Registry
from photon.structured.params import StructuredOutputsParams
from photon.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A grammar that cannot be compiled (invalid schema, regex, EBNF) or took too long."""


class GrammarMatcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance by one committed token; False if the grammar rejects it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: no more tokens."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a speculative row's drafts, accepted only
        to fill the masks of the positions after them)."""


class GrammarBackend(Protocol):
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """Compile (any thread); raise GrammarError for an invalid spec."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    def memory_bytes(self, compiled: Any) -> int:
        """The memory a compiled grammar holds (the compile cache is bounded by its sum)."""

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar: a matcher accepts one only where its grammar may end,
        and is terminated exactly after accepting one."""

    def accept_tokens(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        """matchers[i].accept(tokens[i]) for every i, in one call; whether each was accepted."""

    @property
    def mask_words(self) -> int:
        """Width in int32 words of the rows `fill_bitmasks` writes."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                      indices: list[int]) -> None:
        """Row indices[i] of `bitmask` (CPU int32 [R, mask_words], contiguous) <- the allowed next
        tokens of matchers[i]. Matchers are independent, so a backend may fill rows in parallel
        (up to its `threads`); it returns once every row is written."""


# A backend class is built as cls(tokenizer, vocab_size, threads); imported lazily (xgrammar is
# imported only when a grammar is first compiled).
GRAMMAR_BACKENDS: Registry[type] = Registry("structured outputs backend", lazy={
    "xgrammar": "photon.structured.xgrammar_backend:XGrammarBackend",
})


def create_backend(name: str, tokenizer: Tokenizer, vocab_size: int, threads: int
                   ) -> GrammarBackend:
    """`vocab_size` is the model's (logits width), which may exceed the tokenizer's; `threads`
    bound the parallel mask fills."""
    backend: GrammarBackend = GRAMMAR_BACKENDS.get(name)(tokenizer, vocab_size, threads)
    return backend


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32

