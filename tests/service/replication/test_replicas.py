"""Replicas over a real 3-node NATS JetStream cluster: convergence, exactly-once retries, read-your-writes,
kill -9 of a replica and of the stream's leader node, bootstrap from a snapshot after the log was trimmed.

Each test makes its own table through the log, so tests sharing the module's cluster and replicas do not
see each other's updates. Every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from devtools.natscluster import NatsCluster
from service.client import OCTET_STREAM, SHAPE_HEADER, RobezClient, encode_ids, encode_update

from .conftest import ReplicaServer, create_table, push_grads, replay_checksum, stream_bounds, stream_leader

pytestmark = pytest.mark.slow


def push(server: ReplicaServer, table: str, seed: int, key: str | None = None) -> httpx.Response:
    ids, grads = push_grads(seed)
    body, shape = encode_update(ids, grads)
    headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{server.url}/v1/tables/{table}/update", content=body, headers=headers, timeout=30)


def assert_converged(servers: list[ReplicaServer], table: str, version: int, expected_sha: str) -> None:
    for server in servers:
        server.wait_version(table, version)
        checksum = server.checksum(table)
        assert checksum["version"] == version, server.name
        assert checksum["sha256"] == expected_sha, f"{server.name} diverged"


def test_concurrent_pushes_to_two_replicas_converge(replicas: list[ReplicaServer]) -> None:
    """Every 2xx push has its own version, versions are 1..N without gaps, both replicas end at N with
    the bytes a private replay of the pushes in version order gives."""
    table = "converge"
    create_table(replicas[0], table)
    assert table in [t["name"] for t in httpx.get(f"{replicas[1].url}/v1/tables").json()["tables"]]
    seeds = list(range(40))

    def one(seed: int) -> tuple[int, int]:
        response = push(replicas[seed % 2], table, seed)
        assert response.status_code == 200, response.text
        assert response.headers["X-Robez-Replica"] == replicas[seed % 2].name
        assert "publish;dur=" in response.headers["Server-Timing"]
        return int(response.json()["version"]), seed

    with ThreadPoolExecutor(4) as pool:
        acked = list(pool.map(one, seeds))
    versions = sorted(version for version, _ in acked)
    assert versions == list(range(1, len(seeds) + 1))  # #2xx == version, each exactly once
    order = [seed for _, seed in sorted(acked)]
    assert_converged(replicas, table, len(seeds), replay_checksum(order))
    metrics = httpx.get(f"{replicas[0].url}/metrics", timeout=10).text
    assert f'robez_replication_publish_ack_seconds_count{{table="{table}"}} 20.0' in metrics
    assert f'robez_replication_apply_delay_seconds_count{{table="{table}"}} 40.0' in metrics
    ready = httpx.get(f"{replicas[1].url}/readyz", timeout=10)
    assert ready.status_code == 200


def test_bad_push_is_refused_and_never_logged(replicas: list[ReplicaServer]) -> None:
    table = "badpush"
    create_table(replicas[0], table)
    assert push(replicas[0], table, 1).status_code == 200
    before = replicas[0].checksum(table)
    wrong_dim = httpx.post(
        f"{replicas[0].url}/v1/tables/{table}/update", json={"ids": [1], "grads": [[1.0] * 3]}, timeout=10
    )
    assert wrong_dim.status_code == 422
    overflowing = httpx.post(
        f"{replicas[1].url}/v1/tables/{table}/update", json={"ids": [5], "grads": [[1e39] * 8]}, timeout=10
    )
    assert overflowing.status_code == 422, overflowing.text
    assert push(replicas[1], table, 2).status_code == 200  # the next good push gets version 2: no gap
    assert_converged(replicas, table, 2, replay_checksum([1, 2]))
    assert before["version"] == 1


def test_retry_with_the_same_key_is_applied_once(replicas: list[ReplicaServer]) -> None:
    table = "retries"
    create_table(replicas[1], table)
    key = uuid.uuid4().hex
    first = push(replicas[0], table, 7, key=key)
    again_elsewhere = push(replicas[1], table, 7, key=key)
    again_here = push(replicas[0], table, 7, key=key)
    assert first.status_code == again_elsewhere.status_code == again_here.status_code == 200
    assert first.json()["version"] == again_elsewhere.json()["version"] == again_here.json()["version"] == 1
    assert push(replicas[1], table, 8, key=uuid.uuid4().hex).json()["version"] == 2
    assert_converged(replicas, table, 2, replay_checksum([7, 8]))


def test_a_multi_table_push_is_applied_once_per_table_across_retries(replicas: list[ReplicaServer]) -> None:
    """The parts of one push (one entry per table's stream, published together) are each applied once,
    on both replicas, when the push is resent with its key to either replica; its lookup part is read
    after the push is applied on the replica that answers, and answered again for each resend."""
    tables = ("multi_a", "multi_b")
    for table in tables:
        create_table(replicas[0], table)
    bodies = [encode_update(*push_grads(seed)) for seed in (11, 12)]
    pushed_ids = push_grads(11)[0]
    headers = {
        "Content-Type": OCTET_STREAM,
        "X-Robez-Tables": ",".join(f"{table}=16" for table in tables),
        "X-Robez-Shapes": ";".join(shape for _, shape in bodies),
        "X-Robez-Lookup": f"multi_a={len(pushed_ids)}",
        "Idempotency-Key": uuid.uuid4().hex,
    }
    body = b"".join(part for part, _ in bodies) + encode_ids(pushed_ids)[0]
    answers = [
        httpx.post(f"{server.url}/v1/update", content=body, headers=headers, timeout=30)
        for server in (replicas[0], replicas[1], replicas[0])
    ]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Robez-Version"] == "1,1"
        assert answer.headers["X-Robez-Lookup-Version"] == "1"
        assert answer.content == answers[0].content
    client = RobezClient(replicas[1].url)
    assert answers[0].content == client.lookup("multi_a", pushed_ids, min_version=1).numpy().tobytes()
    client.close()
    for table, seed in zip(tables, (11, 12), strict=True):
        assert_converged(replicas, table, 1, replay_checksum([seed]))


def test_read_your_writes_across_replicas(replicas: list[ReplicaServer]) -> None:
    table = "ryw"
    create_table(replicas[0], table)
    with RobezClient(replicas[0].url) as writer, RobezClient(replicas[1].url, busy_retries=0) as reader:
        for seed in range(5):
            ids, grads = push_grads(seed)
            version = writer.update(table, ids, grads)
            rows = reader.lookup(table, ids, min_version=version)
            assert reader.last_version is not None and reader.last_version >= version
            assert rows.shape == (16, 8)
    far = httpx.post(
        f"{replicas[1].url}/v1/tables/{table}/lookup",
        json={"ids": [1]},
        headers={"X-Robez-Min-Version": "1000000"},
        timeout=10,
    )
    assert far.status_code == 503 and far.headers["Retry-After"]
    bad = httpx.post(
        f"{replicas[1].url}/v1/tables/{table}/lookup",
        json={"ids": [1]},
        headers={"X-Robez-Min-Version": "soon"},
        timeout=10,
    )
    assert bad.status_code == 422


def test_drop_goes_through_the_log(replicas: list[ReplicaServer]) -> None:
    table = "dropme"
    create_table(replicas[0], table)
    assert httpx.post(f"{replicas[1].url}/v1/tables", json={"name": table, "config": {}}).status_code in (
        409,
        422,
    )
    assert httpx.delete(f"{replicas[1].url}/v1/tables/{table}", timeout=30).status_code == 204
    deadline = time.monotonic() + 20
    while replicas[0].http.get(f"/v1/tables/{table}").status_code != 404:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    create_table(replicas[1], table)  # a new incarnation starts at version 0 with a fresh log
    response = push(replicas[0], table, 3)
    assert response.status_code == 200, response.text + replicas[0].log()
    assert response.json()["version"] == 1
    assert_converged(replicas, table, 1, replay_checksum([3]))


class _Pusher:
    """Pushes seeds ``0..count-1`` in one thread, through ``RobezClient`` (a key per push, resent on
    503 and transport errors); records (version, seed) of every acknowledged push."""

    def __init__(self, url: str, table: str, count: int, pause_s: float = 0.0) -> None:
        self.url, self.table, self.count, self.pause_s = url, table, count, pause_s
        self.acked: list[tuple[int, int]] = []
        self.ack_times: list[float] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with RobezClient(self.url, timeout=15, busy_retries=40) as client:
                for seed in range(self.count):
                    ids, grads = push_grads(seed)
                    version = client.update(self.table, ids, grads)
                    self.acked.append((version, seed))
                    self.ack_times.append(time.monotonic())
                    time.sleep(self.pause_s)
        except BaseException as exc:
            self.error = exc

    def wait_acked(self, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < count:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"only {len(self.acked)} pushes acknowledged"
            time.sleep(0.02)

    def join(self, timeout_s: float = 120) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "pusher did not finish"
        assert self.error is None, self.error


def test_kill9_replica_mid_stream_catches_up(replicas: list[ReplicaServer]) -> None:
    a, b = replicas
    table = "killreplica"
    create_table(a, table)
    pusher = _Pusher(a.url, table, 60, pause_s=0.01)
    pusher.thread.start()
    pusher.wait_acked(15)
    b.kill()
    pusher.wait_acked(35)
    b.start()
    pusher.join()
    b.wait_ready()
    versions = sorted(v for v, _ in pusher.acked)
    assert versions == list(range(1, 61))  # nothing acknowledged lost, nothing applied twice
    assert_converged(replicas, table, 60, replay_checksum([seed for _, seed in sorted(pusher.acked)]))


def test_kill9_stream_leader_loses_nothing_acknowledged(
    replicas_nats: NatsCluster, replicas: list[ReplicaServer]
) -> None:
    nats_cluster = replicas_nats  # the replicas' own cluster: a node is killed
    table = "killleader"
    create_table(replicas[0], table)
    pusher = _Pusher(replicas[1].url, table, 60, pause_s=0.01)
    pusher.thread.start()
    pusher.wait_acked(15)
    leader_name = stream_leader(nats_cluster, "t", table)
    leader = next(node for node in nats_cluster.nodes if node.name == leader_name)
    killed_at = time.monotonic()
    nats_cluster.kill(leader)
    try:
        pusher.join()
    finally:
        nats_cluster.start(leader)
    after = [t for t in pusher.ack_times if t > killed_at]
    assert after, "no push acknowledged after the leader was killed"
    assert after[0] - killed_at < 15.0, f"pushes resumed only after {after[0] - killed_at:.1f} s"
    versions = sorted(v for v, _ in pusher.acked)
    # Resent pushes (same key) after the leader died were applied once: versions stay 1..60.
    assert versions == list(range(1, 61))
    assert_converged(replicas, table, 60, replay_checksum([seed for _, seed in sorted(pusher.acked)]))


def test_new_replica_bootstraps_from_snapshot_after_trim(nats_cluster: NatsCluster, tmp_path: Path) -> None:
    """A replica that snapshots every 10 updates and trims the log below them; a replica started later
    cannot replay from 1 and must load the snapshot, and ends with the same bytes."""
    settings = {"ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES": 10, "ROBEZ_REPLICA_TRIM_KEEP": 0}
    first = ReplicaServer("s1", nats_cluster, tmp_path, "snap", **settings).start()
    late: ReplicaServer | None = None
    try:
        first.wait_ready()
        table = "boot"
        create_table(first, table)
        for seed in range(25):
            assert push(first, table, seed).status_code == 200
        deadline = time.monotonic() + 30
        while stream_bounds(nats_cluster, "snap", table)[0] <= 1:
            assert time.monotonic() < deadline, "the log was never trimmed:\n" + first.log()
            time.sleep(0.1)
        late = ReplicaServer("s2", nats_cluster, tmp_path, "snap").start().wait_ready()
        # Ready means the table is loaded and its log applied as far as it went when the reader started
        # (docs/replication.md, Operating): no waiting here. Position 1 is trimmed away and the late
        # replica has no data directory, so the Object Store snapshot is its only way there.
        assert late.version(table) == 25, late.log()
        assert "bootstrapped from the Object Store snapshot" in late.log()
        assert push(late, table, 25).json()["version"] == 26
        assert_converged([first, late], table, 26, replay_checksum(list(range(26))))
    finally:
        first.stop()
        if late is not None:
            late.stop()


def test_snapshot_is_uploaded_by_time_after_pushes_stop(nats_cluster: NatsCluster, tmp_path: Path) -> None:
    """No count trigger, a 1 s interval: a burst that then stops is still uploaded (and the log trimmed
    below it) by the timer, again after a second burst; a quiet table is not uploaded again."""
    settings = {
        "ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES": 0,
        "ROBEZ_REPLICA_SNAPSHOT_INTERVAL_S": 1,
        "ROBEZ_REPLICA_TRIM_KEEP": 0,
    }
    server = ReplicaServer("timed", nats_cluster, tmp_path, "timed", **settings).start()
    try:
        server.wait_ready()
        table = "timed"
        create_table(server, table)
        for burst_end in (7, 10):
            for seed in range(server.version(table), burst_end):
                assert push(server, table, seed).status_code == 200
            deadline = time.monotonic() + 20
            # Trimmed below burst_end + 1 only after the snapshot at burst_end was stored.
            while stream_bounds(nats_cluster, "timed", table)[0] != burst_end + 1:
                assert time.monotonic() < deadline, "no timed upload:\n" + server.log()
                time.sleep(0.1)
            assert f"snapshot at version {burst_end} uploaded" in server.log_path.read_text()
        # (A slow machine may also upload in the middle of a burst: the timer fires while pushes go on.)
        uploads = server.log_path.read_text().count("snapshot at version")
        time.sleep(2.5)  # quiet: more than two intervals, nothing new to upload
        assert server.log_path.read_text().count("snapshot at version") == uploads, server.log()
    finally:
        server.stop()


def test_replica_without_nats_is_not_ready(tmp_path: Path, nats_cluster: NatsCluster) -> None:
    """No reachable log: alive (/healthz) but not ready, and pushes are 503, never applied locally."""
    dead = NatsCluster(tmp_path / "dead", size=1)  # never started: its port refuses connections
    server = ReplicaServer("lonely", dead, tmp_path, "lonely", ROBEZ_APPLY_WAIT_S=1).start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if server.http.get("/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 503
        response = httpx.post(
            f"{server.url}/v1/tables",
            json={
                "name": "x",
                "config": {"num_embeddings": 10, "embedding_dim": 4, "memory_size": 64, "chunk_size": 2},
            },
            timeout=10,
        )
        assert response.status_code == 503
    finally:
        server.stop()


def test_kill9_of_the_applying_worker_another_worker_takes_over(
    replicas_nats: NatsCluster, replicas: list[ReplicaServer], tmp_path: Path
) -> None:
    """A replica with 2 workers: kill -9 the one applying the log mid-stream; the other takes the
    applier lock, rebuilds the table privately from the log (the dead one may have stopped half-way
    through an update), and the replica ends with the same bytes."""
    table = "takeover"
    create_table(replicas[0], table)
    server = ReplicaServer("w2", replicas_nats, tmp_path, "t", ROBEZ_WORKERS=2).start().wait_ready()
    try:
        pusher = _Pusher(replicas[0].url, table, 60, pause_s=0.01)
        pusher.thread.start()
        pusher.wait_acked(15)
        status_path = next((server.workdir / "shm").glob("robez-*/replication.json"))
        applier = json.loads(status_path.read_text())["applier_pid"]
        os.kill(applier, signal.SIGKILL)
        pusher.join()
        deadline = time.monotonic() + 30
        while json.loads(status_path.read_text())["applier_pid"] == applier:
            assert time.monotonic() < deadline, "no worker took over:\n" + server.log()
            time.sleep(0.1)
        order = [seed for _, seed in sorted(pusher.acked)]
        assert_converged([replicas[0], server], table, 60, replay_checksum(order))
        assert "rebuilt from the log" in server.log()
    finally:
        server.stop()


def test_tables_file_tables_are_created_once_by_replicas_starting_together(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    config = tmp_path / "tables.toml"
    config.write_text(
        "[tables.fromfile]\nnum_embeddings = 1000\nembedding_dim = 8\nmemory_size = 4096\nchunk_size = 4\n"
        '[tables.fromfile.optimizer]\nname = "adam"\nlr = 0.01\n'
    )
    servers = [
        ReplicaServer(name, nats_cluster, tmp_path, "cfg", ROBEZ_CONFIG=config) for name in ("c1", "c2")
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        assert servers[0].checksum("fromfile") == servers[1].checksum("fromfile")
        assert servers[0].checksum("fromfile")["sha256"] == replay_checksum([])
        assert push(servers[1], "fromfile", 4).json()["version"] == 1
        assert_converged(servers, "fromfile", 1, replay_checksum([4]))
    finally:
        for server in servers:
            server.stop()


def test_replica_frozen_while_the_log_is_trimmed_catches_up(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    """A running replica frozen (SIGSTOP) while another snapshots and trims the log past its position
    ends with the same bytes once it runs again. Which way it catches up is not fixed: the entries the
    log had already pushed to its connection before the trim, or (when it finds a gap) the snapshot."""
    leader = ReplicaServer(
        "l1",
        nats_cluster,
        tmp_path,
        "lag",
        ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES=10,
        ROBEZ_REPLICA_TRIM_KEEP=0,
    )
    frozen = ReplicaServer("l2", nats_cluster, tmp_path, "lag")
    servers = [leader.start(), frozen.start()]
    try:
        for server in servers:
            server.wait_ready()
        table = "behind"
        create_table(leader, table)
        for seed in range(3):
            assert push(leader, table, seed).status_code == 200
        frozen.wait_version(table, 3)
        assert frozen.process is not None
        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            for seed in range(3, 30):
                assert push(leader, table, seed).status_code == 200
            deadline = time.monotonic() + 30
            while stream_bounds(nats_cluster, "lag", table)[0] <= 4:
                assert time.monotonic() < deadline, "the log was never trimmed:\n" + leader.log()
                time.sleep(0.1)
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
        assert_converged(servers, table, 30, replay_checksum(list(range(30))))
    finally:
        for server in servers:
            server.stop()
