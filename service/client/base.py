"""What the sync and async clients share: TLS settings, the auth header, the retry decisions, response
bookkeeping, and the multi-request operations written once as *plans*.

A plan is a generator that yields the ``Call``s to send and receives each answer's parsed value (or has
the ``RobezClientError`` thrown in); its return value is the operation's. ``RobezClient`` drives a plan
with blocking sends, ``AsyncRobezClient`` with awaited ones, so the logic of e.g. splitting a push after
a 413 exists once.
"""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
from torch import Tensor

from ..servertiming import parse_server_timing
from .calls import Call, PushAnswer, update_calls, update_many_calls
from .wire import (
    REPLICA_HEADER,
    VERSION_HEADER,
    IdsLike,
    RobezClientError,
    error_from_response,
)

T = TypeVar("T")
Plan = Generator[Call[Any], Any, T]
"""Yields calls to send, is sent each one's parsed answer, returns the operation's result."""

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_BUSY_RETRIES = 2
BUSY_BACKOFF_S = 0.1
MAX_BUSY_DELAY_S = 5.0
MAX_SPLITS = 3  # a push is split again only when a 413 names a smaller limit than the one it was split by

TLSVerify = bool | str | Path | ssl.SSLContext


def tls_verify(verify: TLSVerify, cert: tuple[str | Path, str | Path] | None = None) -> ssl.SSLContext | bool:
    """What httpx's ``verify=`` takes for a CA bundle path (or context, or bool) and an optional client
    certificate + key."""
    if isinstance(verify, ssl.SSLContext):
        context = verify
    elif verify is False:
        if cert is None:
            return False
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        cafile = None if verify is True else str(verify)
        context = ssl.create_default_context(cafile=cafile)
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return context


class ClientCore:
    """The state and decisions both clients share; subclasses add only the sending."""

    def __init__(self, api_key: str | None, busy_retries: int) -> None:
        if busy_retries < 0:
            raise ValueError(f"busy_retries must be >= 0, got {busy_retries}")
        self._auth_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.busy_retries = busy_retries
        self.last_timing: dict[str, float] = {}
        """Server-Timing figures (ms by stage) of the last completed request; {} when it had none."""
        self.last_version: int | None = None
        """The table version reported by the last response that carried one."""
        self._server_dedups = False
        self.max_update_bytes: int | None = None
        """The largest update body the server takes in one request, once a 413 told it (a replica's
        log entry limit); larger pushes are then split before sending."""

    # -- plans: operations of possibly several requests, sent by either client ---------------------

    def _update_plan(
        self, table: str, ids: IdsLike, grads: Tensor | np.ndarray, lr: float | None
    ) -> Plan[int]:
        """One push (``update``): one request, or consecutive parts after a 413 naming a smaller limit."""
        answers = yield from self._split_pushes(
            lambda key, limit: update_calls(table, ids, grads, lr, key, limit)
        )
        version: int = answers[-1] if answers else 0
        return version

    def _update_many_plan(
        self,
        updates: Mapping[str, tuple[IdsLike, Tensor | np.ndarray]],
        lr: float | None,
        lookups: Mapping[str, IdsLike] | None = None,
    ) -> Plan[PushAnswer]:
        """One multi-table push (``update_many``): one request, or (over a 413's limit) groups of tables
        in order, each its own request; the versions of every table, the last group's where split, and
        the rows of ``lookups`` (sent with the last request: read after every part is applied)."""
        answers = yield from self._split_pushes(
            lambda key, limit: update_many_calls(updates, lr, key, limit, lookups)
        )
        versions = {name: version for each, _ in answers for name, version in each.items()}
        return versions, answers[-1][1] if answers else {}

    def _split_pushes(self, calls: Callable[[str, int | None], Iterable[Call[Any]]]) -> Plan[list[Any]]:
        """The requests ``calls(key, limit)`` makes of a push (one Idempotency-Key for all of them), sent
        in order, and sent again split smaller after a 413 that names a lower limit (``_split_limit``);
        their answers in order."""
        key, limit = uuid.uuid4().hex, self.max_update_bytes
        for _ in range(MAX_SPLITS):
            answers: list[Any] = []
            try:
                for call in calls(key, limit):
                    answers.append((yield call))
                return answers
            except RobezClientError as error:
                limit = self._split_limit(error, limit, len(answers))
                if limit is None:
                    raise
        raise RobezClientError(
            413, f"the server lowered its update limit {MAX_SPLITS} times", "UpdateTooLargeError"
        )

    def _split_limit(self, error: RobezClientError, tried: int | None, parts_sent: int) -> int | None:
        """The update size to split a push by after ``error``, or None to raise it: only a 413 that
        names a smaller limit, and only while no part of the push was applied (a resplit would give the
        same part keys other contents)."""
        hint = error.max_update_bytes
        if error.status != 413 or hint is None or parts_sent or (tried is not None and hint >= tried):
            return None
        self.max_update_bytes = hint
        return hint

    # -- one request ------------------------------------------------------------------------------

    def _request_kwargs(self, call: Call[Any]) -> dict[str, Any]:
        headers = {**self._auth_headers, **call.headers}
        content = call.content
        if isinstance(content, tuple):  # parts: httpx sends each as it is, with this length (not chunked)
            headers["Content-Length"] = str(sum(len(part) for part in content))
            content = self._parts_content(content)
        return {
            "content": content,
            "json": call.json,
            "headers": headers,
            "params": dict(call.params) or None,
        }

    def _parts_content(self, parts: tuple[bytes, ...]) -> Any:
        """A body given as parts, as this client's httpx sends it: the parts themselves (a sync client
        writes each to the socket; h11 does not join them)."""
        return list(parts)

    def _busy_delay(self, response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before resending after a 503, or None when the answer is final.

        A 503 means the server refused the request before doing anything (saturated), so resending an
        update cannot apply it twice.
        """
        if response.status_code != 503 or attempt >= self.busy_retries:
            return None
        retry_after = error_from_response(response).retry_after
        delay = retry_after if retry_after is not None else BUSY_BACKOFF_S * 2**attempt
        return min(max(delay, 0.0), MAX_BUSY_DELAY_S)

    def _resend_after(self, call: Call[Any], error: httpx.TransportError, attempt: int) -> float | None:
        """Seconds to wait before resending after a transport error, or None to raise it.

        Nothing reached the server after a connect error, so any call may be resent. After other
        errors the request may have been applied: only a push with an Idempotency-Key to a server that
        said it is a replica (which applies the key once) is resent.
        """
        if attempt >= self.busy_retries:
            return None
        if not isinstance(error, httpx.ConnectError | httpx.ConnectTimeout) and not (
            call.resend_safe and self._server_dedups
        ):
            return None
        return min(BUSY_BACKOFF_S * 2**attempt, MAX_BUSY_DELAY_S)

    def _finish(self, call: Call[T], response: httpx.Response) -> T:
        if REPLICA_HEADER in response.headers:
            self._server_dedups = True
        self.last_timing = parse_server_timing(response.headers.get("Server-Timing"))
        if response.is_error:
            raise error_from_response(response)
        result = call.parse(response)
        version_header = response.headers.get(VERSION_HEADER)
        if version_header is not None and version_header.isdigit():
            self.last_version = int(version_header)
        elif isinstance(result, int) and not isinstance(result, bool):
            self.last_version = result
        return result
