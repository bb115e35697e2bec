"""Errors -> HTTP responses (and gRPC status codes), in one table and one set of handlers.

Every error body is ``{"error": <message>, "error_type": <name>}``: core ``RobezError`` subclasses,
request validation errors, unknown routes and unexpected failures alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from robez_core.errors import (
    BusyError,
    ConfigError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
    RobezError,
)

logger = logging.getLogger("robez.errors")


class UnauthorizedError(RobezError):
    """No credentials where a key is required (401)."""


class ForbiddenError(RobezError):
    """Credentials given but wrong (403)."""


class PayloadTooLargeError(LimitExceededError):
    """The request body is over ``max_body_bytes`` (413); other limits answer 422."""


class StorageFullError(RobezError):
    """The data directory's file system has no room for a write: the update (snapshot, new table, load) is
    refused and nothing was applied. The server stays up and serves lookups; writes succeed again once
    space is freed (507 Insufficient Storage)."""


# On a 413 for a push over what one replicated log entry holds: the largest binary update body
# (ids * 8 + ids * dim * 4 bytes) that fits, so a client can split the push (service/client/ does).
MAX_UPDATE_BYTES_HEADER = "X-Robez-Max-Update-Bytes"


class UpdateTooLargeError(PayloadTooLargeError):
    """A push bigger than one entry of the replicated log takes (413, never retried as it is).

    Args:
        message: names the sizes, the limit and the setting that raises it.
        max_update_bytes: the largest binary update body that fits (sent as ``X-Robez-Max-Update-Bytes``).
    """

    def __init__(self, message: str, max_update_bytes: int) -> None:
        super().__init__(message)
        self.max_update_bytes = max_update_bytes


class RefusedUpdateError(InvalidInputError):
    """An update that fails one of the checks every update gets (``service/store/tables.py``): a live
    push answers 422; a logged one is applied as an empty version. ``reason`` names the check, one of
    ``SKIP_REASONS`` (the label of ``robez_replication_skipped_total``)."""

    # Clients see the InvalidInputError it always was; the reason is for the log's skips.
    error_type = "InvalidInputError"

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# Why an entry of a log was applied as an empty version: its headers, its payload's length, its lr (not
# positive, not finite, over the table's max_lr), its ids, its gradients (shape, dtype, NaN or Inf), a step
# that would leave a non-finite value, and a load whose checkpoint object is missing or damaged.
SKIP_REASONS = (
    "bad_headers",
    "bad_payload",
    "bad_lr",
    "bad_ids",
    "bad_grads",
    "non_finite_step",
    "load_missing",
    "load_corrupt",
)


# Most specific first: an error takes the status of the first class in its MRO found here.
STATUS_BY_ERROR: Mapping[type[RobezError], int] = {
    UnauthorizedError: 401,
    ForbiddenError: 403,
    PayloadTooLargeError: 413,
    StorageFullError: 507,
    NotFoundError: 404,
    ConflictError: 409,
    LimitExceededError: 422,
    InvalidInputError: 422,
    ConfigError: 422,
    BusyError: 503,
    CorruptionError: 500,
    RobezError: 500,
}

# The gRPC status code (grpc.StatusCode's name) of each HTTP status above: the gRPC server answers an
# error with the code of the status HTTP would answer it with (docs/api.md, gRPC).
GRPC_CODE_BY_STATUS: Mapping[int, str] = {
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    413: "RESOURCE_EXHAUSTED",
    422: "INVALID_ARGUMENT",
    499: "CANCELLED",  # the client left (cancelled, reset, or its deadline passed): nothing was answered
    503: "UNAVAILABLE",
    507: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
}

_MAX_VALIDATION_ERRORS_SHOWN = 5


def status_for(error: RobezError) -> int:
    """The HTTP status of a ``RobezError`` per ``STATUS_BY_ERROR``."""
    for cls in type(error).__mro__:
        status = STATUS_BY_ERROR.get(cls)
        if status is not None:
            return status
    return 500


def grpc_code_for(status: int) -> str:
    """The gRPC status code name (``grpc.StatusCode[name]``) of an HTTP error status."""
    return GRPC_CODE_BY_STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")


def error_response(
    status: int, message: str, error_type: str, headers: Mapping[str, str] | None = None
) -> Response:
    """The one error body shape: ``{"error", "error_type"}``."""
    body = orjson.dumps({"error": message, "error_type": error_type})
    return Response(body, status_code=status, media_type="application/json", headers=dict(headers or {}))


def summarize_validation_errors(errors: Sequence[Any]) -> str:
    """A short message from pydantic errors; never echoes the (possibly huge) input."""
    parts = []
    for error in errors[:_MAX_VALIDATION_ERRORS_SHOWN]:
        location = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    if len(errors) > _MAX_VALIDATION_ERRORS_SHOWN:
        parts.append(f"... and {len(errors) - _MAX_VALIDATION_ERRORS_SHOWN} more")
    return "invalid request: " + "; ".join(parts)


def _headers_for(error: RobezError, request: Request) -> dict[str, str]:
    if isinstance(error, UnauthorizedError):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(error, BusyError):
        return {"Retry-After": str(request.app.state.settings.retry_after_s)}
    if isinstance(error, UpdateTooLargeError):
        return {MAX_UPDATE_BYTES_HEADER: str(error.max_update_bytes)}
    return {}


class _StorageFullLog:
    """One log line (no traceback) for the first write refused for lack of space, then at most one per
    ``every_seconds`` with the count refused meanwhile: a full disk under load must not flood the log."""

    def __init__(self, every_seconds: float = 10.0) -> None:
        self.every_seconds = every_seconds
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def refused(self, request: Request, error: StorageFullError) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_seconds:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        more = f" ({suppressed} more refused since the last such line)" if suppressed else ""
        logger.error("507 on %s %s: %s%s", request.method, request.url.path, error, more)


_storage_full_log = _StorageFullLog()


async def _robez_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RobezError)
    status = status_for(exc)
    if isinstance(exc, StorageFullError):
        request.app.state.metrics.storage_full_total.inc()
        _storage_full_log.refused(request, exc)
    elif status >= 500:
        logger.error("%s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
    error_type = getattr(exc, "error_type", None) or type(exc).__name__
    return error_response(status, str(exc), error_type, _headers_for(exc, request))


async def _request_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return error_response(422, summarize_validation_errors(list(exc.errors())), "ValidationError")


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = {404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLargeError"}.get(
        exc.status_code, "HTTPError"
    )
    return error_response(exc.status_code, str(exc.detail), error_type, exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "InternalError")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the one body shape."""
    app.add_exception_handler(RobezError, _robez_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(ValidationError, _request_validation_error)
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected_error)
