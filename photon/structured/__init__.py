"""Structured outputs (constrained decoding): JSON schema, regex, choice and EBNF grammars.

params.py   StructuredOutputsParams (the user's spec)
backend.py  GrammarBackend / GrammarMatcher interfaces and the backend registry
xgrammar_backend.py  the xgrammar backend (imported only when a grammar is first compiled)
manager.py  compile thread pool, cache by spec, timeout; RequestGrammar per sequence
bitmask.py  host fill of the next-token bitmask and its on-device application
"""

from __future__ import annotations

from photon.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
