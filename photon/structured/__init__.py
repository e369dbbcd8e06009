"""Structured outputs (constrained decoding): JSON schema, regex, choice and EBNF grammars.

params.py   StructuredOutputsParams (the user's spec)
backend.py  GrammarBackend / GrammarMatcher interfaces and the backend registry
xgrammar_backend.py  the xgrammar backend (imported only when a grammar is first compiled)
manager.py  compiles (cached by spec, size limits, timeout); RequestGrammar per sequence
compile_pool.py  compile threads, with a lane that keeps small grammars served
grammar_cache.py  the compile cache, bounded in bytes
executor.py where the matchers live and a step's grammar job (accepts, then fills) runs
worker.py   the grammar-worker process (the default executor) and its engine end
bitmask.py  the next-token mask layout, host row selection and on-device application
"""

from __future__ import annotations

from photon.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
