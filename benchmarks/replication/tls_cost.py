"""What TLS on the NATS connections costs a replicated push (issue 41: "the cipher suites measured").

    python -m benchmarks.replication.tls_cost [--pushes 200] [--rounds 2] [--rows 256]

1. The suite a replica's connection negotiates (TLS 1.3 with the shipped settings), read from the
   connection's SSL object.
2. Each candidate AEAD's cost for one push's bytes (``--rows`` ids x 64: ids + float32 gradients, in
   16 KiB TLS records): sealing and opening with ``cryptography`` (OpenSSL underneath), AES-128-GCM,
   AES-256-GCM and ChaCha20-Poly1305. A push crosses 5 TLS connections on a 3-node R3 cluster with two
   replicas (the publish to the stream leader, the leader's two routes, the deliveries to both appliers),
   so 5 seals and 5 opens.
3. End to end: a 3-node cluster and replicas A and B, with logins and TLS as shipped and with neither
   (plaintext), in ``--rounds`` alternating rounds: the p50 of ``--pushes`` pushes to A at 1 and at 8
   writers, updates/s, and the CPU seconds per push of each process (A, B, the three NATS nodes), from
   /proc.

Prints a Markdown report (machine, CPU, load average before and after, date, command).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from devtools.natscluster import NatsCluster
from loadtest.server import tree_cpu_seconds
from robez_core import hostinfo

from .replicas import DIM, percentile, replicated_pair, timed_updates

_RECORD = 16 * 1024  # TLS's largest record
_HOPS = 5  # publish to the leader, two routes, deliveries to A and to B


def _negotiated(cluster: NatsCluster) -> str:
    """The TLS version and suite of a replica's connection (``JetStreamLog``, the shipped settings)."""
    from service.replication.jetstream import JetStreamLog

    async def read() -> str:
        log = JetStreamLog(cluster.urls, replicas=3, prefix="robeztlscost", auth=cluster.auth())
        await log.connect()
        try:
            # nats-py has no public accessor for its connection's SSL object.
            writer = getattr(getattr(log._nc, "_transport", None), "_io_writer", None)
            assert writer is not None, "nats-py's transport changed: no _io_writer"
            ssl_object = writer.get_extra_info("ssl_object")
            name, version, bits = ssl_object.cipher()
            return f"{version} {name} ({bits}-bit)"
        finally:
            await log.close()

    return asyncio.run(read())


def _aead_costs(rows: int, repeat: int = 300) -> list[tuple[str, float, float]]:
    """(suite, µs to seal one push's bytes, µs to open them), the push cut into 16 KiB records."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    size = rows * 8 + rows * DIM * 4
    data = os.urandom(size)
    records = [data[start : start + _RECORD] for start in range(0, size, _RECORD)]
    nonce = os.urandom(12)
    out = []
    for name, aead in (
        ("TLS_AES_128_GCM_SHA256", AESGCM(os.urandom(16))),
        ("TLS_AES_256_GCM_SHA384", AESGCM(os.urandom(32))),
        ("TLS_CHACHA20_POLY1305_SHA256", ChaCha20Poly1305(os.urandom(32))),
    ):
        sealed = [aead.encrypt(nonce, record, None) for record in records]
        seal, open_ = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            for record in records:
                aead.encrypt(nonce, record, None)
            seal.append(time.perf_counter() - start)
            start = time.perf_counter()
            for record in sealed:
                aead.decrypt(nonce, record, None)
            open_.append(time.perf_counter() - start)
        out.append((name, statistics.median(seal) * 1e6, statistics.median(open_) * 1e6))
    return out


def _end_to_end(secure: bool, workdir: Path, pushes: int, rows: int) -> dict[int, dict[str, float]]:
    """{writers: {"p50_ms", "per_s", "cpu_<process>_ms"...}} for one cluster and replicas A, B."""
    with replicated_pair(workdir, rows, warm_pushes=20, secure=secure) as (cluster, servers):
        processes = {"A": servers[0].pid, "B": servers[1].pid}
        for node in cluster.nodes:
            assert node.process is not None
            processes[f"NATS {node.name}"] = node.process.pid
        figures = {}
        for writers in (1, 8):
            before = {name: tree_cpu_seconds(pid) for name, pid in processes.items()}
            *latencies, elapsed = timed_updates(servers[0].url, writers, pushes, rows)
            after = {name: tree_cpu_seconds(pid) for name, pid in processes.items()}
            row = {"p50_ms": percentile(latencies, 50) * 1e3, "per_s": len(latencies) / elapsed}
            for name in processes:
                row[f"cpu {name}"] = (after[name] - before[name]) / len(latencies) * 1e3
            figures[writers] = row
        return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.tls_cost", description=__doc__)
    parser.add_argument("--pushes", type=int, default=200, help="pushes per writer count, kind and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of TLS and plaintext")
    parser.add_argument("--rows", type=int, default=256, help="ids per push")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)

    load_before = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-tls-", dir=args.dir))
    try:
        aead = _aead_costs(args.rows)
        runs: dict[bool, list[dict[int, dict[str, float]]]] = {True: [], False: []}
        negotiated = ""
        for index in range(args.rounds):
            for secure in (True, False):
                kind = "tls" if secure else "plain"
                print(f"round {index + 1}: {kind} ...", file=sys.stderr)
                run_dir = workdir / f"{kind}-{index}"
                if secure and not negotiated:
                    cluster = NatsCluster(run_dir / "probe", size=3)
                    try:
                        cluster.start()
                        cluster.wait_for_jetstream()
                        negotiated = _negotiated(cluster)
                    finally:
                        cluster.stop()
                runs[secure].append(_end_to_end(secure, run_dir, args.pushes, args.rows))
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = ", ".join(f"{value:.2f}" for value in os.getloadavg())

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks.replication.tls_cost " + shlex.join(list(argv or sys.argv[1:]))
    flags = hostinfo.listed_flags(("aes", "vaes", "vpclmulqdq", "avx2", "avx512f")) or ()
    size = args.rows * 8 + args.rows * DIM * 4
    print(f"# TLS cost of a replicated push — {date}\n")
    print(f"Command: `{command.strip()}` (took {time.perf_counter() - began:.0f} s)  ")
    print(
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {hostinfo.cpu_model()} ({' '.join(flags)}), "
        f"Linux {platform.release()}  "
    )
    print(f"Load average (1, 5, 15 min): {load_before} before, {load_after} after  ")
    print("Every robez server: 1 worker, 1 kernel thread; NATS: 3 nodes, R3, sync_interval always.\n")
    print(f"Negotiated by a replica's connection (shipped settings): {negotiated}\n")
    print(f"## Each suite's AEAD on one push ({size} bytes in 16 KiB records), one core\n")
    print(f"| suite | seal µs | open µs | x {_HOPS} connections (seal + open) µs |")
    print("|---|---|---|---|")
    for name, seal, open_ in aead:
        print(f"| {name} | {seal:.1f} | {open_:.1f} | {_HOPS * (seal + open_):.0f} |")
    print(f"\n## End to end, {args.rounds} alternating rounds (medians over rounds)\n")
    names = [key for key in runs[True][0][1] if key.startswith("cpu ")]
    print(
        "| writers | kind | p50 ms | updates/s | "
        + " | ".join(f"{name[4:]} CPU ms/push" for name in names)
        + " | all CPU ms/push |"
    )
    print("|---" * (5 + len(names)) + "|")
    for writers in (1, 8):
        for secure in (True, False):
            rows = [run[writers] for run in runs[secure]]

            def median(key: str, rows: list[dict[str, float]] = rows) -> float:
                return statistics.median(row[key] for row in rows)

            total = statistics.median(sum(row[name] for name in names) for row in rows)
            print(
                f"| {writers} | {'TLS + logins' if secure else 'plaintext'} | {median('p50_ms'):.2f} | "
                f"{median('per_s'):.0f} | "
                + " | ".join(f"{median(name):.2f}" for name in names)
                + f" | {total:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
