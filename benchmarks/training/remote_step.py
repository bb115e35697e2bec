"""The remote collection's two requests of a DLRM step alone, and where their time goes (issue 37).

``benchmarks/training/dlrm.py``'s ``remote_collection`` without the dense model: a ``robez serve`` on this
machine (1 worker, 1 kernel thread, no data dir), its 26 tables over one shared array, and per step the
collection's pull (``lookup_many``) in ``forward`` and its push (``update_many``) in ``backward`` of a
random output gradient. Per step: the trainer's wait for each request, the server's ``Server-Timing``
stages of each, and the rest of each wait (transport, the server's event loop outside its ``total``,
the client's codec): medians over the steps after ``--warmup``. With ``--source DIR`` (repeatable) the
same is run from each of several checkouts (server included), alternating, so a change's effect is
read in one run.

    flock /tmp/robez-bench.lock python -m benchmarks.training.remote_step --source . --source ../base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def measure(steps: int, warmup: int) -> dict[str, Any]:
    """One server, ``steps`` steps of pull + push; the medians (ms) of the steps after ``warmup``."""
    import torch

    from benchmarks.training.dlrm import Settings, SyntheticCriteo, create_remote_tables, robez_tables
    from loadtest.server import start_server, stop_server
    from service.client import RemoteEmbeddingBagCollection, RobezClient

    torch.set_num_threads(1)
    settings = Settings()
    data = SyntheticCriteo(settings)
    batches = [data.batch(index) for index in range(steps)]
    width = len(settings.cardinalities) * settings.embedding_dim
    grads = [
        torch.randn(settings.batch_size, width, generator=torch.Generator().manual_seed(index))
        for index in range(steps)
    ]
    env = {"ROBEZ_THREADS_PER_WORKER": "1", "ROBEZ_MAX_BODY_BYTES": str(256 << 20)}
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="robez-remote-step-") as workdir:
        server = start_server(1, None, Path(workdir), env=env)
        try:
            url = server.target.base_url
            with RobezClient(url, timeout=300.0) as client:
                create_remote_tables(client, settings)
                collection = RemoteEmbeddingBagCollection(client, robez_tables(settings))
                timings: list[dict[str, float]] = []
                count = collection._count  # the collection's own bookkeeping, kept; each timing noted too

                def noted(timing: Any) -> None:
                    timings.append(dict(timing))
                    count(timing)

                collection._count = noted  # type: ignore[method-assign]
                for index, (batch, grad) in enumerate(zip(batches, grads, strict=True)):
                    collection.reset_stats()
                    timings.clear()
                    start = time.perf_counter()
                    pooled = collection(keys=batch.keys, values=batch.values, lengths=batch.lengths)
                    pooled.values().backward(grad)
                    wall = (time.perf_counter() - start) * 1e3
                    stats = collection.reset_stats()
                    if index < warmup:
                        continue
                    pull, push = timings
                    figures = {
                        "pull + push (trainer's wall)": wall,
                        "pull wait": stats.pull_wait_ms,
                        "pull server total": pull.get("total", 0.0),
                        "pull rest": stats.pull_wait_ms - pull.get("total", 0.0),
                        "push wait": stats.push_wait_ms,
                        "push server total": push.get("total", 0.0),
                        "push server decode": push.get("decode", 0.0),
                        "push server apply": push.get("apply", 0.0),
                        "push rest": stats.push_wait_ms - push.get("total", 0.0),
                        "rest of both waits": stats.pull_wait_ms
                        + stats.push_wait_ms
                        - pull.get("total", 0.0)
                        - push.get("total", 0.0),
                    }
                    for name, value in figures.items():
                        rows.setdefault(name, []).append(value)
        finally:
            stop_server(server)
    return {name: statistics.median(values) for name, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs per source, alternating")
    parser.add_argument("--source", action="append", type=Path, help="checkouts to run (default: this one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps, args.warmup)))
        return
    sources = [path.resolve() for path in args.source or [Path(".")]]
    load_before = os.getloadavg()
    results: dict[Path, list[dict[str, float]]] = {source: [] for source in sources}
    for round_index in range(args.rounds):
        for source in sources if round_index % 2 == 0 else sources[::-1]:
            # this file, run against the source's packages (PYTHONPATH; the server started from there too)
            command = [sys.executable, str(Path(__file__).resolve()), "--child"]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            env = {**os.environ, "PYTHONPATH": str(source)}
            done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, check=True)
            results[source].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"load average before / after: {load_before} / {os.getloadavg()}")
    print(f"{args.rounds} rounds, alternating; per round the median of steps {args.warmup}-{args.steps} (ms)")
    names = list(results[sources[0]][0])
    print("| | " + " | ".join(str(source) for source in sources) + " |")
    print("|---|" + "---|" * len(sources))
    for name in names:
        cells = [" / ".join(f"{run[name]:.2f}" for run in results[source]) for source in sources]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
