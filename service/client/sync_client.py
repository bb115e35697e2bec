"""``RobezClient``: the blocking client (httpx), one keep-alive connection per client."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
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


class RobezClient(ClientCore):
    """Blocking client for one robez server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer <key>`` on every request when set.
        timeout: seconds for connect/read/write.
        busy_retries: times a request the server refused as saturated (503) is sent again, after its
            ``Retry-After`` (at most 5 s) or an exponential backoff from 0.1 s; 0 raises at once.
        transport: an ``httpx`` transport (e.g. ``httpx.MockTransport`` in tests).
        http_client: an existing ``httpx.Client`` to send through instead (e.g. FastAPI's ``TestClient``);
            its own base URL is used and the client is not closed by ``close()``.
        verify: for ``https://`` URLs: a CA bundle file the server's certificate must chain to (a
            server started with ``--tls-cert``), an ``ssl.SSLContext``, True (the system's CAs) or False
            (no check; never across a network you do not own).
        cert: (certificate file, key file) presented to a server that requires client certificates
            (``--tls-client-ca``).

    Errors: every non-2xx answer (after ``busy_retries`` for 503s) raises ``RobezClientError``; transport
    failures raise ``httpx`` errors.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        busy_retries: int = DEFAULT_BUSY_RETRIES,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
        verify: TLSVerify = True,
        cert: tuple[str | Path, str | Path] | None = None,
    ) -> None:
        super().__init__(api_key, busy_retries)
        self._owns_http = http_client is None
        self._new_http: Callable[[], httpx.Client] = lambda: httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport, verify=tls_verify(verify, cert)
        )
        self._http = http_client or self._new_http()

    def _send(self, call: Call[T]) -> T:
        for attempt in range(self.busy_retries + 1):
            try:
                response = self._http.request(call.method, call.path, **self._request_kwargs(call))
            except httpx.TransportError as error:
                wait = self._resend_after(call, error, attempt)
                if wait is None:
                    raise
                time.sleep(wait)
                continue
            delay = self._busy_delay(response, attempt)
            if delay is None:
                break
            time.sleep(delay)
        return self._finish(call, response)

    def _run(self, plan: Plan[T]) -> T:
        """Sends each call of ``plan`` in turn and returns its result (see ``base``)."""
        try:
            call = next(plan)
            while True:
                try:
                    answer = self._send(call)
                except RobezClientError as error:
                    call = plan.throw(error)
                else:
                    call = plan.send(answer)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def worker(self) -> int:
        """The pid of the server worker this client's keep-alive connection reached (``/healthz``)."""
        return int(self.health()["pid"])

    def reconnect(self) -> None:
        """Drop this client's connections; the next request opens a new one, which ``robez serve
        --workers N`` may hand to another worker (the kernel gives a new connection to whichever worker
        accepts it first). Trainers each keep one connection, so with several trainers and workers, a
        trainer whose ``worker()`` is already another trainer's can reconnect to spread the load."""
        if not self._owns_http:
            raise RuntimeError("a client over a given http_client cannot reconnect it")
        self._http.close()
        self._http = self._new_http()

    def __enter__(self) -> RobezClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: the liveness body; raises ``RobezClientError`` when the server is not live."""
        return self._send(Call("GET", "/healthz", parse_json))

    def ready(self) -> dict[str, Any]:
        """``GET /readyz``: raises ``RobezClientError`` (503) until the tables are loaded."""
        return self._send(Call("GET", "/readyz", parse_json))

    def tables(self) -> list[dict[str, Any]]:
        """``GET /v1/tables``: one description per table (config, version, compression ratio)."""
        return self._send(Call("GET", "/v1/tables", parse_tables))

    def table(self, name: str) -> dict[str, Any]:
        """``GET /v1/tables/{name}``: config, optimizer and version of one table."""
        return self._send(Call("GET", table_path(name), parse_json))

    def create_table(
        self,
        name: str,
        config: Mapping[str, Any],
        optimizer: Mapping[str, Any] | None = None,
        share_array_with: str | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/tables``: creates a table from a ``TableConfig``-shaped dict; returns its description.

        Args:
            config: e.g. ``{"num_embeddings": 10**6, "embedding_dim": 64, "memory_size": 2**20}``.
            optimizer: e.g. ``{"name": "adagrad", "lr": 0.05}``; the server's default when None.
            share_array_with: name of an existing table whose array the new one reads and trains too
                (give the two different ``val_offset`` values).
        """
        return self._send(create_call(name, config, optimizer, share_array_with))

    def delete_table(self, name: str) -> None:
        """``DELETE /v1/tables/{name}``."""
        self._send(Call("DELETE", table_path(name), lambda response: None))

    def lookup(self, table: str, ids: IdsLike, *, min_version: int | None = None) -> Tensor:
        """Rows of ``ids`` over the binary path: int64 (n,) -> float32 (n, d). ``min_version``: the
        server first waits (bounded) until it has that table version (read-your-writes on replicas)."""
        return self._send(lookup_call(table, ids, min_version))

    def lookup_pooled(
        self,
        table: str,
        ids: IdsLike,
        offsets: IdsLike,
        pooling: str = "sum",
        per_sample_weights: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        """Server-pooled bags (JSON), like ``nn.EmbeddingBag``: ids (N,), offsets (B,) -> (B, d)."""
        return self._send(lookup_pooled_call(table, ids, offsets, pooling, per_sample_weights))

    def lookup_many(
        self, requests: Mapping[str, IdsLike], *, min_versions: Mapping[str, int] | None = None
    ) -> dict[str, Tensor]:
        """Several tables in one binary request (``POST /v1/lookup``): {table: (n_t,)} -> {table: (n_t, d_t)}.

        A DLRM-style request touching many tables costs one round trip instead of one per table.
        ``min_versions``: {table: version} the server first waits for (read-your-writes on replicas).
        """
        return self._send(lookup_many_call(requests, min_versions))

    def update(self, table: str, ids: IdsLike, grads: Tensor | np.ndarray, lr: float | None = None) -> int:
        """Pushes gradients of rows (binary path); the server applies the table's optimizer.

        A push over what the server takes in one update (a replica's 413 names it; remembered in
        ``max_update_bytes``) is sent as consecutive parts of the ids, each its own update and version;
        duplicates of an id in two parts are then two optimizer steps.

        Args:
            ids: (n,) ids; duplicates have their gradients summed by the server.
            grads: (n, d) float gradients dLoss/dRow.
            lr: overrides the table's learning rate for this update only.

        Returns:
            The table version this update (its last part) produced.
        """
        return self._run(self._update_plan(table, ids, grads, lr))

    def update_many(
        self, updates: Mapping[str, tuple[IdsLike, Tensor | np.ndarray]], lr: float | None = None
    ) -> dict[str, int]:
        """Pushes the gradients of several tables in one binary request (``POST /v1/update``): one
        training step's pushes in one round trip, applied all-or-nothing by the server.

        Args:
            updates: {table: (ids (n_t,), grads (n_t, d_t))}; each table at most once.
            lr: overrides every table's learning rate for this push only.

        Returns:
            {table: the version this push produced}, in the order of ``updates``.

        A push over what the server takes in one request (a replica's 413 names it; remembered in
        ``max_update_bytes``) is sent as consecutive groups of tables (a table over the limit alone as
        consecutive parts of its ids), each group all-or-nothing on its own.
        """
        versions, _ = self._run(self._update_many_plan(updates, lr))
        return versions

    def update_and_lookup(
        self,
        updates: Mapping[str, tuple[IdsLike, Tensor | np.ndarray]],
        lookups: Mapping[str, IdsLike],
        lr: float | None = None,
    ) -> tuple[dict[str, int], dict[str, Tensor]]:
        """``update_many`` and then ``lookup_many`` in one request (``POST /v1/update`` with a lookup
        part): the server checks both, applies the push (all-or-nothing), then reads the rows of
        ``lookups``, which therefore include the push (read-your-writes). A training step's push and
        the next batch's pull in one round trip.

        Args:
            updates: {table: (ids (n_t,), grads (n_t, d_t))}; each table at most once.
            lookups: {table: ids (m_t,)} to read after the push (any tables, pushed or not).
            lr: overrides every table's learning rate for this push only.

        Returns:
            ({table: the version this push produced}, {table: rows (m_t, d_t)}). A bad lookup part is
            refused (``RobezClientError``, 4xx) before the push is applied. A push split after a 413 (see
            ``update_many``) sends the lookup part with its last request.
        """
        return self._run(self._update_many_plan(updates, lr, lookups))
