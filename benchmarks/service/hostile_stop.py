"""How long ``robez serve`` takes to stop on SIGTERM while hostile or broken peers hold it (issue 40.5).

Each scenario starts a real server (1 worker unless ``--workers``; the demo table; 127.0.0.1), sets up
what the peers hold, sends SIGTERM to the server process (what ``docker stop`` / Kubernetes send) and
measures the time until it exits, its exit status, and whether its ``/dev/shm`` directory is left:

- ``plain-idle``: one idle HTTP keep-alive client (the reference);
- ``https-idle``: one idle HTTPS keep-alive client;
- ``https-handshakes``: ``--handshakes`` TCP connections to the HTTPS port that never send a
  ClientHello; also counted: how many the server still holds open ``header_timeout_s`` + 3 s later;
- ``grpc-idle``: an open gRPC channel (HTTP/2 connection) that made one call, idle;
- ``grpc-stalled``: 8 gRPC calls, each a message declared 1 MiB of which 4 KiB were sent, then nothing;
- ``otlp-down`` / ``otlp-silent``: tracing on, the OTLP collector's port closed / accepting and never
  answering, after a few traced requests; also counted: the log lines about the export.

And two that are no stop: ``bad-key`` (a start with a key that is not the certificate's: does it stop,
how, how many log lines) and ``traceparent-flood`` (1,000 ``/healthz`` calls with a 600-character
``traceparent``, tracing on: the log lines they write).

Run (figures in docs/benchmarks/hostile-client-*.md):

    flock /tmp/robez-bench.lock .venv/bin/python -m benchmarks.service.hostile_stop
    flock /tmp/robez-bench.lock .venv/bin/python -m benchmarks.service.hostile_stop --workers 2 \
        --scenario bad-key --scenario traceparent-flood
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

SCENARIOS = (
    "plain-idle",
    "https-idle",
    "https-handshakes",
    "grpc-idle",
    "grpc-stalled",
    "otlp-down",
    "otlp-silent",
)
# Not stops: what a start with a bad TLS key does, and what 1,000 over-long traceparents write to the log.
OTHER_SCENARIOS = ("bad-key", "traceparent-flood")


def bad_key(workdir: Path, workers: int, wait_s: float = 60.0) -> dict[str, Any]:
    """``robez serve --workers N`` with a key that is not the certificate's: whether it stopped within
    ``wait_s``, its exit status and how many log lines it wrote."""
    import trustme

    ca = trustme.CA()
    certs = _Certificates(workdir)
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(workdir / "other.key"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROBEZ_", "OTEL_"))}
    env.update({"ROBEZ_SHM_DIR": str(workdir / "shm"), "ROBEZ_TLS_CERT": str(certs.cert)})
    env["ROBEZ_TLS_KEY"] = str(workdir / "other.key")
    log_path = workdir / "server.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service",
                "serve",
                "--port",
                str(_free_port()),
                "--workers",
                str(workers),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        status: int | None = process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        status = None
    elapsed = time.monotonic() - started
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    lines = log_path.read_text(errors="replace").splitlines()
    return {
        "scenario": "bad-key",
        "workers": workers,
        "stopped_within_s": round(elapsed, 1) if status is not None else f"no, still running at {wait_s:g}",
        "exit_status": status,
        "log_lines": len(lines),
        "first_line": lines[0][:160] if lines else "",
    }


def traceparent_flood(workdir: Path, workers: int, requests: int = 1000) -> dict[str, Any]:
    """``requests`` unauthenticated ``GET /healthz`` with a 600-character traceparent, tracing on (the
    collector's port closed): the log lines written about them, and the time they took."""
    env = {"ROBEZ_LOG_LEVEL": "info", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_free_port()}"}
    server = _Server(workdir, env, ["--workers", str(workers)])
    header = {"traceparent": "00-" + "a" * 597}
    try:
        before = len(server.log().splitlines())
        started = time.monotonic()
        with httpx.Client(base_url=server.url) as client:
            for _ in range(requests):
                client.get("/healthz", headers=header)
        elapsed = time.monotonic() - started
        time.sleep(1.0)
        new = server.log().splitlines()[before:]
    finally:
        server.stop()
    return {
        "scenario": "traceparent-flood",
        "workers": workers,
        "requests": requests,
        "seconds": round(elapsed, 2),
        "traceparent_log_lines": sum("traceparent" in line for line in new),
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Certificates:
    def __init__(self, directory: Path) -> None:
        import trustme

        self.ca = trustme.CA()
        server = self.ca.issue_cert("127.0.0.1")
        self.ca_file, self.cert, self.key = (
            directory / "ca.pem",
            directory / "server.pem",
            directory / "server.key",
        )
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        server.cert_chain_pems[0].write_to_path(str(self.cert))
        server.private_key_pem.write_to_path(str(self.key))


@contextlib.contextmanager
def _silent_collector() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a hung collector); yields the port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for sock in held:
            sock.close()
        listener.close()


class _Server:
    def __init__(self, workdir: Path, env: dict[str, str], args: list[str], verify: Any = None) -> None:
        self.port = _free_port()
        self.shm = workdir / "shm"
        self.log_path = workdir / "server.log"
        self.verify = verify
        scheme = "https" if verify is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ROBEZ_", "OTEL_"))}
        full_env.update({"ROBEZ_SHM_DIR": str(self.shm), "ROBEZ_THREADS_PER_WORKER": "1", **env})
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "service", "serve", "--port", str(self.port), *args],
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/readyz", timeout=2, verify=verify or True).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError("server not ready")

    def stop(self, timeout_s: float = 60.0) -> tuple[float, int | None, bool]:
        """SIGTERM to the server process; (seconds to exit, exit status, /dev/shm directory left)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            status: int | None = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        elapsed = time.monotonic() - started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        return elapsed, status, any(self.shm.glob("robez-*"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _stalled_grpc_call(port: int, declared: int = 1 << 20, sent: int = 4096) -> socket.socket:
    """An HTTP/2 connection with one ModelInfer call whose message declares ``declared`` bytes and
    sends ``sent`` of them, then nothing (HPACK literals, no Huffman: what any HTTP/2 peer accepts)."""
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/inference.GRPCInferenceService/ModelInfer"),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    block = b"".join(
        b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()
        for name, value in fields
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + _frame(0x4, 0, 0, b"")  # SETTINGS
        + _frame(0x1, 0x4, 1, block)  # HEADERS, END_HEADERS
        + _frame(0x0, 0, 1, b"\x00" + declared.to_bytes(4, "big") + b"\x08" * sent)  # part of the message
    )
    return sock


def still_open(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the server has not closed (a read would block rather than see EOF)."""
    count = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            count += sock.recv(1) != b""
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def run_scenario(name: str, workdir: Path, workers: int, handshakes: int) -> dict[str, Any]:
    certs = _Certificates(workdir)
    args = ["--workers", str(workers)]
    env: dict[str, str] = {"ROBEZ_LOG_LEVEL": "info"}
    verify: Any = None
    if name.startswith("https"):
        env.update({"ROBEZ_TLS_CERT": str(certs.cert), "ROBEZ_TLS_KEY": str(certs.key)})
        verify = ssl.create_default_context(cafile=str(certs.ca_file))
    result: dict[str, Any] = {"scenario": name, "workers": workers}
    with contextlib.ExitStack() as stack:
        if name.startswith("grpc"):
            grpc_port = _free_port()
            args += ["--grpc-port", str(grpc_port)]
        if name.startswith("otlp"):
            # otlp-down: nothing listens on the port; otlp-silent: it accepts and never answers.
            collector = _free_port() if name == "otlp-down" else stack.enter_context(_silent_collector())
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector}"})
        server = _Server(workdir, env, args, verify)
        held: list[Any] = []
        try:
            if name in ("plain-idle", "https-idle"):
                client = httpx.Client(base_url=server.url, verify=verify or True)
                assert client.get("/healthz").status_code == 200  # the connection stays open, idle
                held.append(client)
            elif name == "https-handshakes":
                sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(handshakes)]
                held.extend(sockets)
                wait_s = 10.0 + 3.0  # the default header_timeout_s, and a sweep's margin
                time.sleep(wait_s)
                result["handshakes_open_after_s"] = wait_s
                result["handshakes_open"] = still_open(sockets)
            elif name == "grpc-idle":
                import grpc
                from tritonclient.grpc import service_pb2 as pb
                from tritonclient.grpc import service_pb2_grpc

                channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                    pb.ServerLiveRequest(), timeout=30
                )
                held.append(channel)
            elif name == "grpc-stalled":
                held.extend(_stalled_grpc_call(grpc_port) for _ in range(8))
                time.sleep(1.0)
            else:
                for _ in range(5):
                    headers = {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"}
                    httpx.post(f"{server.url}/v1/tables/demo/lookup", json={"ids": [1, 2]}, headers=headers)
                time.sleep(1.0)
            # Wait under the keep-alive timeout (5 s) for the first scenarios: the client stays connected.
            seconds, status, shm_left = server.stop()
        finally:
            for thing in held:
                with contextlib.suppress(Exception):
                    thing.close()
        result.update(stop_s=round(seconds, 2), exit_status=status, shm_left=shm_left)
        log = server.log()
        result["otlp_log_lines"] = sum(
            1 for line in log.splitlines() if "otlp" in line.lower() or "export" in line.lower()
        )
        result["log_lines"] = len(log.splitlines())
    return result


def machine_info() -> str:
    """Date, CPU model, CPUs and load average: the context the figures were taken in."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {model}; {os.cpu_count()} CPUs; load average {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenario", action="append", choices=SCENARIOS + OTHER_SCENARIOS, help="default: every stop"
    )
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--handshakes", type=int, default=300)
    args = parser.parse_args()
    print(machine_info())
    for name in args.scenario or SCENARIOS:
        with tempfile.TemporaryDirectory(prefix="robez-hostile-") as workdir:
            if name == "bad-key":
                result = bad_key(Path(workdir), args.workers)
            elif name == "traceparent-flood":
                result = traceparent_flood(Path(workdir), args.workers)
            else:
                result = run_scenario(name, Path(workdir), args.workers, args.handshakes)
            print(result, flush=True)


if __name__ == "__main__":
    main()
