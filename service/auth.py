"""Bearer keys: ``ROBEZ_API_KEY`` guards writes, optional ``ROBEZ_READ_API_KEY`` guards reads too.

No key set: everything is open (the default for local use on 127.0.0.1). The write key also grants
reads. Keys are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from pydantic import SecretStr

from .config import Settings
from .errors import ForbiddenError, UnauthorizedError


def _bearer_token(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str, key: SecretStr) -> bool:
    return hmac.compare_digest(token.encode(), key.get_secret_value().encode())


def _check(header: str | None, accepted: list[SecretStr]) -> None:
    if not accepted:
        return
    token = _bearer_token(header)
    if token is None:
        raise UnauthorizedError("this endpoint needs 'Authorization: Bearer <key>'")
    # Compare with every accepted key (no early exit) so timing does not tell which one nearly matched.
    matched = [_matches(token, key) for key in accepted]
    if not any(matched):
        raise ForbiddenError("the bearer key is not valid for this endpoint")


def check_read_access(settings: Settings, authorization: str | None) -> None:
    """Raise ``UnauthorizedError`` / ``ForbiddenError`` unless ``authorization`` (the value of an
    ``Authorization`` header or gRPC metadata, or None) grants reads: the read key (or the write key) when
    a read key is set. Transport-free: HTTP and gRPC check the same way."""
    if settings.read_api_key is None:
        return
    accepted = [settings.read_api_key]
    if settings.api_key is not None:
        accepted.append(settings.api_key)
    _check(authorization, accepted)


async def require_write_key(request: Request) -> None:
    """Dependency of create, delete, update and snapshot: the write key when one is set."""
    settings = request.app.state.settings
    _check(request.headers.get("authorization"), [settings.api_key] if settings.api_key is not None else [])


async def require_read_key(request: Request) -> None:
    """Dependency of lookups and table reads: the read key (or the write key) when a read key is set."""
    settings = request.app.state.settings
    if settings.read_api_key is None:
        return
    check_read_access(settings, request.headers.get("authorization"))


async def require_key_if_private(request: Request) -> None:
    """Dependency of ``/metrics``, ``/docs``, ``/openapi.json`` and ``GET /v2``: open, unless
    ``private_endpoints`` is set; then the read key or the write key (whichever are set)."""
    settings = request.app.state.settings
    if not settings.private_endpoints:
        return
    accepted = [key for key in (settings.read_api_key, settings.api_key) if key is not None]
    _check(request.headers.get("authorization"), accepted)


WriteAccess = Annotated[None, Depends(require_write_key)]
PrivateAccess = Annotated[None, Depends(require_key_if_private)]
ReadAccess = Annotated[None, Depends(require_read_key)]
