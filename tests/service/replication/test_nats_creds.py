"""``--nats-creds`` (NATS's decentralised JWT auth) against a real ``nats-server`` in operator mode with a
memory resolver; the operator, account and user JWTs come from ``devtools/natsjwt.py`` (no ``nsc``).

Two replicas logged in with a ``.creds`` file serve a push through the log; an expired user JWT stops
the start with a line naming the file; one signed by a key the operator does not know is refused by NATS
("Authorization Violation")."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nkeys
import pytest

from devtools.natscluster import free_ports, nats_server_binary
from devtools.natsjwt import Identity, OperatorMode
from loadtest.launch import ServerNotReady
from robez_core.errors import ConfigError
from service.client import OCTET_STREAM, SHAPE_HEADER, encode_update
from service.natsauth import check_creds_file

from .conftest import ReplicaServer, create_table, push_grads

pytestmark = pytest.mark.slow


class OperatorNats:
    """A single ``nats-server`` in operator mode (what ``ReplicaServer`` needs of a cluster: ``urls``,
    ``robez_env``; the login is the replica's ``ROBEZ_NATS_CREDS``)."""

    def __init__(self, directory: Path) -> None:
        self.mode = OperatorMode()
        self.port = free_ports(1)[0]
        self.directory = directory
        self.log_path = directory / "nats.log"
        config = self.mode.config(directory, self.port)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
                time.sleep(0.05)

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{self.port}"]

    def robez_env(self) -> dict[str, str]:
        return {}

    def creds(self, name: str, **options: Any) -> Path:
        path = self.directory / f"{name}.creds"
        path.write_text(self.mode.user_creds(name, **options))
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def operator_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorNats]:
    server = OperatorNats(tmp_path_factory.mktemp("nats-operator"))
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def _replicas(nats: OperatorNats, workdir: Path, creds: list[Path]) -> Iterator[list[ReplicaServer]]:
    servers = [
        ReplicaServer(f"r{index}", nats, workdir, "jwt", ROBEZ_NATS_CREDS=path, ROBEZ_NATS_REPLICAS=1)  # type: ignore[arg-type]
        for index, path in enumerate(creds)
    ]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_replicas_logged_in_with_creds_files_serve_a_push(
    operator_nats: OperatorNats, tmp_path: Path
) -> None:
    creds = [operator_nats.creds("robez-a"), operator_nats.creds("robez-b")]
    with _replicas(operator_nats, tmp_path, creds) as (first, second):
        first.wait_ready()
        second.wait_ready()
        create_table(first, "jwt_table")
        ids, grads = push_grads(1)
        body, shape = encode_update(ids, grads)
        headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape}
        pushed = httpx.post(
            f"{first.url}/v1/tables/jwt_table/update", content=body, headers=headers, timeout=30
        )
        assert pushed.status_code == 200, pushed.text
        version = pushed.json()["version"]
        deadline = time.monotonic() + 30
        while httpx.get(f"{second.url}/v1/tables/jwt_table", timeout=10).json().get("version", -1) < version:
            assert time.monotonic() < deadline, second.log()
            time.sleep(0.1)
        ids_body = {"ids": ids.tolist()}
        rows = [
            httpx.post(f"{server.url}/v1/tables/jwt_table/lookup", json=ids_body, timeout=10).json()
            for server in (first, second)
        ]
        assert rows[0]["embeddings"] == rows[1]["embeddings"] and rows[0]["version"] == version


def test_an_expired_creds_file_stops_the_start_naming_it(operator_nats: OperatorNats, tmp_path: Path) -> None:
    """Checked before the replica connects (service/tls.check_files): exit status 2, one line naming the
    option, the file and when it expired; NATS itself would only answer "Authorization Violation"."""
    creds = operator_nats.creds("old", expires_s=-60)
    with _replicas(operator_nats, tmp_path, [creds]) as (server,):
        with pytest.raises(ServerNotReady, match="exited with 2"):
            server.wait_ready(60.0)
        log = server.log()
    assert f"NATS credentials (--nats-creds) {creds}: its user JWT expired on" in log, log


def test_a_creds_file_the_operator_does_not_trust_is_refused_by_nats(
    operator_nats: OperatorNats, tmp_path: Path
) -> None:
    """A well-formed user JWT signed by an account key the operator never signed: only the server can
    tell; the replica does not become ready and says why (NATS's reason, each try)."""
    creds = operator_nats.creds("stranger", signer=Identity.new(nkeys.PREFIX_BYTE_ACCOUNT))
    with _replicas(operator_nats, tmp_path, [creds]) as (server,):
        # Wait for NATS's answer in the log (a loaded machine can take a while to start the server),
        # then the replica must still not be ready.
        deadline = time.monotonic() + 60
        while "Authorization Violation" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        with pytest.raises(ServerNotReady):
            server.wait_ready(2.0)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("not a creds file", "no user JWT and nkey seed in it"),
        ("EXPIRED", "its user JWT expired on"),
        ("OTHER_SEED", "its nkey seed is not the JWT's user"),
        ("BAD_JWT", "its JWT cannot be read"),
    ],
)
def test_creds_files_are_checked_before_connecting(tmp_path: Path, text: str, problem: str) -> None:
    mode = OperatorMode()
    expired = mode.user_creds("old", expires_s=-1)
    good = mode.user_creds("fine", expires_s=3600)
    other = mode.user_creds("other")
    seed_lines = other[other.index("-----BEGIN USER NKEY SEED") :]
    contents = {
        "EXPIRED": expired,
        "OTHER_SEED": good[: good.index("-----BEGIN USER NKEY SEED")] + seed_lines,
        "BAD_JWT": good.replace(good.split("\n")[1], "e30.notbase64!.sig"),
    }.get(text, text)
    path = tmp_path / "robez.creds"
    path.write_text(good)
    check_creds_file(path)  # a fresh one passes
    path.write_text(contents)
    with pytest.raises(ConfigError, match=re.escape(f"NATS credentials (--nats-creds) {path}: {problem}")):
        check_creds_file(path)
