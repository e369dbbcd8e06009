"""Errors that name the request field at fault."""

from __future__ import annotations


class ParamError(ValueError):
    """A request parameter outside its allowed values. `param` names the field (the OpenAI
    server reports it as the error's `param`); the message says what is allowed."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
