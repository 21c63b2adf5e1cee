"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status.

Handlers raise `APIError`; FastAPI's own failures (malformed JSON, a missing or mistyped field, a
field we do not support) are turned into the same shape with a one-line message naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

INVALID_REQUEST = "invalid_request_error"
log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client; the server keeps serving."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as one line naming the parameter."""
    problem = exc.errors()[0]
    where = [str(part) for part in problem.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    kind = problem.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {problem.get('msg', '')}", code="invalid_json")
    if kind == "missing":
        return APIError(400, f"missing required parameter {param!r}", param, "missing_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported parameter {param!r}", param, "unsupported_parameter")
    if kind == "unsupported":
        param = (problem.get("ctx") or {}).get("param") or param
        return APIError(400, f"unsupported parameter {param!r}: {problem.get('msg', '')}", param,
                        "unsupported_parameter")
    if not where:
        return APIError(400, f"the request body must be a JSON object: {problem.get('msg', '')}", code="invalid_body")
    message = problem.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"invalid value for {param!r}: {message}", param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404 route, 405 method
        kind = INVALID_REQUEST if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind=kind).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: say so, keep serving
        log.exception("request %s failed", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
