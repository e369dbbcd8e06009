"""The model's default sampling parameters, from its `generation_config.json` (vLLM's
`--generation-config`).

`auto` (the default) reads the model directory's generation_config.json, `vllm` reads nothing
(photon's own defaults), any other value is a folder holding a generation_config.json. Of that file
only what vLLM reads is used: temperature, top_k, top_p, min_p, repetition_penalty and
max_new_tokens (as max_tokens); other fields (do_sample, eos_token_id...) do not change sampling.
The defaults apply to what a request leaves unset: fields absent from a server request, and
`LLM.generate` called without SamplingParams (`LLM.get_default_sampling_params()`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from photon.config import ConfigError
from photon.errors import ParamError

GENERATION_CONFIG_MODES = ("auto", "vllm")
FILE_NAME = "generation_config.json"
# generation_config.json name -> SamplingParams name
_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """Default sampling parameters (SamplingParams names); None: not given by the model."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The fields the model sets, as SamplingParams keyword arguments."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def notice(self, name: str) -> str | None:
        """A startup line saying which defaults apply (as vLLM logs it); None when none do."""
        given = ", ".join(f"{k}={v}" for k, v in self.as_kwargs().items())
        return (f"[{name}: default sampling parameters from generation_config.json: {given} "
                f"(--generation-config vllm ignores them)]" if given else None)


def load_generation_defaults(setting: str, model_dir: str) -> GenerationDefaults:
    """`setting` is `--generation-config`: auto, vllm or a folder with generation_config.json."""
    if setting == "vllm":
        return GenerationDefaults()
    if setting == "auto":
        path = os.path.join(model_dir, FILE_NAME)
        return _read(path) if os.path.isfile(path) else GenerationDefaults()
    if not os.path.isdir(setting):
        raise ConfigError(
            f"generation_config must be auto, vllm or a folder holding {FILE_NAME}; {setting!r} "
            f"is not a folder")
    path = os.path.join(setting, FILE_NAME)
    if not os.path.isfile(path):
        raise ConfigError(f"generation_config folder {setting!r} has no {FILE_NAME}")
    return _read(path)


def _read(path: str) -> GenerationDefaults:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    values = {ours: data[theirs] for theirs, ours in _FIELDS.items()
              if data.get(theirs) is not None}
    _validate(path, values)
    return GenerationDefaults(**values)


def _validate(path: str, values: dict[str, Any]) -> None:
    """The values must be valid SamplingParams, or every request would fail on them."""
    from photon.sampling_params import SamplingParams

    try:
        SamplingParams(**values)
    except ParamError as e:
        theirs = {ours: theirs for theirs, ours in _FIELDS.items()}.get(e.param, e.param)
        raise ConfigError(f"{path}: {theirs}: {e}") from None
