"""Request limits before a route: bodies arrive whole, in time and within their size before a request is
admitted; saturation: bounded in-flight requests per worker, the rest answered 503 with Retry-After."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import numpy as np
import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from service.http.admission import Admission, BodyLimits
from service.http.middleware import (
    BodyDeadlines,
    BodyTimeout,
    InFlightLimitMiddleware,
    RequestBodyMiddleware,
    read_body,
)
from service.metrics import Metrics

from ..served import raw_connection, read_until_closed
from ..subprocess_server import RobezServer, serve

OCTET = {"content-type": "application/octet-stream"}


def test_saturated_worker_answers_503_with_retry_after() -> None:
    release = anyio.Event()
    entered = anyio.Event()

    async def slow_app(scope, receive, send):
        if scope["path"] != "/healthz":
            entered.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    metrics = Metrics()
    limits = BodyLimits(1 << 20, 1 << 20, timeout_s=30.0, max_held_bytes=1 << 30, retry_after_s=3)
    app = InFlightLimitMiddleware(slow_app, Admission(limits, max_in_flight=1, metrics=metrics))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            results: dict[str, httpx.Response] = {}

            async def first() -> None:
                results["first"] = await client.post("/v1/tables/demo/lookup")

            async with anyio.create_task_group() as group:
                group.start_soon(first)
                with anyio.fail_after(10):
                    await entered.wait()
                refused = await client.post("/v1/tables/demo/lookup")
                probe = await client.get("/healthz")  # probes bypass the limit
                release.set()
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "3"
            assert refused.json()["error_type"] == "BusyError"
            assert "max_in_flight=1" in refused.json()["error"]
            assert probe.status_code == 200
            assert results["first"].status_code == 200
            after = await client.post("/v1/tables/demo/lookup")
            assert after.status_code == 200  # the slot was given back

    anyio.run(scenario)
    samples = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples["robez_rejected_total"] == 1.0


# -- request bodies: received whole, in time, before a request takes an in-flight slot -------------------

LOOKUP_HEAD = (
    b"POST /v1/tables/demo/lookup HTTP/1.1\r\nHost: test\r\n"
    b"Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n"
)
STALLED_BODY = b"\x01" * 9  # of the 1000 bytes announced


def _ok_app(seen: list[bytes]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        seen.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def _stack(
    app: Any, metrics: Metrics, *, max_in_flight: int = 1, timeout_s: float = 30.0, held: int = 1 << 30
) -> Any:
    limits = BodyLimits(
        max_body_bytes=1 << 20, max_json_body_bytes=1 << 10, timeout_s=timeout_s, max_held_bytes=held
    )
    admission = Admission(limits, max_in_flight=max_in_flight, metrics=metrics)
    return RequestBodyMiddleware(InFlightLimitMiddleware(app, admission), admission)


def _scope(content_type: bytes = b"application/octet-stream", length: int = 1000) -> dict[str, Any]:
    headers = [(b"content-type", content_type), (b"content-length", str(length).encode())]
    return {"type": "http", "method": "POST", "path": "/v1/tables/demo/lookup", "headers": headers}


async def _call(app: Any, scope: dict[str, Any], messages: list[Message]) -> list[Message]:
    """Run one request whose receive yields ``messages`` and then blocks (a stalled client)."""
    pending = list(messages)
    sent: list[Message] = []

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _status(sent: list[Message]) -> int:
    return int(sent[0]["status"])


def test_a_stalled_body_takes_no_in_flight_slot() -> None:
    seen: list[bytes] = []
    metrics = Metrics()
    app = _stack(_ok_app(seen), metrics, max_in_flight=1)

    async def scenario() -> list[Message]:
        async with anyio.create_task_group() as group:
            # Two stalled bodies, more than max_in_flight=1: neither is admitted, neither blocks others.
            for _ in range(2):
                group.start_soon(
                    _call, app, _scope(), [{"type": "http.request", "body": STALLED_BODY, "more_body": True}]
                )
            await anyio.sleep(0.05)
            body = b"\x00" * 16
            sent = await _call(
                app, _scope(length=16), [{"type": "http.request", "body": body, "more_body": False}]
            )
            group.cancel_scope.cancel()
        return sent

    sent = anyio.run(scenario)
    assert _status(sent) == 200
    assert seen == [b"\x00" * 16]  # the app got the whole body in one message


def test_a_body_that_does_not_arrive_in_time_gets_408_and_closes_the_connection() -> None:
    metrics = Metrics()
    app = _stack(_ok_app([]), metrics, timeout_s=0.2)
    sent = anyio.run(
        _call, app, _scope(), [{"type": "http.request", "body": STALLED_BODY, "more_body": True}]
    )
    assert _status(sent) == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    assert orjson.loads(sent[1]["body"])["error_type"] == "RequestTimeoutError"
    assert _sample(metrics, "robez_rejected_total", reason="body_timeout") == 1.0


def test_only_the_body_deadline_becomes_a_timeout_other_cancellations_pass_through() -> None:
    deadlines = BodyDeadlines(check_s=0.05)

    async def stalled() -> Message:
        await asyncio.sleep(3600)
        raise AssertionError

    async def scenario() -> None:
        with pytest.raises(BodyTimeout):  # the deadline passed
            await read_body(stalled, 100, 0.1, lambda size: None, deadlines)
        reader = asyncio.ensure_future(read_body(stalled, 100, 30.0, lambda size: None, deadlines))
        await asyncio.sleep(0.1)
        reader.cancel()  # e.g. the server shutting down, long before the deadline
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(scenario())


def test_a_client_leaving_mid_body_is_counted_and_not_answered() -> None:
    metrics = Metrics()
    app = _stack(_ok_app([]), metrics)
    messages: list[Message] = [
        {"type": "http.request", "body": STALLED_BODY, "more_body": True},
        {"type": "http.disconnect"},
    ]
    assert anyio.run(_call, app, _scope(), messages) == []
    assert _sample(metrics, "robez_client_disconnects_total") == 1.0


def test_json_bodies_have_their_own_smaller_limit() -> None:
    metrics = Metrics()
    app = _stack(_ok_app([]), metrics)
    big = b"[" + b"0," * 1000 + b"0]"  # 2 KiB: over the JSON limit (1 KiB), under the binary one (1 MiB)
    whole: list[Message] = [{"type": "http.request", "body": big, "more_body": False}]
    refused = anyio.run(_call, app, _scope(b"application/json", len(big)), whole)
    assert _status(refused) == 413
    assert b"max_json_body_bytes=1024" in refused[1]["body"]
    streamed: list[Message] = [  # no Content-Length: counted as it streams in
        {"type": "http.request", "body": big[:1000], "more_body": True},
        {"type": "http.request", "body": big[1000:], "more_body": False},
    ]
    chunked = {**_scope(b"application/json"), "headers": [(b"transfer-encoding", b"chunked")]}
    assert _status(anyio.run(_call, app, chunked, streamed)) == 413
    assert _status(anyio.run(_call, app, _scope(length=len(big)), whole)) == 200  # binary


def test_a_worker_holds_at_most_max_body_bytes_held_of_bodies() -> None:
    """Bodies count from the bytes that arrived until their request is answered; over the budget: 503."""
    release = anyio.Event()
    entered = anyio.Event()

    async def slow_app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        entered.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    metrics = Metrics()
    app = _stack(slow_app, metrics, max_in_flight=8, held=100)

    def whole(size: int) -> list[Message]:
        return [{"type": "http.request", "body": b"\x00" * size, "more_body": False}]

    async def scenario() -> dict[str, list[Message]]:
        sent: dict[str, list[Message]] = {}

        async def first() -> None:
            sent["first"] = await _call(app, _scope(length=80), whole(80))

        async with anyio.create_task_group() as group:
            group.start_soon(first)
            with anyio.fail_after(10):
                await entered.wait()
            sent["declared"] = await _call(app, _scope(length=40), whole(40))  # 80 + 40 > 100, up front
            chunked = {**_scope(), "headers": [(b"transfer-encoding", b"chunked")]}
            sent["streamed"] = await _call(app, chunked, whole(40))  # no length: refused on arrival
            release.set()
        sent["after"] = await _call(app, _scope(length=90), whole(90))  # the first's 80 bytes given back
        return sent

    sent = anyio.run(scenario)
    assert _status(sent["first"]) == 200
    for refused in (sent["declared"], sent["streamed"]):
        assert _status(refused) == 503
        assert (b"retry-after", b"1") in refused[0]["headers"]
        assert b"max_body_bytes_held=100" in refused[1]["body"]
    assert (b"connection", b"close") in sent["streamed"][0]["headers"]
    assert _status(sent["after"]) == 200
    assert app.admission.held_bytes == 0  # everything given back
    assert _sample(metrics, "robez_rejected_total", reason="bodies_held") == 2.0


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RobezServer]:
    """One real server for the socket-level tests below: a short body timeout, few in-flight slots."""
    with serve(
        tmp_path_factory.mktemp("served"), body_timeout_s="2", max_in_flight="8", log_level="info"
    ) as s:
        yield s


@pytest.mark.slow
def test_stalled_bodies_do_not_deny_service_and_are_closed(server: RobezServer) -> None:
    """40 clients send a lookup's headers and 9 of 1000 body bytes, then stall: more than max_in_flight.
    Normal lookups keep succeeding, and every stalled connection gets 408 and is closed."""
    stalled_count = 40
    timeouts_before = server.metric("robez_rejected_total", reason="body_timeout")
    stalled = [raw_connection(server.port, LOOKUP_HEAD + STALLED_BODY) for _ in range(stalled_count)]
    try:
        ids = np.arange(4, dtype="<i8").tobytes()
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(20):
                response = client.post("/v1/tables/demo/lookup", content=ids, headers=OCTET)
                assert response.status_code == 200, response.text
        deadline = time.monotonic() + 60
        answers = [read_until_closed(sock, deadline) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert all(answer is not None for answer in answers), "stalled connections still open"
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers if answer is not None)
    assert server.metric("robez_rejected_total", reason="body_timeout") == timeouts_before + stalled_count
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_clients_leaving_mid_body_log_no_traceback_and_are_counted(server: RobezServer) -> None:
    leaving = 10
    # Counted as "client closed request", not as server errors.
    labels = {"endpoint": "unmatched", "method": "POST", "table": "", "status": "499"}
    before = server.metric("robez_client_disconnects_total"), server.metric("robez_requests_total", **labels)
    for _ in range(leaving):
        raw_connection(server.port, LOOKUP_HEAD + STALLED_BODY).close()
    deadline = time.monotonic() + 60
    while server.metric("robez_client_disconnects_total") < before[0] + leaving:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    assert server.metric("robez_client_disconnects_total") == before[0] + leaving
    assert server.metric("robez_requests_total", **labels) == before[1] + leaving
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log
