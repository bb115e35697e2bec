"""Direct answers (``service/http/direct.py``): a connection answers hot-route requests that arrive whole in
its own callback, and every answer, metric and limit is the one the middleware stack gives.

Each test drives ``robez serve``'s own HTTP protocol (``protocol.RobezHttpProtocol``) over an
in-memory transport, with the app's lifespan started as uvicorn starts it: once with direct answers (the
default) and once with ``direct_answers=False`` (every request through an ASGI task and the stack), and
compares the two byte for byte apart from the date and measured durations.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import uvloop
from uvicorn.config import Config
from uvicorn.lifespan.on import LifespanOn
from uvicorn.server import ServerState

from loadtest.hotpath import MemoryTransport
from service.app import create_app
from service.http.protocol import uvicorn_options
from service.store import TableStore

from ..conftest import make_settings

OCTET = "application/octet-stream"
KEY = "direct-test-key"


Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a scenario on asyncio's own event loop or on uvloop's (``robez serve``'s when installed)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def runner(coroutine: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=factory) as loop:
            return loop.run(coroutine)

    return runner


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key == name), None)


def _parse(data: bytes) -> tuple[list[Response], bytes]:
    """The whole responses at the start of ``data`` and what follows them."""
    responses = []
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = [(k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
        length = int(next((v for k, v in headers if k == "content-length"), "0"))
        if len(rest) < length:
            break
        responses.append(Response(int(lines[0].split()[1]), headers, rest[:length]))
        data = rest[length:]
    return responses, data


def request(
    method: str, path: str, body: bytes = b"", headers: Sequence[tuple[str, str]] = (), length: bool = True
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1:8000", *(f"{k}: {v}" for k, v in headers)]
    if length and (body or method == "POST"):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection:
    def __init__(self, served: Served) -> None:
        self.served = served
        self.transport = MemoryTransport()
        self.protocol = served.protocol_class(
            config=served.config, server_state=served.server_state, app_state=served.state
        )
        self.protocol.connection_made(self.transport)
        self._unread = b""

    def send(self, data: bytes) -> list[Response]:
        """Feed ``data``; the responses written before this returns (direct answers are)."""
        self.protocol.data_received(data)
        return self._take()

    def _take(self) -> list[Response]:
        self._unread += bytes(self.transport.written)
        self.transport.written.clear()
        responses, self._unread = _parse(self._unread)
        return responses

    async def responses(self, count: int, timeout_s: float = 20.0) -> list[Response]:
        """Wait until ``count`` responses in all have been written since the last call."""
        got: list[Response] = []
        async with asyncio.timeout(timeout_s):
            while len(got) < count:
                got += self._take()
                if len(got) < count:
                    await asyncio.sleep(0.001)
        return got

    async def exchange(self, data: bytes, count: int = 1) -> tuple[list[Response], bool]:
        """(the responses to ``data``, whether all were written before ``data_received`` returned)."""
        at_once = self.send(data)
        if len(at_once) >= count:
            return at_once, True
        return at_once + await self.responses(count - len(at_once)), False


@dataclass
class Served:
    app: Any
    config: Config
    state: dict[str, Any]
    server_state: ServerState
    protocol_class: Any

    @property
    def store(self) -> TableStore:
        store: TableStore = self.app.state.store
        return store

    def connect(self) -> Connection:
        return Connection(self)


@asynccontextmanager
async def serving(tmp_path: Path, **overrides: Any) -> AsyncIterator[Served]:
    settings = make_settings(tmp_path, **overrides)
    app = create_app(settings)
    config = Config(app=app, lifespan="on", log_level="warning", access_log=False, http="httptools")
    config.load()
    lifespan = LifespanOn(config)
    await lifespan.startup()
    assert not lifespan.should_exit
    try:
        yield Served(app, config, lifespan.state, ServerState(), uvicorn_options(settings)["http"])
    finally:
        await lifespan.shutdown()


@asynccontextmanager
async def both(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[Served, Served]]:
    """The same settings served with direct answers and without."""
    async with (
        serving(tmp_path / "direct", **overrides) as direct,
        serving(tmp_path / "stack", direct_answers=False, **overrides) as stack,
    ):
        yield direct, stack


_DURATION = re.compile(r"dur=[0-9.]+")


def normalized(response: Response) -> tuple[int, list[tuple[str, str]], Any]:
    """A response without what differs between two runs of the same request: the date, durations."""
    headers = [
        (name, _DURATION.sub("dur=?", value)) for name, value in response.headers if name not in ("date",)
    ]
    body: Any = response.body
    if response.header("content-type") == "application/json" and body:
        body = _without_timing(json.loads(body))  # its durations' digits change its length too
        headers = [(name, "?" if name == "content-length" else value) for name, value in headers]
    return response.status, headers, body


def _without_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (sorted(v) if k == "timing" else _without_timing(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_timing(v) for v in value]
    return value


def _ids(*ids: int) -> bytes:
    return np.array(ids, dtype="<i8").tobytes()


BINARY = [("content-type", OCTET), ("accept", OCTET)]
JSON = [("content-type", "application/json")]
AUTH = [("authorization", f"Bearer {KEY}")]


def _json_update(first: str) -> bytes:
    return ('{"ids": [4], "grads": [[' + first + ", 0" * 63 + "]]}").encode()


def _cases() -> list[tuple[str, bytes]]:
    grads = np.full((2, 64), 0.5, dtype="<f4").tobytes()
    binary_update = [("content-type", OCTET), ("x-robez-shape", "2,64")]
    return [
        ("healthz", request("GET", "/healthz")),
        ("binary lookup", request("POST", "/v1/tables/demo/lookup", _ids(3, 999), BINARY)),
        ("json lookup", request("POST", "/v1/tables/demo/lookup", b'{"ids": [3, 999]}', JSON)),
        (
            "json pooled",
            request("POST", "/v1/tables/demo/lookup", b'{"ids": [1, 2, 3], "offsets": [0, 1]}', JSON),
        ),
        (
            "multi lookup",
            request("POST", "/v1/lookup", b'{"lookups": [{"table": "demo", "ids": [5]}]}', JSON),
        ),
        (
            "binary update",
            request("POST", "/v1/tables/demo/update", _ids(1, 2) + grads, binary_update),
        ),
        (
            "json update",
            request("POST", "/v1/tables/demo/update", _json_update("0.1"), JSON),
        ),
        ("after updates", request("POST", "/v1/tables/demo/lookup", _ids(1, 2, 4), BINARY)),
        ("unknown table", request("POST", "/v1/tables/nope/lookup", _ids(1), BINARY)),
        ("id out of range", request("POST", "/v1/tables/demo/lookup", _ids(10_000_000), BINARY)),
        ("ragged binary ids", request("POST", "/v1/tables/demo/lookup", b"\x01\x02\x03", BINARY)),
        ("bad json", request("POST", "/v1/tables/demo/lookup", b'{"ids": [1,', JSON)),
        ("ids of the wrong type", request("POST", "/v1/tables/demo/lookup", b'{"ids": ["a"]}', JSON)),
        ("empty body", request("POST", "/v1/tables/demo/lookup", b"", JSON)),
        (
            "bad update shape",
            request(
                "POST",
                "/v1/tables/demo/update",
                _ids(1),
                [("content-type", OCTET), ("x-robez-shape", "1,65")],
            ),
        ),
        ("nan gradient", request("POST", "/v1/tables/demo/update", _json_update("NaN"), JSON)),
        ("query string (stack)", request("POST", "/v1/tables/demo/update?lr=0.5", _json_update("0"), JSON)),
        ("wrong method", request("GET", "/v1/tables/demo/lookup")),
        (
            "oip infer",
            request(
                "POST",
                "/v2/models/demo/infer",
                json.dumps(
                    {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [2], "data": [7, 8]}]}
                ).encode(),
                JSON,
            ),
        ),
        ("oip ready", request("GET", "/v2/health/ready")),
    ]


def test_direct_answers_are_the_stacks_byte_for_byte(run: Run, tmp_path: Path) -> None:
    run(_same_answers(tmp_path))


async def _same_answers(tmp_path: Path) -> None:
    async with both(tmp_path) as (direct, stack):
        fast, slow = direct.connect(), stack.connect()
        taken = []
        for name, data in _cases():
            (answer,), at_once = await fast.exchange(data)
            (expected,), stack_at_once = await slow.exchange(data)
            assert not stack_at_once, name
            assert normalized(answer) == normalized(expected), name
            if at_once:
                taken.append(name)
        # Whatever a hot route answers (errors included) is answered in the callback; the rest is not.
        assert "healthz" in taken and "binary lookup" in taken and "binary update" in taken
        assert "unknown table" in taken and "bad json" in taken
        assert "query string (stack)" not in taken and "wrong method" not in taken
        # Same requests counted under the same labels by both.
        assert _request_counts(direct) == _request_counts(stack)
        assert direct.store.version("demo") == stack.store.version("demo") == 3


def _request_counts(served: Served) -> dict[tuple[str, ...], float]:
    counts = {}
    for metric in served.app.state.metrics.requests_total.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[tuple(sorted(sample.labels.items()))] = sample.value
    return counts


def test_auth_is_checked_the_same(run: Run, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with both(tmp_path, api_key="write-" + KEY, read_api_key=KEY) as (direct, stack):
            lookup = ("/v1/tables/demo/lookup", _ids(1))
            cases = [
                request("POST", *lookup, BINARY),
                request("POST", *lookup, [*BINARY, ("authorization", "Bearer wrong")]),
                request("POST", *lookup, [*BINARY, *AUTH]),
            ]
            fast, slow = direct.connect(), stack.connect()
            statuses = []
            for data in cases:
                (answer,), at_once = await fast.exchange(data)
                (expected,), _ = await slow.exchange(data)
                assert at_once and normalized(answer) == normalized(expected)
                statuses.append(answer.status)
            assert statuses == [401, 403, 200]

    run(scenario())


def test_a_request_that_waits_finishes_in_a_task_once(run: Run, tmp_path: Path) -> None:
    """A lookup that waits for a newer version (X-Robez-Min-Version) stops in the handler: it is finished
    by a task from where it stopped, holding a waiter's place (not an in-flight slot: waits must not take
    the worker) meanwhile, and answered once."""

    async def scenario() -> None:
        async with serving(tmp_path, min_version_wait_ms=5000) as served:
            waiting, writer = served.connect(), served.connect()
            admission = served.app.state.admission
            assert (
                waiting.send(
                    request(
                        "POST", "/v1/tables/demo/lookup", _ids(7), [*BINARY, ("x-robez-min-version", "1")]
                    )
                )
                == []
            )
            await asyncio.sleep(0.05)
            assert admission.in_flight == 0 and admission.waiting == 1 and waiting.send(b"") == []
            grads = np.ones((1, 64), dtype="<f4").tobytes()
            (pushed,), at_once = await writer.exchange(
                request(
                    "POST",
                    "/v1/tables/demo/update",
                    _ids(7) + grads,
                    [("content-type", OCTET), ("x-robez-shape", "1,64")],
                )
            )
            assert at_once and pushed.status == 200 and pushed.header("x-robez-version") == "1"
            (answer,) = await waiting.responses(1)
            assert answer.status == 200 and answer.header("x-robez-version") == "1"
            rows = np.frombuffer(answer.body, dtype="<f4")
            assert rows.shape == (64,)
            np.testing.assert_array_equal(rows, served.store.lookup("demo", torch.tensor([7])).rows[0])
            assert admission.in_flight == 0 and admission.waiting == 0 and admission.held_bytes == 0
            await asyncio.sleep(0.05)
            assert waiting.send(b"") == [] and not waiting.transport.closed  # answered once, still open

    run(scenario())


def _push(ids: Sequence[int], value: float = 1.0) -> bytes:
    grads = np.full((len(ids), 64), value, dtype="<f4").tobytes()
    headers = [("content-type", OCTET), ("x-robez-shape", f"{len(ids)},64")]
    return request("POST", "/v1/tables/demo/update", _ids(*ids) + grads, headers)


def test_durable_updates_wait_for_the_disk_in_a_task_and_apply_once(run: Run, tmp_path: Path) -> None:
    """With a data directory an update goes to a worker thread and waits for its log record to be
    durable: each is finished by a task, applied exactly once, and the same as through the stack."""

    async def scenario(name: str, direct: bool) -> torch.Tensor:
        data_dir = tmp_path / name / "data"
        async with serving(tmp_path / name, data_dir=data_dir, direct_answers=direct) as served:
            connection = served.connect()
            versions = []
            for step in range(5):
                (answer,), at_once = await connection.exchange(_push([step, 3]))
                assert answer.status == 200 and not at_once
                versions.append(answer.header("x-robez-version"))
            assert versions == ["1", "2", "3", "4", "5"]
            assert served.store.version("demo") == 5
            return torch.from_numpy(served.store.lookup("demo", torch.arange(6)).rows.copy())

    assert run(scenario("direct", True)).equal(run(scenario("stack", False)))


def test_a_body_in_pieces_or_pipelined_requests(run: Run, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as served:
            connection = served.connect()
            data = request("POST", "/v1/tables/demo/lookup", _ids(1, 2, 3), BINARY)
            # The body is not complete when the bytes read so far end: the stack reads the rest.
            assert connection.send(data[:-5]) == []
            await asyncio.sleep(0.05)
            connection.send(data[-5:])
            (split,) = await connection.responses(1)
            (whole,), at_once = await connection.exchange(data)
            assert at_once and split.body == whole.body and split.status == 200
            # Three requests in one read: answered in order, in the callback.
            health = request("GET", "/healthz")
            answers, at_once = await connection.exchange(data + health + _push([9]), count=3)
            assert at_once and [a.status for a in answers] == [200, 200, 200]
            assert answers[0].body == whole.body and answers[2].header("x-robez-version") == "1"
            assert b'"status"' in answers[1].body

    run(scenario())


def test_limits_answer_through_the_stack(run: Run, tmp_path: Path) -> None:
    """A request the admission would refuse is not answered directly; the stack refuses it as before, with
    the same answer (status, headers, error body) and the same counts as without direct answers."""

    async def scenario() -> None:
        limits = {"max_json_body_bytes": 64, "max_in_flight": 2, "retry_after_s": 3}
        async with both(tmp_path, **limits) as (direct, stack):
            ids = b'{"ids": [%s]}' % b",".join([b"1"] * 40)
            large = request("POST", "/v1/tables/demo/lookup", ids, JSON)
            lookup = request("POST", "/v1/tables/demo/lookup", _ids(1), BINARY)
            health = request("GET", "/healthz")
            answers = []
            for served in (direct, stack):
                admission = served.app.state.admission
                connection = served.connect()
                (too_large,), at_once = await connection.exchange(large)
                assert too_large.status == 413 and not at_once
                admission.in_flight = 2  # two requests in flight elsewhere
                (saturated,), _ = await connection.exchange(lookup)
                (probe,), _ = await connection.exchange(health)  # probes are never limited
                admission.in_flight = 0
                admission.held_bytes = admission.limits.max_held_bytes - 4  # bodies held elsewhere
                (held,), _ = await connection.exchange(lookup)
                admission.held_bytes = 0
                assert [saturated.status, probe.status, held.status] == [503, 200, 503]
                assert saturated.header("retry-after") == held.header("retry-after") == "3"
                answers.append([normalized(a) for a in (too_large, saturated, probe, held)])
                assert admission.in_flight == 0 and admission.held_bytes == 0
            assert answers[0] == answers[1]
            assert _request_counts(direct) == _request_counts(stack)
            rejected = {"saturated": 1.0, "bodies_held": 1.0}
            assert _rejected_counts(direct) == _rejected_counts(stack) == rejected

    run(scenario())


def _rejected_counts(served: Served) -> dict[str, float]:
    return {
        sample.labels["reason"]: sample.value
        for metric in served.app.state.metrics.rejected_total.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def test_an_unexpected_error_is_answered_as_the_stack_does(
    run: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with both(tmp_path) as (direct, stack):
            answers = []
            for served in (direct, stack):

                def broken(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError("kernel exploded")

                served.store.lookup = broken  # type: ignore[method-assign]
                connection = served.connect()
                (answer,), _ = await connection.exchange(
                    request("POST", "/v1/tables/demo/lookup", _ids(1), BINARY)
                )
                await asyncio.sleep(0.05)
                answers.append((normalized(answer), connection.transport.closed))
            assert answers[0] == answers[1]
            assert answers[0][0][0] == 500 and answers[0][1]  # answered 500, connection closed

    run(scenario())
    assert "kernel exploded" in caplog.text
    # The app's handler for Exception saw (and logged) it once on each path.
    assert caplog.text.count("unexpected error on POST /v1/tables/demo/lookup") == 2


def test_connection_close_is_honoured(run: Run, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with both(tmp_path) as (direct, stack):
            results = []
            for served in (direct, stack):
                connection = served.connect()
                data = request("POST", "/v1/tables/demo/lookup", _ids(1), [*BINARY, ("connection", "close")])
                (answer,), _ = await connection.exchange(data)
                results.append((normalized(answer), connection.transport.closed))
            assert results[0] == results[1] and results[0][1]
            assert ("connection", "close") in results[0][0][1]

    run(scenario())


def test_http_1_0_and_the_access_log_are_the_stacks(run: Run, tmp_path: Path) -> None:
    """uvicorn's access log (when its logger has a handler) and an HTTP/1.0 client's close: direct answers
    write the same lines and bytes as uvicorn's own response writer."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    handler = Collect()

    async def scenario() -> None:
        async with both(tmp_path) as (direct, stack):
            access.addHandler(handler)  # after uvicorn's Config set its loggers up (a connection checks)
            access.setLevel(logging.INFO)
            for served in (direct, stack):
                lookup = request("POST", "/v1/tables/demo/lookup?x=1", _ids(1), BINARY)
                old = request("POST", "/v1/tables/demo/lookup", _ids(2), BINARY).replace(
                    b"HTTP/1.1", b"HTTP/1.0"
                )
                answers = []
                for data in (lookup, request("GET", "/healthz"), old):
                    connection = served.connect()
                    (answer,), _ = await connection.exchange(data)
                    answers.append((normalized(answer), connection.transport.closed))
                served.answers = answers  # type: ignore[attr-defined]
            assert direct.answers == stack.answers  # type: ignore[attr-defined]
            assert direct.answers[2][1] and ("connection", "close") in direct.answers[2][0][1]  # type: ignore[attr-defined]

    try:
        run(scenario())
    finally:
        access.removeHandler(handler)
    assert len(records) == 6 and records[:3] == records[3:], records
    assert '"POST /v1/tables/demo/lookup?x=1 HTTP/1.1" 200' in records[0]


def test_a_repeated_content_type_is_read_as_its_first_everywhere(run: Run, tmp_path: Path) -> None:
    """Routes, body limits and direct answers all take the first of two Content-Type headers (as
    Starlette's ``request.headers`` does): ids sent as binary first are binary ids, within the binary
    body limit, whichever path answers."""

    async def scenario() -> None:
        async with both(tmp_path, max_json_body_bytes=8) as (direct, stack):
            ids = _ids(*range(4))  # 32 bytes: over the JSON limit, within the binary one
            twice = request(
                "POST", "/v1/tables/demo/lookup", ids, [*BINARY, ("content-type", "application/json")]
            )
            once = request("POST", "/v1/tables/demo/lookup", ids, BINARY)
            answers = []
            for served in (direct, stack):
                (first,), _ = await served.connect().exchange(twice)
                (plain,), _ = await served.connect().exchange(once)
                assert first.status == 200 and first.body == plain.body
                answers.append(normalized(first))
            assert answers[0] == answers[1]

    run(scenario())
