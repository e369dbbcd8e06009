"""The model's default sampling parameters (`--generation-config`) for a server request.

As in vLLM's server, a field the request leaves unset (absent from the body, or null) takes the
model's default from its generation_config.json; a value the request gives always wins. A chat
request sets its length with max_tokens or max_completion_tokens: either one counts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from photon.generation_config import GenerationDefaults

# SamplingParams name -> the request fields that set it
_REQUEST_FIELDS = {"max_tokens": ("max_tokens", "max_completion_tokens")}


def unset_defaults(req: BaseModel, defaults: GenerationDefaults | None) -> dict[str, Any]:
    """The model's defaults (SamplingParams keyword arguments) for the fields `req` left unset."""
    if defaults is None:
        return {}
    return {name: value for name, value in defaults.as_kwargs().items()
            if not any(_is_set(req, f) for f in _REQUEST_FIELDS.get(name, (name,)))}


def _is_set(req: BaseModel, field: str) -> bool:
    return field in req.model_fields_set and getattr(req, field, None) is not None
