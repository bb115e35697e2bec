"""``AsyncRobezClient``: the ``asyncio`` twin of ``RobezClient`` (same methods, awaited). Both build
their requests with ``calls`` and run multi-request operations as the same plans (``base``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
from torch import Tensor

from .base import (
    DEFAULT_BUSY_RETRIES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    ClientCore,
    Plan,
    TLSVerify,
    tls_verify,
)
from .calls import (
    Call,
    create_call,
    lookup_call,
    lookup_many_call,
    lookup_pooled_call,
    parse_json,
    parse_tables,
    table_path,
)
from .wire import IdsLike, RobezClientError

T = TypeVar("T")


class AsyncRobezClient(ClientCore):
    """The ``asyncio`` twin of ``RobezClient``: same methods, awaited; same arguments and errors."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        busy_retries: int = DEFAULT_BUSY_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        verify: TLSVerify = True,
        cert: tuple[str | Path, str | Path] | None = None,
    ) -> None:
        super().__init__(api_key, busy_retries)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, verify=tls_verify(verify, cert)
        )

    def _parts_content(self, parts: tuple[bytes, ...]) -> Any:
        """The parts as an async iterable (httpx's async client takes no sync iterable), one per send."""

        async def each() -> AsyncIterator[bytes]:
            for part in parts:
                yield part

        return each()

    async def _send(self, call: Call[T]) -> T:
        for attempt in range(self.busy_retries + 1):
            try:
                response = await self._http.request(call.method, call.path, **self._request_kwargs(call))
            except httpx.TransportError as error:
                wait = self._resend_after(call, error, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            delay = self._busy_delay(response, attempt)
            if delay is None:
                break
            await asyncio.sleep(delay)
        return self._finish(call, response)

    async def _run(self, plan: Plan[T]) -> T:
        """Sends each call of ``plan`` in turn and returns its result (see ``base``)."""
        try:
            call = next(plan)
            while True:
                try:
                    answer = await self._send(call)
                except RobezClientError as error:
                    call = plan.throw(error)
                else:
                    call = plan.send(answer)
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncRobezClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def health(self) -> dict[str, Any]:
        return await self._send(Call("GET", "/healthz", parse_json))

    async def ready(self) -> dict[str, Any]:
        return await self._send(Call("GET", "/readyz", parse_json))

    async def tables(self) -> list[dict[str, Any]]:
        return await self._send(Call("GET", "/v1/tables", parse_tables))

    async def table(self, name: str) -> dict[str, Any]:
        return await self._send(Call("GET", table_path(name), parse_json))

    async def create_table(
        self,
        name: str,
        config: Mapping[str, Any],
        optimizer: Mapping[str, Any] | None = None,
        share_array_with: str | None = None,
    ) -> dict[str, Any]:
        return await self._send(create_call(name, config, optimizer, share_array_with))

    async def delete_table(self, name: str) -> None:
        await self._send(Call("DELETE", table_path(name), lambda response: None))

    async def lookup(self, table: str, ids: IdsLike, *, min_version: int | None = None) -> Tensor:
        return await self._send(lookup_call(table, ids, min_version))

    async def lookup_pooled(
        self,
        table: str,
        ids: IdsLike,
        offsets: IdsLike,
        pooling: str = "sum",
        per_sample_weights: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        return await self._send(lookup_pooled_call(table, ids, offsets, pooling, per_sample_weights))

    async def lookup_many(
        self, requests: Mapping[str, IdsLike], *, min_versions: Mapping[str, int] | None = None
    ) -> dict[str, Tensor]:
        return await self._send(lookup_many_call(requests, min_versions))

    async def update(
        self, table: str, ids: IdsLike, grads: Tensor | np.ndarray, lr: float | None = None
    ) -> int:
        return await self._run(self._update_plan(table, ids, grads, lr))

    async def update_many(
        self, updates: Mapping[str, tuple[IdsLike, Tensor | np.ndarray]], lr: float | None = None
    ) -> dict[str, int]:
        versions, _ = await self._run(self._update_many_plan(updates, lr))
        return versions

    async def update_and_lookup(
        self,
        updates: Mapping[str, tuple[IdsLike, Tensor | np.ndarray]],
        lookups: Mapping[str, IdsLike],
        lr: float | None = None,
    ) -> tuple[dict[str, int], dict[str, Tensor]]:
        """``RobezClient.update_and_lookup``: a push and then a read of ``lookups`` in one request."""
        return await self._run(self._update_many_plan(updates, lr, lookups))
