"""The n-gram proposal on the host, bit-identical to the device's (photon.spec.ngram).

The n-gram drafts are a function of a request's known tokens only, so once a step's tokens are
committed the host knows exactly which drafts the device proposed after it, without reading them
back. The grammar step uses this to fill a speculative row's grammar mask at every verified
position (photon.structured.rows): mask j is the grammar's state after the drafts before j.

The rule (photon.spec.ngram's docstring, with its search window the whole row): for known tokens
t[0..S), the longest n in [min_n, max_n] such that t[S-n..S) also ends at an earlier position
e <= S-2 (occurrences may overlap the suffix), the most recent such e, then t[e+1 .. e+1+K) cut at
S and at max_model_len - S. No match: no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from photon.spec.config import SpeculativeConfig

NO_DRAFTS = np.zeros(0, dtype=np.int64)


def propose_ngram_host(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int,
                       max_model_len: int) -> np.ndarray:
    """[<= k] int64: the drafts the device's n-gram proposer makes for known tokens `tokens`."""
    t = np.asarray(tokens, dtype=np.int64)
    size = t.shape[0]
    if size < 2:
        return NO_DRAFTS
    ends = np.arange(size - 1)  # candidate ends e <= S - 2
    run = np.ones(size - 1, dtype=bool)
    length = np.zeros(size - 1, dtype=np.int64)
    for i in range(min(max_n, size)):  # suffix token S-1-i is known for i < S
        src = ends - i
        run &= (src >= 0) & (t[np.maximum(src, 0)] == t[size - 1 - i])
        length += run
    eligible = np.flatnonzero(length >= min_n)
    if eligible.size == 0:
        return NO_DRAFTS
    # The longest match, then the latest end: the device's score order.
    best = length[eligible]
    end = int(eligible[best == best.max()][-1])
    num = min(size - 1 - end, max(max_model_len - size, 0), k)
    return t[end + 1:end + 1 + num].copy()


@dataclass(frozen=True)
class HostNgram:
    """The n-gram proposer's settings, proposing on the host."""

    k: int
    min_n: int
    max_n: int
    max_model_len: int

    @classmethod
    def of(cls, config: SpeculativeConfig, max_model_len: int) -> HostNgram:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return cls(config.k, config.prompt_lookup_min, config.prompt_lookup_max, max_model_len)

    def propose(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        return propose_ngram_host(tokens, self.k, self.min_n, self.max_n, self.max_model_len)
