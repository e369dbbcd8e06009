"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

User mistakes are 4xx; only an internal failure (the engine thread died, or a bug) is a 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from photon.engine.async_engine import EngineDeadError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


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
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}", (loc[0] if loc else None)


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
        return error_response(500, str(exc), code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
