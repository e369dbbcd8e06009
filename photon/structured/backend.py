"""The grammar-backend interface and its registry.

A backend compiles a `StructuredOutputsParams` into an opaque compiled grammar (thread-safe: the
manager calls `compile` from a thread pool) and makes one `GrammarMatcher` per sequence from it.
A matcher is advanced with committed tokens only and fills one row of a packed int32 bitmask
(bit `v % 32` of word `v // 32` set = token v allowed) for the next token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from photon.structured.params import StructuredOutputsParams
from photon.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A grammar that cannot be compiled (invalid schema, regex, EBNF) or took too long."""


class GrammarMatcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance by one committed token; False if the grammar rejects it."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of a CPU int32 bitmask."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: no more tokens."""


class GrammarBackend(Protocol):
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """Compile (any thread); raise GrammarError for an invalid spec."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


BackendFactory = Callable[[Tokenizer, int], GrammarBackend]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        _BACKENDS[name] = factory
        return factory
    return deco


def create_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> GrammarBackend:
    """`vocab_size` is the model's (logits width), which may exceed the tokenizer's."""
    if name == "xgrammar" and name not in _BACKENDS:
        import photon.structured.xgrammar_backend  # noqa: F401 - registers itself
    if name not in _BACKENDS:
        raise ValueError(f"unknown structured-outputs backend {name!r}; "
                         f"available: {', '.join(sorted(_BACKENDS)) or 'xgrammar'}")
    return _BACKENDS[name](tokenizer, vocab_size)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
