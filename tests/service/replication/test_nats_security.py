"""The NATS that robez starts (devtools/natscluster.py, ``make cluster``) is closed to strangers: TLS with
client certificates and a login on every connection, and only robez's user may write (docs/security.md).

A real node, real clients: a connection without credentials is refused, and the read-only ``monitor``
user can neither append to a table's log nor touch the catalog, while robez, logged in, serves.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import nats.errors
import pytest

from devtools.natscluster import NatsCluster
from service.natsauth import NatsAuth

from .conftest import ReplicaServer, create_table, running_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with running_cluster(tmp_path_factory.mktemp("nats-secured"), 1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replica(secured: NatsCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaServer]:
    """One replica logged in as robez (prefix ``sec``), shared by the tests of this module."""
    server = ReplicaServer(
        "guarded", secured, tmp_path_factory.mktemp("replica"), "sec", ROBEZ_NATS_REPLICAS=1
    )
    try:
        server.start().wait_ready()
        yield server
    finally:
        server.stop()


async def _refusal(cluster: NatsCluster, **options: Any) -> BaseException | None:
    """The error a single connection attempt with ``options`` ends in (None if it got in)."""
    try:
        nc = await nats.connect(
            servers=cluster.urls,
            connect_timeout=3,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            **options,
        )
    except Exception as exc:
        return exc
    await nc.close()
    return None


def test_a_connection_without_credentials_is_refused(secured: NatsCluster) -> None:
    node = secured.nodes[0]
    with socket.create_connection(("127.0.0.1", node.client_port), timeout=5) as sock:
        info = json.loads(sock.recv(4096).decode().removeprefix("INFO ").strip())
    assert info["tls_required"] is True and info["auth_required"] is True, info

    assert secured.secrets is not None
    ca, cert, key = (secured.secrets.path(name) for name in ("ca.pem", "client.pem", "client.key"))
    tls_only = NatsAuth(tls_ca=ca, tls_cert=cert, tls_key=key).connect_options()
    wrong_password = NatsAuth(user="robez", password="guess", tls_ca=ca, tls_cert=cert, tls_key=key)
    no_client_cert = NatsAuth(user="robez", password=secured.secrets.robez_password, tls_ca=ca)

    async def attempts() -> dict[str, BaseException | None]:
        return {
            "nothing": await _refusal(secured),
            "tls, no login": await _refusal(secured, **tls_only),
            "wrong password": await _refusal(secured, **wrong_password.connect_options()),
            "no client certificate": await _refusal(secured, **no_client_cert.connect_options()),
            "robez": await _refusal(secured, **secured.connect_options()),
        }

    results = asyncio.run(attempts())
    assert results.pop("robez") is None
    for what, error in results.items():
        assert error is not None, f"{what}: connected"
    assert isinstance(results["nothing"], ssl.SSLError)  # the server's certificate is from an unknown CA
    assert "authorization violation" in str(results["tls, no login"]).lower()
    assert "authorization violation" in str(results["wrong password"]).lower()


def test_the_monitor_user_cannot_write_to_a_table_or_the_catalog(
    secured: NatsCluster, replica: ReplicaServer
) -> None:
    create_table(replica, "guarded")
    asyncio.run(_monitor_tries_to_write(secured))
    # The table is intact on the replica: still there, nothing applied.
    response = httpx.get(f"{replica.url}/v1/tables/guarded", timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 0


async def _monitor_tries_to_write(cluster: NatsCluster) -> None:
    violations: list[str] = []

    async def on_error(exc: Exception) -> None:
        violations.append(str(exc))

    robez = await nats.connect(servers=cluster.urls, **cluster.connect_options())
    monitor = await nats.connect(
        servers=cluster.urls, error_cb=on_error, **cluster.connect_options("monitor")
    )
    try:
        robez_js = robez.jetstream(timeout=5)
        (stream,) = [name async for name in _stream_names(robez_js) if name.startswith("sec_guarded_")]
        before = (await robez_js.stream_info(stream)).state.last_seq
        catalog = await robez_js.key_value("sec_tables")
        entry = await catalog.get("guarded")

        monitor_js = monitor.jetstream(timeout=2)
        assert (await monitor_js.stream_info(stream)).state.last_seq == before  # it may read
        subject = f"sec.u.guarded.{stream.removeprefix('sec_guarded_')}"  # JetStreamLog.subject
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await monitor_js.publish(subject, b"forged", stream=stream)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await monitor_js.publish("$KV.sec_tables.guarded", b"", headers={"KV-Operation": "DEL"})
        monitor_kv = await monitor_js.key_value("sec_tables")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await monitor_kv.delete("guarded")

        assert (await robez_js.stream_info(stream)).state.last_seq == before
        assert (await catalog.get("guarded")).revision == entry.revision
        assert sum("permissions violation" in message.lower() for message in violations) >= 3, violations
    finally:
        await monitor.close()
        await robez.close()


async def _stream_names(js: Any) -> Any:
    for info in await js.streams_info():
        yield info.config.name


def test_the_monitor_user_receives_none_of_robez_s_deliveries(
    secured: NatsCluster, replica: ReplicaServer
) -> None:
    """The read-only login could subscribe to `_INBOX.>` and received the pull deliveries meant for robez:
    log entries with their ids and gradients (issue 40.6). robez's inbox prefix is now its own, which the
    monitor login may not subscribe to; robez still applies its pushes. The node configs are 0600."""
    for node in secured.nodes:
        assert node.config_path.stat().st_mode & 0o777 == 0o600
    create_table(replica, "inboxes")
    received, violations = asyncio.run(_monitor_listens_while_robez_applies(secured, replica))
    assert received == [], f"monitor received {len(received)} messages meant for robez: {received[:3]}"
    assert any("subscription" in v and '"_inbox_sec.>"' in v for v in violations), violations
    assert any("subscription" in v and '">"' in v for v in violations), violations


async def _monitor_listens_while_robez_applies(
    cluster: NatsCluster, server: ReplicaServer
) -> tuple[list[str], list[str]]:
    """What the monitor login's subscriptions to every inbox it may name got while robez applied five
    pushes (no request of its own meanwhile, so nothing is a reply to monitor), and its errors."""
    received: list[str] = []
    violations: list[str] = []

    async def on_error(exc: Exception) -> None:
        violations.append(str(exc).lower())

    async def on_message(message: Any) -> None:
        received.append(f"{message.subject}: {message.data[:80]!r}")

    monitor = await nats.connect(
        servers=cluster.urls, error_cb=on_error, **cluster.connect_options("monitor")
    )
    try:
        for subject in ("_INBOX.>", "_INBOX_sec.>", ">"):
            await monitor.subscribe(subject, cb=on_message)
        await monitor.flush()
        body = {"ids": [1, 2], "grads": [[0.5] * 8, [0.25] * 8]}
        for _ in range(5):
            response = await asyncio.to_thread(
                httpx.post, f"{server.url}/v1/tables/inboxes/update", json=body, timeout=30
            )
            assert response.status_code == 200, response.text
        await asyncio.to_thread(server.wait_version, "inboxes", 5)
        await asyncio.sleep(1.0)
        await monitor.flush()
    finally:
        await monitor.close()
    return received, violations
