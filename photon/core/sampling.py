"""The sampling columns: what a request's SamplingParams become for the sampler, packed once.

`pack_sampling` runs when a request is added (a value that cannot be packed fails that request at
the edge); the runner copies the packed values into its request table and gathers them per step,
so staging a step never converts a request's parameters. `IntCol` and `FLOAT_COLUMNS` are the only
definition of the columns; the RNG constants below are the only definition of the noise hash (the
torch sampler and the Triton kernels both read them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from photon.sampling_params import SamplingParams


class IntCol(enum.IntEnum):
    """Integer sampling constants of a request, in column order."""

    TOP_K = 0  # capped at the vocabulary; 0 = off
    KEY = 1  # the counter-based RNG key (derive_key)
    PROMPT_LEN = 2
    MIN_TOKENS = 3  # capped at the resolved max_tokens
    LOGPROBS = 4  # -1: none
    GREEDY = 5
    PENALTIES = 6  # any presence/frequency/repetition penalty
    BIAS = 7  # the number of logit_bias entries


# Float sampling constants: SamplingParams attribute names, in column order (the sampler's and the
# step inputs' fields carry the same names).
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
NUM_INT_COLUMNS = len(IntCol)
# A request whose constants could not be staged runs once more as a zombie: greedy, nothing else.
INERT_FLOATS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)

# ---- the counter-based RNG: key derivation and the noise hash's constants ---------------------
M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
# Hash multipliers are odd and < 2**31: a 32-bit value times one is < 2**63, so the int64 product
# never overflows and CPU and CUDA produce identical bits.
MUL_A = 0x21F0AAAD
MUL_B = 0x735A2D97
ROW_SALT = 0x5BD1E995  # separates the key's high word from the low word
CTR_SALT = 0x1B873593  # separates the counter from the key
VOCAB_SALT = 0x68E31DA4  # separates token ids from row seeds
# Speculative decoding's extra streams (photon.spec.rejection): a key whose high word is XORed
# with one of these draws the accept test's uniforms / the token after a rejection, independent of
# the stream the ordinary token draw uses. Each is < 2**31, so `salt << 32` is a positive int64.
ACCEPT_SALT = 0x2C1B3C6D
RESIDUAL_SALT = 0x297A2D39


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def derive_key(seed: int, child_index: int = 0) -> int:
    """A 62-bit non-negative key from a (possibly negative) seed and child index: the children
    of an n > 1 request get distinct streams."""
    h = _splitmix64(seed & M64)
    h = _splitmix64(h ^ (child_index & M64))
    return h >> 2


@dataclass(frozen=True, slots=True)
class PackedSampling:
    """A request's sampling constants (plain tuples: they travel in `NewRequest`)."""

    ints: tuple[int, ...]  # IntCol order
    floats: tuple[float, ...]  # FLOAT_COLUMNS order, float32 values
    bias_tokens: tuple[int, ...] = ()  # logit_bias token ids
    bias_values: tuple[float, ...] = ()  # their biases
    # Tokens banned while the request is under min_tokens: EOS (unless ignore_eos) and the stop
    # ids. Empty for grammar requests: their grammar decides where the output may end, and
    # banning EOS there could leave no legal token at all.
    min_tokens_bans: tuple[int, ...] = ()


def pack_sampling(params: SamplingParams, key: int, prompt_len: int, max_tokens: int,
                  vocab_size: int, eos_token_ids: frozenset[int]) -> PackedSampling:
    """Raises (OverflowError, ValueError) only for values SamplingParams let through (changed after
    it was validated): the caller fails the request."""
    min_tokens = min(params.min_tokens, max_tokens)  # bans end by max_tokens anyway
    ints = np.array([min(params.top_k, vocab_size),  # a larger top_k keeps every token too
                     key, prompt_len, min_tokens,
                     -1 if params.logprobs is None else params.logprobs, int(params.greedy),
                     int(params.needs_penalties), len(params.logit_bias or ())], dtype=np.int64)
    floats = np.array([getattr(params, name) for name in FLOAT_COLUMNS], dtype=np.float32)
    if not np.isfinite(floats).all():
        raise ValueError(f"sampling values {floats.tolist()} do not fit float32")
    bans: tuple[int, ...] = ()
    if min_tokens > 0 and params.structured_outputs is None:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        bans = tuple(sorted(banned))
    bias = params.logit_bias or {}
    tokens = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    if (tokens >= vocab_size).any() or not np.isfinite(values).all():
        raise ValueError(f"logit_bias {bias} does not fit the vocabulary or float32")
    return PackedSampling(tuple(ints.tolist()), tuple(floats.tolist()), tuple(tokens.tolist()),
                          tuple(values.tolist()), bans)
