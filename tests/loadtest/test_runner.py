"""The runner against a scripted loopback server: counts add up, errors fail runs, loops stay bounded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from loadtest.runner import ClientFleet, ClientResult, RunSpec, merge_results
from loadtest.scenarios import ScenarioContext
from loadtest.transport import Target

DIM = 4


class _FakeServer:
    """A tiny HTTP/1.1 server on its own thread: /healthz, and lookups whose table name picks a behaviour.

    ``ok`` answers rows of zeros with X-Robez-Shape and Server-Timing, ``fail`` 500, ``busy`` 503,
    ``hang`` never answers.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = await reader.readexactly(length)
                writer.write(await self._answer(path, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _answer(path: str, body: bytes) -> bytes:
        if path == "/healthz":
            return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        table = path.split("/")[3]
        if table == "fail":
            return b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops"
        if table == "busy":
            return b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"
        if table == "hang":
            await asyncio.sleep(3600)
        rows = len(body) // 8
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Length: {rows * DIM * 4}\r\nX-Robez-Shape: {rows},{DIM}\r\n"
            "Server-Timing: hash;dur=0.01, lookup;dur=0.02, total;dur=0.05\r\n\r\n"
        )
        return head.encode() + bytes(rows * DIM * 4)

    def __enter__(self) -> Target:
        self.thread.start()
        assert self.started.wait(10)
        return Target("127.0.0.1", self.port)

    async def _cancel_connections(self) -> None:
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._cancel_connections(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    with _FakeServer() as address:
        yield address


@pytest.fixture(scope="module")
def fleet() -> Iterator[ClientFleet]:
    with ClientFleet(2) as clients:
        yield clients


def _context(target: Target, table: str = "ok") -> ScenarioContext:
    return ScenarioContext(target=target, table=table, tables=(table,), embedding_dim=DIM, num_ids=100)


@pytest.mark.slow
def test_closed_loop_counts_add_up(target: Target, fleet: ClientFleet) -> None:
    spec = RunSpec("t", "binary", batch_size=8, concurrency=4, max_requests=300, duration_s=20.0)
    result = fleet.run(spec, _context(target))
    assert result.ok == result.sent == result.completed == 300  # the request bound, split over 2 clients
    assert not result.failed and result.errors == {}
    assert result.ids == 300 * 8 and result.rows == 300 * 8
    assert result.response_bytes == 300 * 8 * DIM * 4
    assert result.latency_ms.count == 300 and result.latency_ms.max >= result.latency_ms.p99 > 0
    assert result.hash_ms.p50 == pytest.approx(0.01) and result.lookup_ms.p50 == pytest.approx(0.02)
    assert result.window_s > 0 and result.requests_per_s == pytest.approx(300 / result.window_s)
    assert result.embedding_bytes_per_s == pytest.approx(300 * 8 * DIM * 4 / result.window_s)
    assert len(result.client_cpu) == 2


@pytest.mark.slow
def test_closed_loop_stops_at_the_duration(target: Target, fleet: ClientFleet) -> None:
    spec = RunSpec("t", "healthz", concurrency=2, max_requests=10_000_000, duration_s=0.3)
    result = fleet.run(spec, _context(target))
    assert 0 < result.ok < 10_000_000
    assert result.window_s < 5.0
    assert result.ids == 0 and not result.failed


@pytest.mark.slow
def test_open_loop_sends_on_schedule(target: Target, fleet: ClientFleet) -> None:
    spec = RunSpec("t", "binary", batch_size=2, mode="open", rate=200.0, concurrency=8, duration_s=0.5)
    result = fleet.run(spec, _context(target))
    assert result.scheduled == result.sent == result.ok == 100  # 200/s for 0.5 s
    assert not result.failed


@pytest.mark.slow
def test_server_errors_fail_the_run(target: Target, fleet: ClientFleet) -> None:
    spec = RunSpec("t", "binary", concurrency=2, max_requests=20, duration_s=10.0)
    result = fleet.run(spec, _context(target, "fail"))
    assert result.errors == {"status 500": 20} and result.ok == 0
    assert result.failed
    assert any("oops" in sample for sample in result.error_samples)


@pytest.mark.slow
def test_expected_statuses_do_not_fail_the_run(target: Target, fleet: ClientFleet) -> None:
    spec = RunSpec("t", "binary", concurrency=2, max_requests=20, duration_s=10.0, expected_statuses=(503,))
    result = fleet.run(spec, _context(target, "busy"))
    assert result.expected == {503: 20} and result.errors == {}
    assert not result.failed


@pytest.mark.slow
def test_hung_requests_are_timeouts(target: Target, fleet: ClientFleet) -> None:
    spec = RunSpec("t", "binary", concurrency=2, max_requests=50, duration_s=0.2, drain_s=0.3)
    result = fleet.run(spec, _context(target, "hang"))
    assert result.errors == {"timeout": 2}  # one stuck request per connection, then the bound
    assert result.failed and result.window_s < 5.0


@pytest.mark.slow
def test_refused_connections_are_transport_errors(fleet: ClientFleet) -> None:
    closed = Target("127.0.0.1", 9)  # the discard port: nothing listens on loopback here
    spec = RunSpec("t", "healthz", concurrency=2, max_requests=10, duration_s=5.0)
    result = fleet.run(spec, _context(closed))
    assert sum(result.errors.values()) == 10
    assert all(kind.startswith("transport") for kind in result.errors)
    assert result.failed


def test_merge_results_sums_and_spans_the_window() -> None:
    first = ClientResult(ok=3, sent=4, completed=4, ids=30, rows=30, start=100.0, end=101.0, cpu_s=0.5)
    first.latency_ms += [1.0, 2.0, 3.0]
    first.errors["status 500"] += 1
    second = ClientResult(ok=2, sent=2, completed=2, ids=20, rows=20, start=100.5, end=102.0, cpu_s=0.3)
    second.latency_ms += [4.0, 5.0]
    result = merge_results(RunSpec("t", "binary", processes=2, concurrency=2), DIM, [first, second])
    assert (result.ok, result.sent, result.completed, result.ids) == (5, 6, 6, 50)
    assert result.window_s == pytest.approx(2.0)
    assert result.latency_ms.count == 5 and result.latency_ms.p50 == 3.0 and result.latency_ms.max == 5.0
    assert result.errors == {"status 500": 1} and result.failed
    assert result.client_cpu == pytest.approx([0.5, 0.2])
    assert result.requests_per_s == pytest.approx(2.5)


def test_run_spec_validation() -> None:
    with pytest.raises(ValueError):
        RunSpec("t", "binary", mode="sideways")
    with pytest.raises(ValueError):
        RunSpec("t", "binary", mode="open", rate=0.0)
    with pytest.raises(ValueError):
        RunSpec("t", "binary", max_requests=0)
    with pytest.raises(ValueError):
        RunSpec("t", "binary", transport="curl")
