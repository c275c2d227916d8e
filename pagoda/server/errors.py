"""Errors in the OpenAI shape, with vLLM's conventions.

Every failure the server reports is `{"error": {"message", "type", "param", "code"}}`. As in
vLLM, `code` is the integer HTTP status and `type` an exception-style name; the one exception
is 401, which uses OpenAI's `code: "invalid_api_key"` (vLLM answers a bare string there).
FastAPI's 422 for a malformed body becomes a 400.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.server.protocol import ErrorInfo, ErrorResponse

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error a route raises to answer with `status` in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: int | str | None = None, headers: dict[str, str] | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = status if code is None else code
        self.headers = headers
        self.error_type = error_type


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)


def error_body(status: int, message: str, param: str | None = None,
               code: int | str | None = None, error_type: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped body; `error_type` defaults to the status's exception-style name."""
    error_type = error_type or ERROR_TYPES.get(
        status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
    info = ErrorInfo(message=message, type=error_type, param=param,
                     code=status if code is None else code)
    return ErrorResponse(error=info).model_dump()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code,
                                   error.error_type),
                        status_code=error.status, headers=error.headers)


def sse_error(error: APIError) -> str:
    """An error as one SSE event, for a failure after a stream's 200 headers went out."""
    return f"data: {json.dumps(error_body(error.status, error.message, error.param))}\n\n"


def error_event(error: APIError) -> dict[str, Any]:
    """An error as the Responses stream's `error` event (OpenAI's fields, and the `error`
    object the other streams' error events carry)."""
    return {"type": "error", "code": str(error.code), "message": error.message,
            "param": error.param, **error_body(error.status, error.message, error.param)}


def context_length_error(max_model_len: int, num_prompt_tokens: int,
                         max_tokens: int | None) -> APIError | None:
    """The 400 vLLM gives when the prompt plus the completion cannot fit, else None.

    NOTE: the older vLLM wording ("However, you requested N tokens ...") is kept on purpose:
    clients match "maximum context length is N tokens" and the numbers that follow.
    """
    head = f"This model's maximum context length is {max_model_len} tokens. However, you requested"
    if max_tokens is None and num_prompt_tokens >= max_model_len:
        return bad_request(f"{head} {num_prompt_tokens} tokens in the messages. "
                           "Please reduce the length of the messages.", "messages")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        return bad_request(f"{head} {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} "
                           f"in the messages, {max_tokens} in the completion). Please reduce "
                           "the length of the messages or completion.", "max_tokens")
    return None


def invalid_fields(errors: Sequence[Any], prefix: str = "") -> APIError:
    """A pydantic validation failure as the 400 a route's malformed body gets; `prefix` names
    where the validated part sits in the body (e.g. "sampling_params.")."""
    message, param = _validation_message(errors, prefix)
    return bad_request(message, param)


def _validation_message(errors: Sequence[Any], prefix: str = "") -> tuple[str, str | None]:
    parts, param = [], None
    for error in errors:
        if not isinstance(error, dict):
            parts.append(str(error))
            continue
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", "")
            parts.append(f"Malformed JSON body: {detail} (at position {error['loc'][-1]}).")
            continue
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if loc and prefix:
            loc[0] = prefix + loc[0]
        param = param or (loc[0] if loc else None)
        where = ".".join(loc) or "body"
        # NOTE: pydantic's error type too (e.g. greater_than_equal), as vLLM's messages carry it
        kind = f" ({error['type']})" if error.get("type") else ""
        parts.append(f"{where}: {error.get('msg', 'invalid')}{kind}")
    return "; ".join(parts) or "Invalid request.", param


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc.errors())
    return error_response(bad_request(message, param))


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail)))


async def _on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(APIError(500, f"{type(exc).__name__}: {exc}"))


Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]


def _logging_stack(handler: Handler) -> Handler:
    """`handler`, logging each error response with the stack trace that led to it (vLLM's
    --log-error-stack)."""
    async def logged(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        logging.getLogger("pagoda").error("%s %s answered %d", request.method, request.url.path,
                                          response.status_code, exc_info=exc)
        return response

    return logged


def install_error_handlers(app: FastAPI, log_stack: bool = False) -> None:
    """Routes every error the app can raise to the OpenAI shape; with `log_stack`, each error
    response is logged with its stack trace."""
    handlers: list[tuple[type[Exception], Handler]] = [
        (Exception, _on_unexpected_error), (RequestValidationError, _on_validation_error),
        (APIError, _on_api_error), (StarletteHTTPException, _on_http_error)]
    for kind, handler in handlers:
        app.add_exception_handler(kind, _logging_stack(handler) if log_stack else handler)
