"""OpenAI-style JSON errors at the router: validation failures become 400s naming the parameter, unknown paths
404s, and every `ApiError` raised by a route is rendered as `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.json_body import HugeInt, parse_json_object
from router.openai_schema import ApiError, bad_request


def validation_error(e: ValidationError | RequestValidationError) -> ApiError:
    err = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = "integer out of range" if isinstance(err.get("input"), HugeInt) else err.get("msg")
    return bad_request(f"{where}: {msg}" if where else str(msg), param)


def validate(raw: bytes, model: type[BaseModel]) -> Any:
    """Body bytes -> the request model, or ApiError(400); CPU-bound, so it runs on the worker thread."""
    try:
        return model.model_validate(parse_json_object(raw))
    except ValidationError as e:
        raise validation_error(e) from None


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError), f"registered for ApiError, got {type(e).__name__}"
    # json.dumps escapes non-ASCII: a message quoting client input can never fail to encode
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")


async def _fastapi_422(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError), f"registered for RequestValidationError, got {type(e).__name__}"
    return JSONResponse(validation_error(e).body(), status_code=400)


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException), f"registered for HTTPException, got {type(e).__name__}"
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _fastapi_422)
    app.add_exception_handler(StarletteHTTPException, _http_error)
