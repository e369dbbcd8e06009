"""Errors that name the request field or the model at fault."""

from __future__ import annotations


class ParamError(ValueError):
    """A request parameter outside its allowed values. `param` names the field (the OpenAI
    server reports it as the error's `param`); the message says what is allowed."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class AdapterNotFoundError(ValueError):
    """A request's LoRA adapter is not served (any more): it was unloaded, e.g. through another
    API server just before the request came in. The OpenAI server answers 404, as for any model
    name it does not serve."""

    def __init__(self, lora_name: str, message: str) -> None:
        super().__init__(message)
        self.lora_name = lora_name
