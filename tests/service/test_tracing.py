"""OpenTelemetry traces against a real OTLP/HTTP receiver: a request's W3C traceparent (HTTP header or
gRPC metadata) makes its spans part of that trace, with the stages as children; untraced, nothing of the
SDK is imported."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton

from .otlp_receiver import OtlpReceiver, ReceivedSpan
from .subprocess_server import RobezServer, free_port

pytestmark = pytest.mark.slow

OCTET = "application/octet-stream"
TABLE, IDS, VERSION = "robez.table", "robez.ids", "robez.version"


def traceparent() -> tuple[str, str, str]:
    """(header value, trace id, parent span id) of a new sampled W3C trace context."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: export soon, not every 5 s
    }


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span.name: span for span in spans}


def has(*names: str) -> object:
    return lambda spans: set(names) <= {span.name for span in spans}


def assert_request_tree(
    spans: list[ReceivedSpan], root: str, parent: str, children: dict[str, dict[str, int | str]]
) -> None:
    """The request's span is a child of the caller's ``parent``; every stage a child of the request's."""
    named = by_name(spans)
    request = named[root]
    assert request.parent_span_id == parent and request.resource["service.name"] == "robez"
    for name, attributes in children.items():
        stage = named[name]
        assert stage.parent_span_id == request.span_id, (name, spans)
        assert {key: stage.attributes.get(key) for key in attributes} == attributes, (name, stage)
        assert request.start_ns <= stage.start_ns <= stage.end_ns


def test_traceparent_makes_request_spans_with_stage_children(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        grpc_port = free_port()
        env = {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_LOG_LEVEL": "warning", **otel_env(receiver)}
        args = ["--grpc-port", str(grpc_port), "--data-dir", str(tmp_path / "data")]
        server = RobezServer(tmp_path / "server.log", args, env)
        try:
            server.start()
            url = server.url
            # A one-id lookup (answered by the connection itself).
            header, trace_id, parent = traceparent()
            reply = httpx.post(
                f"{url}/v1/tables/demo/lookup",
                content=np.array([42], dtype="<i8").tobytes(),
                headers={"content-type": OCTET, "traceparent": header},
            )
            assert reply.status_code == 200
            stages = {TABLE: "demo", IDS: 1, VERSION: 0}
            spans = receiver.wait_for(trace_id, has("POST /v1/tables/{name}/lookup", "hash", "gather"))
            assert_request_tree(
                spans, "POST /v1/tables/{name}/lookup", parent, {"hash": stages, "gather": stages}
            )
            request = by_name(spans)["POST /v1/tables/{name}/lookup"]
            assert request.attributes["http.response.status_code"] == 200
            assert request.attributes[TABLE] == "demo"

            # A large lookup (through the middleware stack).
            header, trace_id, parent = traceparent()
            ids = np.arange(10_000, dtype="<i8")
            reply = httpx.post(
                f"{url}/v1/tables/demo/lookup",
                content=ids.tobytes(),
                headers={"content-type": OCTET, "traceparent": header},
            )
            assert reply.status_code == 200
            stages = {TABLE: "demo", IDS: 10_000, VERSION: 0}
            spans = receiver.wait_for(trace_id, has("POST /v1/tables/{name}/lookup", "hash", "gather"))
            assert_request_tree(
                spans, "POST /v1/tables/{name}/lookup", parent, {"hash": stages, "gather": stages}
            )

            # A gradient push, journalled: log-append, hash and apply.
            header, trace_id, parent = traceparent()
            body = np.arange(8, dtype="<i8").tobytes() + np.full((8, 64), 1e-3, dtype="<f4").tobytes()
            reply = httpx.post(
                f"{url}/v1/tables/demo/update",
                content=body,
                headers={"content-type": OCTET, "x-robez-shape": "8,64", "traceparent": header},
            )
            assert reply.status_code == 200, reply.text
            stages = {TABLE: "demo", IDS: 8, VERSION: 1}
            names = ("POST /v1/tables/{name}/update", "log-append", "hash", "apply")
            spans = receiver.wait_for(trace_id, has(*names))
            assert_request_tree(spans, names[0], parent, dict.fromkeys(names[1:], stages))

            # gRPC inference, the traceparent in the metadata.
            header, trace_id, parent = traceparent()
            client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            tensor = triton.InferInput("ids", [3], "INT64").set_data_from_numpy(np.array([1, 2, 3]))
            client.infer("demo", [tensor], headers={"traceparent": header})
            client.close()
            root = "inference.GRPCInferenceService/ModelInfer"
            stages = {TABLE: "demo", IDS: 3, VERSION: 1}
            spans = receiver.wait_for(trace_id, has(root, "hash", "gather"))
            assert_request_tree(spans, root, parent, {"hash": stages, "gather": stages})
            assert by_name(spans)[root].attributes["rpc.grpc.status_code"] == 0
        finally:
            server.stop()


def test_untraced_server_imports_no_sdk(tmp_path: Path) -> None:
    """Without OTEL_* the request path never touches OpenTelemetry's SDK or exporter."""
    script = """
import sys
from fastapi.testclient import TestClient
from service.app import create_app
from service.config import Settings
from service import tracing
app = create_app(Settings(_env_file=None, shm_dir=sys.argv[1], threads_per_worker=1))
with TestClient(app) as client:
    assert client.post("/v1/tables/demo/lookup", json={"ids": [1, 2]}).status_code == 200
assert tracing.TRACER is None
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
print("loaded:", loaded)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ROBEZ_"))}
    (tmp_path / "shm").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "shm")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stdout, done.stdout


@pytest.mark.parametrize("collector", ["down", "silent"])
def test_a_down_or_silent_collector_does_not_hold_the_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, collector: str
) -> None:
    """The SDK's flush at a stop waited up to 30 s for a collector that never answered (a stop took
    31 s, issue 40.5): now each export waits ``trace_export_timeout_s``, the flush that plus 1 s, and
    what cannot be sent is dropped, said once."""
    import logging
    import socket

    from service import tracing

    from .conftest import make_settings

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if collector == "silent":
            listener.listen(16)  # accepts (the kernel does) and never answers
        else:
            listener.close()  # nothing listens: connections are refused
        settings = make_settings(
            tmp_path, otel_exporter_otlp_endpoint=f"http://127.0.0.1:{port}", trace_export_timeout_s=0.5
        )
        with caplog.at_level(logging.INFO, logger="robez.tracing"):
            tracing.configure(settings)
            try:
                assert tracing.TRACER is not None
                for number in range(600):  # over one batch (512): the export thread sends while we stop
                    tracing.TRACER.start_span(f"s{number}").end()
                time.sleep(1.0)
            finally:
                started = time.monotonic()
                tracing.shutdown()
                stopped_in = time.monotonic() - started
    assert stopped_in < 5.0, f"the flush took {stopped_in:.1f} s"
    said = [
        r.getMessage() for r in caplog.records if r.name == "robez.tracing" and "dropping" in r.getMessage()
    ]
    assert 1 <= len(said) <= 2, said  # once while running; the stop's own line if the flush was cut
