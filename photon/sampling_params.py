"""SamplingParams: vLLM's names and meanings, validated at construction.

Every numeric field is range-checked here (a `ParamError` naming the field and the allowed range);
what depends on the model (stop ids inside the vocabulary, top_k capped at it) is checked when a
request is added. Together they guarantee that an accepted request's values fit the engine's
int64 / float32 sampling inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from photon.errors import ParamError
from photon.structured.params import StructuredOutputsParams

MAX_TEMPERATURE = 100.0  # logits / 100 is already close to uniform for any model
# Repeated tokens' logits are divided or multiplied by repetition_penalty: further from 1 they
# overflow float32 (1e-45 makes them infinite) or vanish, and sampling stops meaning anything.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGPROBS = 20
# OpenAI's logit_bias range; +100 makes a token all but certain, -100 all but impossible.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 1024  # one row's (token, bias) pairs staged per step
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts; the key uses its 64 bits


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise ParamError(param, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: object, low: float, high: float) -> bool:
    """A number (bool excluded) in [low, high]; NaN and infinities fail (finite bounds)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled; above the vocabulary size: every token (capped)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (and this many top ones)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, EBNF

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate_ints()
        self._validate_floats()
        self._validate_logit_bias()
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", f"structured_outputs must be a StructuredOutputsParams, got "
               f"{type(self.structured_outputs).__name__}")

    def _validate_ints(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
               f"top_k must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}")
        low, high = SEED_RANGE
        _check(self.seed is None or (_is_int(self.seed) and low <= self.seed <= high), "seed",
               f"seed must be an integer in [-2**63, 2**64 - 1] or None, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (_is_int(self.logprobs)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or "
               f"None, got {self.prompt_logprobs!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    def _validate_floats(self) -> None:
        _check(_in_range(self.temperature, 0.0, MAX_TEMPERATURE), "temperature",
               f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
               f"got {self.temperature!r}")
        _check(_in_range(self.top_p, 0.0, 1.0) and self.top_p > 0, "top_p",
               f"top_p must be a number in (0, 1], got {self.top_p!r}")
        _check(_in_range(self.min_p, 0.0, 1.0), "min_p",
               f"min_p must be a number in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_in_range(value, -2.0, 2.0), name,
                   f"{name} must be a number in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        _check(_in_range(self.repetition_penalty, low, high), "repetition_penalty",
               f"repetition_penalty must be a number in [{low:g}, {high:g}] (1 = off; repeated "
               f"tokens' logits are divided or multiplied by it, so values further from 1 "
               f"overflow or erase them), got {self.repetition_penalty!r}")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        _check(isinstance(bias, dict), "logit_bias",
               f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        _check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
               f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
        low, high = LOGIT_BIAS_RANGE
        for token, value in bias.items():
            _check(_is_int(token) and token >= 0, "logit_bias",
                   f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            _check(_in_range(value, low, high), "logit_bias",
                   f"logit_bias values must be numbers in [{low:g}, {high:g}], got {value!r} "
                   f"for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def validate_token_ids(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, "stop_token_ids",
               f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        bad = sorted(t for t in (self.logit_bias or {}) if t >= vocab_size)
        _check(not bad, "logit_bias",
               f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
