"""A replicated push's trace spans the replicas: its traceparent travels in the log entry's headers, and
the apply on the other replica is a span of the same trace (a real NATS server, real replicas, a real
OTLP/HTTP receiver)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from devtools.natscluster import NatsCluster
from service.client import OCTET_STREAM, SHAPE_HEADER, encode_update

from ..otlp_receiver import OtlpReceiver
from ..test_tracing import IDS, TABLE, VERSION, by_name, otel_env, traceparent
from .conftest import ReplicaServer, create_table, push_grads

pytestmark = pytest.mark.slow


def test_the_apply_on_every_replica_joins_the_pushs_trace(shared_nats: NatsCluster, tmp_path: Path) -> None:
    cluster = shared_nats
    with OtlpReceiver() as receiver:
        servers = [
            ReplicaServer(
                name,
                cluster,
                tmp_path,
                "tr",
                ROBEZ_NATS_REPLICAS=1,
                OTEL_RESOURCE_ATTRIBUTES=f"robez.replica={name}",
                **otel_env(receiver),
            )
            for name in ("a", "b")
        ]
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready()
            create_table(servers[0], "traced")
            servers[1].wait_version("traced", 0)
            header, trace_id, parent = traceparent()
            ids, grads = push_grads(7)
            body, shape = encode_update(ids, grads)
            reply = httpx.post(
                f"{servers[0].url}/v1/tables/traced/update",
                content=body,
                headers={"content-type": OCTET_STREAM, SHAPE_HEADER: shape, "traceparent": header},
                timeout=30,
            )
            assert reply.status_code == 200, reply.text

            def applied_everywhere(spans: list) -> bool:  # type: ignore[type-arg]
                replicas = {span.resource.get("robez.replica") for span in spans if span.name == "apply"}
                return {"a", "b"} <= replicas and "publish" in {span.name for span in spans}

            spans = receiver.wait_for(trace_id, applied_everywhere)
            request = by_name(spans)["POST /v1/tables/{name}/update"]
            assert request.parent_span_id == parent and request.resource["robez.replica"] == "a"
            publish = by_name(spans)["publish"]
            assert publish.parent_span_id == request.span_id
            expected = {TABLE: "traced", IDS: int(ids.numel()), VERSION: 1}
            assert {key: publish.attributes.get(key) for key in expected} == expected
            for span in spans:
                if span.name == "apply":  # each replica's applier: a child of the publish
                    assert span.parent_span_id == publish.span_id, span
                    assert {key: span.attributes.get(key) for key in expected} == expected
        finally:
            for server in servers:
                server.stop()
