"""`SpeculativeConfig`: vLLM's `--speculative-config` / `LLM(speculative_config=...)`, checked.

Accepted keys (vLLM's names): method ("draft_model" | "ngram"), model (the draft model: a local
directory or a hub id; required by draft_model), num_speculative_tokens (K, required, 1..16),
prompt_lookup_min / prompt_lookup_max (ngram only); and photon's own key adaptive (default true:
each step verifies the number of drafts its cost model finds fastest, photon.spec.adaptive; false:
every step verifies K, which makes a run's schedule independent of measured step times). As in vLLM, a missing method is inferred from
model ("ngram" or "[ngram]": ngram, anything else: draft_model), and the ngram lookup bounds default
to 5 and 5, or to each other when only one is given. Every mistake is a ConfigError that names the
key and says what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from photon.config import ConfigError, json_object_arg

FLAG = "speculative_config (--speculative-config)"
MAX_SPECULATIVE_TOKENS = 16
# The n-gram search compares this many shifted copies of each row at most: a bound keeps the
# proposer's device work proportional to it.
MAX_PROMPT_LOOKUP = 64
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM accepts these as model for method ngram
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "adaptive")
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 3}'


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"{FLAG}: {key} {message}")


def _method_names() -> list[str]:
    from photon.spec.proposer import PROPOSERS

    return PROPOSERS.names()


def _check_method(method: object) -> str:
    methods = _method_names()
    if not isinstance(method, str) or method not in methods:
        raise _error("method", f"must be one of {', '.join(methods)}; got {method!r}")
    return method


def _int_in(key: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _error(key, f"must be an integer from {low} to {high}, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative decoding configuration (build it with `from_dict` or by hand: the
    fields are checked either way)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model (method draft_model)
    prompt_lookup_min: int | None = None  # method ngram; None: the default (see the module doc)
    prompt_lookup_max: int | None = None
    adaptive: bool = True  # photon's: K_eff per step from the cost model (False: always K)

    def __post_init__(self) -> None:
        _check_method(self.method)
        if not isinstance(self.adaptive, bool):
            raise _error("adaptive", f"must be true or false, got {self.adaptive!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_model()

    def _check_ngram(self) -> None:
        if self.model is not None and self.model not in _NGRAM_MODEL_NAMES:
            raise _error("model", f"is only read by method draft_model; method ngram proposes "
                                  f"from the request's own tokens (got model {self.model!r})")
        low, high = (None if value is None else _int_in(key, value, 1, MAX_PROMPT_LOOKUP)
                     for key, value in (("prompt_lookup_min", self.prompt_lookup_min),
                                        ("prompt_lookup_max", self.prompt_lookup_max)))
        # vLLM's defaults: both 5, or the one given for both.
        low = low or high or DEFAULT_PROMPT_LOOKUP
        high = high or low
        if low > high:
            raise ConfigError(f"{FLAG}: prompt_lookup_min={low} must be <= "
                              f"prompt_lookup_max={high}")
        object.__setattr__(self, "model", None)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_model(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise _error("model", f"is required by method {self.method}: the draft model's "
                                  f"directory or hub id (got {self.model!r})")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, key) is not None:
                raise _error(key, f"is only read by method ngram, not {self.method}")

    @property
    def k(self) -> int:
        """num_speculative_tokens: the draft tokens proposed per request and step."""
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(values) - set(_KEYS), key=str)
        if unknown:
            raise ConfigError(f"{FLAG}: unknown key {unknown[0]!r}; allowed keys: "
                              f"{', '.join(_KEYS)}")
        model = values.get("model")
        if model is not None and not isinstance(model, str):
            raise _error("model", f"must be a string (a directory or hub id), got {model!r}")
        method = values.get("method")
        if method is None:
            method = _infer_method(model)
        method = _check_method("ngram" if method == "[ngram]" else method)
        if "num_speculative_tokens" not in values:
            raise _error("num_speculative_tokens", f"is required: an integer from 1 to "
                                                   f"{MAX_SPECULATIVE_TOKENS}")
        return cls(method=method, num_speculative_tokens=values["num_speculative_tokens"],
                   model=model, prompt_lookup_min=values.get("prompt_lookup_min"),
                   prompt_lookup_max=values.get("prompt_lookup_max"),
                   adaptive=values.get("adaptive", True))


def _infer_method(model: str | None) -> str:
    if model is None:
        raise _error("method", f"is required (one of {', '.join(_method_names())}), e.g. "
                               f"{_EXAMPLE}")
    return "ngram" if model in _NGRAM_MODEL_NAMES else "draft_model"


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """The engine argument as given (a JSON object string from the CLI, a dict from the Python
    API, a SpeculativeConfig, or None) -> a checked SpeculativeConfig, or None (no speculation)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_dict(json_object_arg(value, FLAG, _EXAMPLE))
