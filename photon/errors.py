"""Exceptions shared by the engine's validation and the server's error mapping."""

from __future__ import annotations


class ParameterError(ValueError):
    """A ValueError about one named request parameter: the server answers it with a 400 whose
    `param` is `self.param` (any ValueError that carries a `param` attribute is read the same way).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
