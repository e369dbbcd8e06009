"""SamplingParams: vLLM's names and meanings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from photon.structured.params import StructuredOutputsParams


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
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
        self._validate()
        # The per-step staging reads these six floats for every sampled row (worker/inputs.py).
        self.float_row = (float(self.temperature), float(self.top_p), float(self.min_p),
                          float(self.presence_penalty), float(self.frequency_penalty),
                          float(self.repetition_penalty))

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_num(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0,
               f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed),
               f"seed must be an integer or None, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2,
                   f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be a StructuredOutputsParams, got "
               f"{type(self.structured_outputs).__name__}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def validate_token_ids(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
