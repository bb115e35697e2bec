"""What a long history of tables costs ``/metrics`` and the lookups beside it (issue 28).

Starts ``robez serve`` (one worker, the demo table), makes ``--cycles`` tables of distinct names, each
looked up once and deleted (what a test rig or a per-experiment workflow does), then reports the size of
``/metrics``, its table labels, how long a scrape takes, and lookup latency on the demo table alone and
while ``--scrapers`` clients scrape ``/metrics`` in a loop.

    python -m benchmarks.service.metrics_history [--cycles 2000] [--scrapers 4] [--lookups 400]

Prints a Markdown report (command, machine, load, date) for docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.launch import RobezProcess
from robez_core.hostinfo import cpu_model

_SMALL = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 256, "chunk_size": 4}


def _start(workdir: Path) -> RobezProcess:
    """``robez serve`` (the demo table, 1 kernel thread) started and ready."""
    env = {"ROBEZ_SHM_DIR": str(workdir / "shm"), "ROBEZ_THREADS_PER_WORKER": "1"}
    return RobezProcess([], env, log_path=workdir / "server.log").start(300.0, interval_s=0.2)


def _lookup_latencies_ms(url: str, count: int) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for index in range(count):
            start = time.perf_counter()
            response = client.post("/v1/tables/demo/lookup", json={"ids": [index, index + 1]})
            latencies.append((time.perf_counter() - start) * 1e3)
            assert response.status_code == 200, response.text
    return latencies


def _scrape(url: str, stop: Any, scrapes: Any) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            client.get("/metrics")
            with scrapes.get_lock():
                scrapes.value += 1


def _figures(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered):.2f} | {p99:.2f} | {ordered[-1]:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service.metrics_history", description=__doc__)
    parser.add_argument("--cycles", type=int, default=2000, help="tables created, looked up and deleted")
    parser.add_argument("--scrapers", type=int, default=4, help="clients scraping /metrics in a loop")
    parser.add_argument("--lookups", type=int, default=400, help="lookups per latency measurement")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="robez-bench-metrics-") as directory:
        server = _start(Path(directory))
        url = server.url
        try:
            began = time.perf_counter()
            with httpx.Client(base_url=url, timeout=60) as client:
                for index in range(args.cycles):
                    name = f"h{index}"
                    assert client.post("/v1/tables", json={"name": name, "config": _SMALL}).status_code == 201
                    assert client.post(f"/v1/tables/{name}/lookup", json={"ids": [1]}).status_code == 200
                    assert client.delete(f"/v1/tables/{name}").status_code == 204
                    if index % 100 == 99:
                        client.get("/metrics")  # a Prometheus scrape every 100 cycles
            history_s = time.perf_counter() - began
            httpx.post(f"{url}/v1/tables/demo/lookup", json={"ids": [1]}, timeout=60)  # demo's series too
            scrape_s, size, labels = [], 0, set()
            with httpx.Client(
                base_url=url, timeout=60
            ) as client:  # one connection: the scrape, not TLS set-up
                for _ in range(5):
                    start = time.perf_counter()
                    text = client.get("/metrics").text
                    scrape_s.append(time.perf_counter() - start)
                    size, labels = len(text.encode()), set(re.findall(r'table="([^"]*)"', text)) - {""}
            alone = _lookup_latencies_ms(url, args.lookups)
            # Scrapers in processes of their own: threads here would take the GIL from the lookups' timing.
            context = multiprocessing.get_context("spawn")
            stop, scrapes = context.Event(), context.Value("i", 0)
            scrapers = [
                context.Process(target=_scrape, args=(url, stop, scrapes)) for _ in range(args.scrapers)
            ]
            for scraper in scrapers:
                scraper.start()
            try:
                deadline = time.monotonic() + 120
                while scrapes.value < 4 * args.scrapers and time.monotonic() < deadline:
                    time.sleep(0.1)  # until every scraper is up and scraping
                counted = scrapes.value
                beside = _lookup_latencies_ms(url, args.lookups)
                during = scrapes.value - counted
            finally:
                stop.set()
                for scraper in scrapers:
                    scraper.join(60)
        finally:
            server.stop(60.0)

    print(f"# /metrics after a history of {args.cycles} tables ({datetime.date.today().isoformat()})\n")
    command = " ".join(["python -m benchmarks.service.metrics_history", *(argv or sys.argv[1:])])
    print(f"- command: `{command}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    print(f"- load average before: {load_before[0]:.2f} (a shared machine: compare rows of one run)")
    print("- server: `robez serve`, 1 worker, 1 kernel thread, the demo table, default MAX_METRIC_TABLES")
    print(
        f"- history: {args.cycles} tables of distinct names, each created, looked up once and deleted, "
        f"a scrape every 100 ({history_s:.0f} s)\n"
    )
    print("| /metrics bytes | table labels | scrape median (ms) |")
    print("|---:|---:|---:|")
    named = ", ".join(sorted(labels))
    print(f"| {size} | {len(labels)} ({named}) | {statistics.median(scrape_s) * 1e3:.1f} |\n")
    print("| demo lookups (2 ids, JSON) | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---:|---:|---:|")
    print(f"| alone | {_figures(alone)} |")
    print(f"| beside {args.scrapers} scrapers ({during} scrapes meanwhile) | {_figures(beside)} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
