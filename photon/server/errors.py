"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

User mistakes are 4xx; an internal failure (the engine stopped under a running request, or a bug)
is a 500; a new request while the engine is stopped is a 503 (code `engine_dead`), as /health.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from photon.engine.async_engine import EngineDeadError, EngineUnavailableError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 502: "bad_gateway", 503: "service_unavailable",
          504: "gateway_timeout"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    # A message may quote request text; a lone surrogate in it would make the body unencodable.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def invalid_value(exc: ValueError, fields: Collection[str] = (),
                  default: str | None = None) -> APIError:
    """A 400 for a validation ValueError. `param` is the exception's `param` attribute when it
    has one (photon.errors.ParamError), else the message's first word when that is one of
    `fields` ("top_p must be in (0, 1], got 2"), else `default`."""
    param = getattr(exc, "param", None)
    if not isinstance(param, str):
        first = str(exc).split(" ", 1)[0]
        param = first if first in fields else default
    return bad_request(str(exc), param)


# pydantic names the member of a union it tried as an extra location part ("str",
# "list[int]", "function-after[...]", "ContentPart"); the field path leaves those out.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc: Sequence[Any]) -> list[str]:
    return [str(p) for p in loc if p != "body" and not (
        isinstance(p, str) and ("[" in p or p in _UNION_TAGS or p[:1].isupper()))]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        return f"the request body is not valid JSON: {errors[0].get('msg', '')}", None
    # Our own checks (value_error) say more than a union member's "Input should be a ...".
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    path = _field_path(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    others = {p[0] for p in map(_field_path, (e.get("loc", ()) for e in errors)) if p}
    others.discard(path[0] if path else "")
    more = f" (and {len(others)} more invalid fields)" if others else ""
    return f"{'.'.join(path) or 'body'}: {msg}{more}", (path[0] if path else None)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        status = 503 if isinstance(exc, EngineUnavailableError) else 500
        return error_response(status, str(exc), code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
