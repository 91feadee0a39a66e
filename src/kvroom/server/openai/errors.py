"""OpenAI error bodies for everything that can go wrong at the HTTP edge.

pydantic's validation errors become one 400 that names the parameter (unknown fields first,
as "unsupported parameter(s)"); HTTP errors keep their status; anything unexpected is a 500
in the same shape, so a client always gets ``{"error": {...}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvroom.server.openai.protocol import ApiError


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)


def error_response(error: ApiError) -> Response:
    return Response(
        error.body.model_dump_json(), status_code=error.status, media_type="application/json"
    )


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    error = validation_api_error(exc.errors())
    return error_response(error)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    error = ApiError(exc.status_code, str(exc.detail), code=None)
    return error_response(error)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette logs the traceback and re-raises after this response is sent.
    error = ApiError(500, f"internal server error: {exc!r}", type="server_error")
    return error_response(error)


def unsupported_params_error(names: Sequence[str], remedy: str) -> ApiError:
    """400 naming every unsupported parameter (the first one as ``param``)."""
    quoted = ", ".join(f"'{name}'" for name in names)
    return ApiError(
        400,
        f"unsupported parameter(s): {quoted}; {remedy}",
        param=names[0],
        code="unsupported_parameter",
    )


def validation_api_error(errors: Sequence[Any]) -> ApiError:
    """One OpenAI-style 400 for pydantic's errors: unknown fields first, then the first field."""
    extra = [_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return unsupported_params_error(
            extra, "see the OpenAI API reference for the fields kvroom accepts"
        )
    first = errors[0]
    path = _path(first["loc"])
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return ApiError(400, f"malformed JSON body: {reason}", code="invalid_json")
    if not path:
        return ApiError(400, "the request body must be a JSON object", code="invalid_body")
    if first["type"] == "missing":
        return ApiError(
            400, f"missing required parameter '{path}'", param=path, code="missing_parameter"
        )
    param = path.split(".")[0]
    same = [e for e in errors if _path(e["loc"]).split(".")[0] == param][:4]
    detail = "; ".join(e["msg"] if _path(e["loc"]) == param else _where(e) for e in same)
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    return ApiError(
        400, f"invalid '{param}': {detail} (got {_short(first['input'])})", param=param, code=code
    )


def _where(error: Any) -> str:
    return f"{_path(error['loc'])}: {error['msg']}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _path(loc: Sequence[Any]) -> str:
    """``('body', 'messages', 0, 'role')`` -> ``'messages.0.role'``."""
    return ".".join(str(p) for p in loc if p != "body")
