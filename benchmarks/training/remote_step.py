"""The remote collection's two requests of a DLRM step alone, and where their time goes (issue 37).

``benchmarks/training/dlrm.py``'s ``remote_collection`` without the dense model: a ``robez serve`` on this
machine (1 worker, 1 kernel thread, no data dir), its 26 tables over one shared array, and per step the
collection's pull (``lookup_many``) in ``forward`` and its push (``update_many``) in ``backward`` of a
random output gradient. Per step: the trainer's wait for each request, the server's ``Server-Timing``
stages of each, and the rest of each wait (transport, the server's event loop outside its ``total``,
the client's codec): medians over the steps after ``--warmup``. With ``--source DIR`` (repeatable) the
same is run from each of several checkouts (server included), alternating, so a change's effect is
read in one run. ``--modes two,one`` also runs the one-request step (``prefetch_after_push``: each push
carries the next batch's pull, ``POST /v1/update`` with a lookup part), alternating with the two-request
one; its figures are those of the combined request, waited for by the next step's ``forward``.

    flock /tmp/robez-bench.lock python -m benchmarks.training.remote_step --source . --source ../base
    flock /tmp/robez-bench.lock python -m benchmarks.training.remote_step --modes two,one
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def measure(steps: int, warmup: int, mode: str = "two") -> dict[str, Any]:
    """One server, ``steps`` steps of pull + push; the medians (ms) of the steps after ``warmup``.
    ``mode`` "one": each push carries the next pull (one request a step)."""
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
                one = mode == "one"
                collection = RemoteEmbeddingBagCollection(
                    client, robez_tables(settings), prefetch_after_push=one
                )
                timings: list[dict[str, float]] = []
                count = collection._count  # the collection's own bookkeeping, kept; each timing noted too

                def noted(timing: Any) -> None:
                    timings.append(dict(timing))
                    count(timing)

                collection._count = noted  # type: ignore[method-assign]
                for index, (batch, grad) in enumerate(zip(batches, grads, strict=True)):
                    collection.reset_stats()
                    if not one:
                        timings.clear()
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
                    pooled = collection(keys=batch.keys, values=batch.values, lengths=batch.lengths)
                    # one request a step: the forward waited for the request the last backward sent (its
                    # timing noted by the request thread before its answer was handed over)
                    waited = timings.pop(0) if one and timings else {}
                    if one and index + 1 < len(batches):
                        after = batches[index + 1]
                        collection.prefetch(keys=after.keys, values=after.values, lengths=after.lengths)
                    pooled.values().backward(grad)
                    wall = (time.perf_counter() - start) * 1e3
                    cpus = {
                        "trainer thread CPU": (time.thread_time() - cpu) * 1e3,
                        "trainer process CPU (+ request thread)": (time.process_time() - process) * 1e3,
                        "trainer page faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                    }
                    stats = collection.reset_stats()
                    if index < warmup:
                        continue
                    if one:
                        figures = {
                            "push + pull (trainer's wall)": wall,
                            "wait": stats.pull_wait_ms,
                            "server total": waited.get("total", 0.0),
                            "server decode": waited.get("decode", 0.0),
                            "server apply": waited.get("apply", 0.0),
                            "server lookup part": waited.get("lookup_hash", 0.0) + waited.get("lookup", 0.0),
                            "rest of the wait": stats.pull_wait_ms - waited.get("total", 0.0),
                            **cpus,
                        }
                        for name, value in figures.items():
                            rows.setdefault(name, []).append(value)
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
                        **cpus,
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
    parser.add_argument(
        "--modes", default="two", help="comma-separated: two (pull, then push) and/or one (push + next pull)"
    )
    parser.add_argument("--mode", default="two", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps, args.warmup, args.mode)))
        return
    sources = [path.resolve() for path in args.source or [Path(".")]]
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or any(mode not in ("one", "two") for mode in modes):
        parser.error(f"--modes takes one and two, got {args.modes!r}")
    runs = [(source, mode) for source in sources for mode in modes]
    load_before = os.getloadavg()
    results: dict[tuple[Path, str], list[dict[str, float]]] = {run: [] for run in runs}
    for round_index in range(args.rounds):
        for source, mode in runs if round_index % 2 == 0 else runs[::-1]:
            # this file, run against the source's packages (PYTHONPATH; the server started from there too)
            command = [sys.executable, str(Path(__file__).resolve()), "--child"]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--mode", mode]
            env = {**os.environ, "PYTHONPATH": str(source)}
            done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, check=True)
            results[(source, mode)].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"load average before / after: {load_before} / {os.getloadavg()}")
    print(f"{args.rounds} rounds, alternating; per round the median of steps {args.warmup}-{args.steps} (ms)")
    for mode in modes:
        names = list(results[(sources[0], mode)][0])
        print(f"\n{mode} request(s) a step\n")
        print("| | " + " | ".join(str(source) for source in sources) + " |")
        print("|---|" + "---|" * len(sources))
        for name in names:
            cells = [" / ".join(f"{run[name]:.2f}" for run in results[(source, mode)]) for source in sources]
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
