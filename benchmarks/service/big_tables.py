"""One server with a big table (issue 27): what whole-table operations cost and whether they stall pushes.

Starts ``robez serve --data-dir`` (``--workers``, shared memory in a temporary folder under /dev/shm),
creates one table of ``--memory-size`` floats (d 128, Z 32, adam: 3 x 4 x memory_size bytes of state)
and measures, from a client on the same machine:

- lookups of 4096 ids and pushes of ``--push-ids`` ids (binary bodies): p50 / p99;
- a snapshot (``POST .../snapshot``) with one client pushing all along: its duration, the pushes' p50 /
  p99 / max meanwhile (goal: p99 < 1 s);
- ``GET .../checksum`` with the same pusher: its duration and the pushes' max meanwhile;
- ``GET .../checkpoint`` read to the end with the same pusher: its first byte's time, its duration and
  the pushes meanwhile (a download is sent while it is made: service/log/stream_copy.py);
- for each of these, the longest hold of the table's update lock while the state was copied, as the
  server logs it (``service/store/live_copy.py``), and the peak extra memory meanwhile (the memory
  below, sampled ten times a second, minus the memory before);
- ``--updates`` logged pushes, ``kill -9`` of the server's process group, then a restart with the
  table's files evicted from the page cache: time to ``/readyz`` 200 and peak memory (PSS of the
  server's processes with its shared-memory files counted once, sampled ten times a second in a second
  such restart, since sampling slows it; goal < 1.25 x state + 300 MB), against the time to read the
  snapshot and the log from the disk (64 MiB reads front to back, as ``cat``, after the same eviction;
  goal: restart < 2 x that); the same restart again with the files in the page cache; and the start of
  a server with no table (process start-up alone); where a restart's time went (the supervisor's
  imports, the load, the rest: from the server log's timestamps), and the same load alone in one process
  (no worker importing beside it);
- the data directory's size; a graceful stop (SIGTERM to exit).

    python -m benchmarks.service.big_tables [--memory-size 268435456] [--workers 2] [--updates 2000]
        [--only-copies [--no-data-dir]] [--tree DIR]

``--only-restore``: only a restore of a snapshot file into the existing table (a replica whose log was
trimmed past it: ``TableStore.restore_from_file``), in one process over its own shared directory with
no data directory, as on a replica: the peak extra memory (PSS of the process with its shared-memory
files counted once, and the shared-memory files alone) and the time of the restore in place against
the switch to a new array filled from the file that it replaces (main's, ``TableAdmin.restore``),
alternated, ``--rounds`` each.

``--only-copies``: stop after the snapshot, the checksum and the download (``--no-data-dir``: a server
without one: the checksum and the download). ``--tree``: the source tree whose
``python -m service`` runs (default: the installed ``robez``), to compare a branch with main's tree.

The periodic snapshot by age is turned off (``ROBEZ_SNAPSHOT_EVERY_SECONDS=0``) so the logged updates
stay in the log for the restart. Prints a Markdown report, ready for docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.launch import RobezProcess
from robez_core.hostinfo import cpu_model

DIM, CHUNK, LOOKUP_IDS = 128, 32, 4096
MiB = 1 << 20


def server_memory_bytes(root: int, shm_dir: Path) -> int:
    """What a server holds in memory: the PSS of ``root`` and every process below it (/proc/<pid>/smaps)
    except their mappings of files under ``shm_dir``, plus the bytes of the server's own shared-memory
    files there (``robez-<root pid>-*``), so each page counts once, mapped or not, tmpfs or not."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    total = 0
    shared = str(shm_dir)
    for pid in tree:
        with contextlib.suppress(OSError):
            in_shm = False
            for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
                first = line.split(maxsplit=5)
                if first and "-" in first[0] and not first[0].endswith(":"):  # a mapping's header line
                    in_shm = len(first) == 6 and first[5].startswith(shared)
                elif first and first[0] == "Pss:" and not in_shm:
                    total += int(first[1]) * 1024
    for path in shm_dir.glob(f"robez-{root}-*/**/*"):  # not a killed server's, not yet removed
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_blocks * 512
    return total


class BigServer(RobezProcess):
    log_path: Path  # always given

    def __init__(
        self,
        data_dir: Path | None,
        shm_dir: Path,
        workers: int,
        log: Path,
        tree: Path | None = None,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``args`` / ``env``: more arguments and environment (a replica's ``--nats ...`` and login)."""
        self.data_dir, self.shm_dir, self.workers = data_dir, shm_dir, workers
        self.exec_time = 0.0
        self.readings: list[tuple[float, float]] = []  # each ``memory()`` reading: (start, end), monotonic
        super().__init__(
            [
                *(["--data-dir", str(data_dir)] if data_dir is not None else []),
                "--workers",
                str(workers),
                *args,
            ],
            {
                "ROBEZ_SHM_DIR": str(shm_dir),
                "ROBEZ_LOG_LEVEL": "info",
                "ROBEZ_DEFAULT_TABLE": "false",
                "ROBEZ_SNAPSHOT_EVERY_SECONDS": "0",
                **({"PYTHONPATH": str(tree)} if tree is not None else {}),
                **(env or {}),
            },
            log_path=log,
            program=[sys.executable, "-m", "service"] if tree is not None else None,
            cwd=tree,
        )

    def start(self, timeout_s: float = 600.0, *, sample_memory: bool = True) -> tuple[float, int]:  # type: ignore[override]
        """Start; returns (seconds from exec to /readyz 200, peak memory meanwhile in bytes; 0 when not
        ``sample_memory``: reading every process's smaps ten times a second walks the page tables of the
        table's mappings, a CPU of its own on a 2-core machine with a 3 GiB table, so a start that is
        timed is not sampled)."""
        peak, next_sample = 0, 0.0

        def sample() -> None:
            nonlocal peak, next_sample
            if sample_memory and time.monotonic() >= next_sample:  # ten times a second
                peak = max(peak, server_memory_bytes(self.pid, self.shm_dir))
                next_sample = time.monotonic() + 0.1

        self.exec_time = time.time()  # wall clock, for the server log's timestamps (_restart_phases)
        self.spawn()
        self.wait_ready(timeout_s, interval_s=0.02, on_poll=sample)
        return time.monotonic() - self.started_at, peak

    def memory(self) -> int:
        assert self.process is not None
        start = time.monotonic()
        try:
            return server_memory_bytes(self.pid, self.shm_dir)
        finally:
            self.readings.append((start, time.monotonic()))

    def terminate(self) -> float:  # type: ignore[override]
        """SIGTERM the process group; seconds until the server exited."""
        assert self.process is not None
        start = time.monotonic()
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=300)
        return time.monotonic() - start


@contextlib.contextmanager
def peak_memory(server: BigServer) -> Iterator[list[int]]:
    """Sample the server's memory (``server_memory_bytes``) ten times a second inside the block; the
    list holds [memory before the block, peak during it] once the block is over. Enter it before the
    pusher (and so leave it after): a reading walks the page tables of every server process (smaps),
    0.1-0.6 s with a 768 MiB table, and a push it overlaps may wait for it (250-420 ms measured); the
    reading before the block, taken while the first push ran, was taken for the call's doing
    (docs/benchmarks/copies-2026-11-27.md). The pushes that overlapped no reading: ``apart``."""
    figures = [server.memory()]
    peak = figures[0]
    stop = threading.Event()

    def loop() -> None:
        nonlocal peak
        while not stop.wait(0.1):
            peak = max(peak, server.memory())

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield figures
    finally:
        stop.set()
        thread.join(timeout=60)
        figures.append(max(peak, server.memory()))


def extra_memory(figures: list[int], state_bytes: int) -> str:
    before, peak = figures
    extra = peak - before
    return f"{extra / MiB:,.0f} MiB = state x {extra / state_bytes:.2f} (before: {before / MiB:,.0f} MiB)"


def percentiles(seconds: list[float]) -> str:
    if not seconds:
        return "n/a"
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered) * 1e3:.1f} / {p99 * 1e3:.1f} / {ordered[-1] * 1e3:.1f} ms"


def apart(spans: list[tuple[float, float]], readings: list[tuple[float, float]]) -> list[float]:
    """The latencies of the pushes (``spans``: start, end) that overlapped none of the memory
    ``readings`` (start, end): what the call alone did to them."""
    return [end - start for start, end in spans if not any(a < end and start < b for a, b in readings)]


class Pusher:
    """Pushes of ``num_ids`` random ids, one at a time on one connection; latencies in seconds (and,
    for those of the last ``during`` block, their (start, end), monotonic: ``spans``)."""

    def __init__(self, url: str, num_ids: int, seed: int, table: str = "big") -> None:
        self.client = httpx.Client(base_url=url, timeout=300.0)
        self.table = table
        self.random = np.random.default_rng(seed)
        self.num_ids = num_ids
        self.spans: list[tuple[float, float]] = []
        self.failures: list[str] = []  # pushes of ``during`` refused or failed, each in a few words

    def push(self) -> float:
        ids = self.random.integers(0, 1 << 40, self.num_ids, dtype=np.int64)
        grads = (self.random.standard_normal((self.num_ids, DIM), dtype=np.float32) * 1e-3).astype("<f4")
        start = time.perf_counter()
        response = self.client.post(
            f"/v1/tables/{self.table}/update",
            content=ids.astype("<i8").tobytes() + grads.tobytes(),
            headers={"Content-Type": "application/octet-stream", "X-Robez-Shape": f"{self.num_ids},{DIM}"},
        )
        elapsed = time.perf_counter() - start
        response.raise_for_status()
        return elapsed

    @contextlib.contextmanager
    def during(self) -> Iterator[list[float]]:
        """Push continuously on a thread inside the block; the list fills with latencies (``failures``:
        those that failed)."""
        latencies: list[float] = []
        self.spans, self.failures = [], []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                start = time.monotonic()
                try:
                    latencies.append(self.push())
                except httpx.HTTPError as exc:  # counted, not timed; the pusher goes on
                    self.failures.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                    stop.wait(0.05)
                    continue
                self.spans.append((start, time.monotonic()))

        thread = threading.Thread(target=loop)
        thread.start()
        try:
            yield latencies
        finally:
            stop.set()
            thread.join(timeout=600)


def timed(work: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache (``posix_fadvise(DONTNEED)`` after an fsync: no root needed),
    so the next read of them comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_seconds(paths: list[Path], *, from_disk: bool) -> float:
    """Seconds to read ``paths`` front to back in 64 MiB reads (what ``cat`` does), from the disk
    (evicted first) or from the page cache as it is."""
    if from_disk:
        drop_from_page_cache(paths)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(64 * MiB):
                pass
    return time.perf_counter() - start


def log_since(log: Path, after: int) -> str:
    """The server log's text from byte ``after`` on (what one step of the benchmark made it print)."""
    with open(log, "rb") as handle:
        handle.seek(after)
        return handle.read().decode(errors="replace")


# The line ``WalJournal.load_into`` logs once a table is loaded: the snapshot's read and the replay, timed.
_LOADED = re.compile(r"table 'big': (snapshot of .* replayed in [\d.]+ s)")


def copy_log(log: Path, after: int) -> str:
    """What the server logged of the last copy of a table's state since byte ``after`` of its log
    (``service/store/live_copy.py``): the longest update-lock hold, and how it was copied."""
    text = log_since(log, after)
    found = re.findall(
        r"state copied at version \d+ in ([\d.]+) s \((.*?)\); the update lock held at most ([\d.]+) ms", text
    )
    if not found:
        return "not logged (a server before the lock-free copy)"
    seconds, how, held = found[-1]
    figure = f"{float(held):,.1f} ms (copy {seconds} s: {how})"
    commits = re.findall(r"the update lock held ([\d.]+) ms for the commit \((.*)\)$", text, re.MULTILINE)
    if commits:
        figure += f"; commit {float(commits[-1][0]):,.1f} ms ({commits[-1][1]})"
    return figure


def _load_log(log: Path, after: int) -> str:
    """What the server logged of its last load of the table since byte ``after`` of its log
    (``WalJournal.load_into``): the snapshot's read and the log's replay, each timed."""
    text = log_since(log, after)
    found = _LOADED.findall(text)
    return found[-1] if found else "not logged (a server before the load was timed)"


def _restart_phases(log: Path, after: int, exec_time: float, ready_seconds: float) -> str:
    """Where a restart's time went, from the server log's timestamps since byte ``after``: exec to the
    supervisor's first line (its imports: torch, the service), then to the table loaded (the snapshot
    and the replay, while the workers import beside it), then to ``/readyz`` 200."""
    text = log_since(log, after)

    def at(pattern: str) -> float | None:
        found = re.search(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*{pattern}", text, re.MULTILINE)
        if found is None:
            return None
        when = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
        return when.timestamp() - exec_time

    imported, loaded = at("robez.cli: shared tables in"), at("loaded table big at version")
    if imported is None or loaded is None:
        return "not logged"
    return (
        f"{imported:.1f} s to the supervisor's first log line (imports), {loaded - imported:.1f} s loading "
        f"the table, {ready_seconds - loaded:.1f} s to ready"
    )


def load_alone(data_dir: str, shm_dir: str) -> None:
    """The load a restart does (``TableStore.prepare``: snapshot into shared memory, log replayed), in
    this process alone (no worker importing beside it); prints the load's own log line and its seconds.
    Run by ``main`` in a fresh interpreter."""
    import logging

    from service.config import Settings
    from service.store import TableStore
    from service.wal import WalJournal

    started = time.perf_counter()
    logging.basicConfig(level="INFO", format="%(message)s", stream=sys.stdout)
    settings = Settings(data_dir=Path(data_dir), shm_dir=Path(shm_dir), default_table=False)
    journal = WalJournal.from_settings(settings)
    try:
        prepared = TableStore.prepare(settings, journal)
        loaded = time.perf_counter()
        prepared.remove()
    finally:
        journal.close()
    print(f"load {loaded - started:.1f} s")


def _load_alone(data_dir: Path, shm_dir: Path) -> str:
    """``load_alone`` in a fresh interpreter (files as they are in the page cache)."""
    code = "import sys; from benchmarks.service.big_tables import load_alone; load_alone(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(data_dir), str(shm_dir)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
        env={key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")},
    )
    found = _LOADED.search(done.stdout)
    return f"{done.stdout.splitlines()[-1]} ({found.group(1) if found else 'load not logged'})"


def restore_worker(shm_dir: str, checkpoint: str, memory_size: int) -> None:
    """The process ``--only-restore`` measures: a store over a new shared directory in ``shm_dir``, no
    data directory, table t (``memory_size`` floats, adam) saved to ``checkpoint``; then, for each line
    on stdin ("in-place" or "switch"), t restored from the file that way at the next version, and the
    seconds it took printed."""
    from robez_core.checkpoint import CheckpointFile
    from robez_core.config import OptimizerConfig, TableConfig
    from service.config import Settings, TableSpec
    from service.log.journal import NullJournal
    from service.store import TableStore
    from service.store.admin import TableAdmin

    settings = Settings(_env_file=None, shm_dir=Path(shm_dir), default_table=False)  # type: ignore[call-arg]
    journal = NullJournal()
    store = TableStore(TableStore.prepare(settings, journal), settings, journal)
    config = TableConfig(
        num_embeddings=memory_size, embedding_dim=DIM, memory_size=memory_size, chunk_size=CHUNK
    )
    store.create("t", TableSpec(config, OptimizerConfig("adam")))
    store.table("t").weight.add_(1.0)
    store.table("t").save(checkpoint)
    switch = TableAdmin(store.registry, journal, store.limits)  # main's restore_from_file
    print("ready", flush=True)
    for version, line in enumerate(sys.stdin, start=1):
        start = time.perf_counter()
        if line.strip() == "switch":
            switch.restore("t", CheckpointFile.open(checkpoint), version)
        else:
            store.restore_from_file("t", Path(checkpoint), version)
        print(f"{time.perf_counter() - start:.3f}", flush=True)


def _shm_bytes(shm_dir: Path) -> int:
    return sum(path.stat().st_blocks * 512 for path in shm_dir.glob("robez-*/**/*") if path.is_file())


def _sampled_restore(worker: subprocess.Popen[str], mode: str, shm_dir: Path) -> tuple[float, int, int]:
    """One restore by ``worker`` (``restore_worker``), its memory sampled 20 times a second: (seconds,
    peak extra PSS + shm, peak extra shm)."""
    assert worker.stdin is not None and worker.stdout is not None
    before = (server_memory_bytes(worker.pid, shm_dir), _shm_bytes(shm_dir))
    peak = list(before)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], server_memory_bytes(worker.pid, shm_dir))
            peak[1] = max(peak[1], _shm_bytes(shm_dir))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        worker.stdin.write(f"{mode}\n")
        worker.stdin.flush()
        seconds = float(worker.stdout.readline())
    finally:
        stop.set()
        sampler.join(timeout=60)
    return seconds, peak[0] - before[0], peak[1] - before[1]


def _only_restore(args: argparse.Namespace, root: Path, shm_dir: Path, state_bytes: int) -> list[str]:
    """``--only-restore`` (module docstring): the report's rows."""
    code = (
        "import sys; from benchmarks.service.big_tables import restore_worker; "
        "restore_worker(*sys.argv[1:3], int(sys.argv[3]))"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code, str(shm_dir), str(root / "t.safetensors"), str(args.memory_size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    results: dict[str, dict[str, list[float]]] = {}  # bytes as floats too
    try:
        assert worker.stdout.readline().strip() == "ready"

        for round_ in range(args.rounds):
            modes = ["switch", "in-place"] if round_ % 2 == 0 else ["in-place", "switch"]
            for mode in modes:
                figures = results.setdefault(mode, {"seconds": [], "sampled": [], "pss": [], "shm": []})
                worker.stdin.write(f"{mode}\n")  # timed without sampling: a reading costs a CPU
                worker.stdin.flush()
                figures["seconds"].append(float(worker.stdout.readline()))
                sampled, extra_pss, extra_shm = _sampled_restore(worker, mode, shm_dir)
                figures["sampled"].append(sampled)
                figures["pss"].append(extra_pss)
                figures["shm"].append(extra_shm)
    finally:
        worker.kill()
        worker.wait()
    rows = []
    for mode, label in (("switch", "switch to a new array (main)"), ("in-place", "in place (this branch)")):
        figures = results[mode]
        peak_pss, peak_shm = max(figures["pss"]), max(figures["shm"])
        rows.append(
            f"| restore from a file, {label}: seconds (median of {args.rounds}; each) | "
            f"{statistics.median(figures['seconds']):.2f} s "
            f"({', '.join(f'{x:.2f}' for x in figures['seconds'])}) |"
        )
        rows.append(
            f"| restore from a file, {label}: peak extra memory, PSS + shm (max of {args.rounds} sampled "
            f"at 20 Hz) | {peak_pss / MiB:,.0f} MiB = state x {peak_pss / state_bytes:.2f} |"
        )
        rows.append(
            f"| restore from a file, {label}: peak extra /dev/shm | {peak_shm / MiB:,.0f} MiB = state x "
            f"{peak_shm / state_bytes:.2f} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service.big_tables", description=__doc__)
    parser.add_argument("--memory-size", type=int, default=1 << 28)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2000, help="logged pushes before the kill -9")
    parser.add_argument("--push-ids", type=int, default=256)
    parser.add_argument("--requests", type=int, default=200, help="lookups and pushes timed at rest")
    parser.add_argument("--data-dir", type=Path, default=None, help="parent of the data dir (default .)")
    parser.add_argument(
        "--tree", type=Path, default=None, help="the source tree the server runs from (default: this one)"
    )
    parser.add_argument(
        "--only-copies",
        action="store_true",
        help="stop after the snapshot, the checksum and the download (no restarts); peak memory sampled",
    )
    parser.add_argument(
        "--no-data-dir",
        action="store_true",
        help="with --only-copies: a server without a data directory (the checksum and the download)",
    )
    parser.add_argument(
        "--only-restore",
        action="store_true",
        help="only a restore from a file into the existing table, in place vs switched (no server)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --only-restore: restores of each kind")
    args = parser.parse_args(argv)
    if args.no_data_dir and not args.only_copies:
        parser.error("--no-data-dir goes with --only-copies")
    state_bytes = 3 * 4 * args.memory_size
    root = Path(tempfile.mkdtemp(prefix="robez-bench-big-", dir=args.data_dir or Path.cwd()))
    shm_dir = Path(tempfile.mkdtemp(prefix="robez-bench-big-", dir="/dev/shm"))
    if args.only_restore:
        try:
            rows = _only_restore(args, root, shm_dir, state_bytes)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm_dir, ignore_errors=True)
        args.no_data_dir, args.workers = True, 1
        return _report(args, argv, state_bytes, rows)
    data_dir = root / "data"
    server = BigServer(
        None if args.no_data_dir else data_dir, shm_dir, args.workers, root / "server.log", args.tree
    )
    lines: list[str] = []

    def row(what: str, figure: str) -> None:
        lines.append(f"| {what} | {figure} |")
        print(lines[-1], file=sys.stderr, flush=True)

    try:
        empty_start, empty_peak = server.start()
        row(
            "start with no table: exec to /readyz 200, peak memory",
            f"{empty_start:.1f} s, {empty_peak / MiB:.0f} MiB",
        )
        config = {"num_embeddings": 1 << 40, "embedding_dim": DIM, "memory_size": args.memory_size}
        config["chunk_size"] = CHUNK
        seconds, response = timed(
            lambda: httpx.post(
                f"{server.url}/v1/tables",
                json={"name": "big", "config": config, "optimizer": {"name": "adam", "lr": 1e-3}},
                timeout=1200,
            )
        )
        response.raise_for_status()
        row(
            "`POST /v1/tables` (create + first snapshot)",
            f"{seconds:.1f} s; memory after {server.memory() / MiB:.0f} MiB",
        )
        pusher = Pusher(server.url, args.push_ids, 1)
        lookups = httpx.Client(base_url=server.url, timeout=300.0)
        rng = np.random.default_rng(2)
        lookup_seconds = []
        for index in range(args.requests + 10):  # the first 10 warm up the connection and caches
            ids = rng.integers(0, 1 << 40, LOOKUP_IDS, dtype=np.int64).astype("<i8").tobytes()
            start = time.perf_counter()
            lookups.post(
                "/v1/tables/big/lookup", content=ids, headers={"Content-Type": "application/octet-stream"}
            ).raise_for_status()
            if index >= 10:
                lookup_seconds.append(time.perf_counter() - start)
        row(f"lookup of {LOOKUP_IDS} ids, p50 / p99 / max", percentiles(lookup_seconds))
        row(
            f"push of {args.push_ids} ids at rest, p50 / p99 / max",
            percentiles([pusher.push() for _ in range(args.requests)]),
        )

        def copy_of_the_state(what: str, call: str, request: Callable[[], httpx.Response]) -> None:
            """Time ``request`` (``call``: a snapshot or a checksum) with a pusher running: its duration,
            peak extra memory, the pushes meanwhile and the longest update-lock hold it logged."""
            logged = server.log_path.stat().st_size
            with peak_memory(server) as memory, pusher.during() as during:
                seconds, response = timed(request)
                response.raise_for_status()
            row(f"`{call}` duration (one pusher running)", f"{seconds:.1f} s")
            row(
                f"the {what}'s peak extra memory (PSS of the server's processes, shared memory once)",
                extra_memory(memory, state_bytes),
            )
            row(f"pushes during the {what} ({len(during)}), p50 / p99 / max", percentiles(during))
            clear = apart(pusher.spans, server.readings)
            row(f"... of them, those overlapping no memory reading ({len(clear)})", percentiles(clear))
            row(
                f"the {what}'s copy of the state: longest update-lock hold (server log)",
                copy_log(server.log_path, logged),
            )

        if not args.no_data_dir:  # a server without one has no snapshot to take
            copy_of_the_state(
                "snapshot",
                "POST .../snapshot",
                lambda: httpx.post(f"{server.url}/v1/tables/big/snapshot", timeout=1200),
            )
        copy_of_the_state(
            "checksum",
            "GET .../checksum",
            lambda: httpx.get(f"{server.url}/v1/tables/big/checksum", timeout=1200),
        )
        first_byte: list[float] = []

        def download() -> httpx.Response:
            start = time.perf_counter()
            with httpx.stream("GET", f"{server.url}/v1/tables/big/checkpoint", timeout=1200) as response:
                for _ in response.iter_raw(1 << 20):
                    if not first_byte:
                        first_byte.append(time.perf_counter() - start)
                    # read and dropped: the client's memory is not the server's
            return response

        # Sent while it is made (service/log/stream_copy.py): its first byte, then the whole.
        copy_of_the_state("checkpoint download", "GET .../checkpoint (read to the end)", download)
        first = f"{first_byte[0] * 1e3:,.0f} ms"
        row("the checkpoint download's first byte, from the request's start", first)
        if args.only_copies:
            row("graceful stop (SIGTERM to exit)", f"{server.terminate():.1f} s")
            return _report(args, argv, state_bytes, lines)
        seconds, _ = timed(lambda: [pusher.push() for _ in range(args.updates)])
        row(f"{args.updates} more pushes logged", f"{seconds:.1f} s")
        server.kill()
        files = [*sorted(data_dir.glob("big/snapshot-*.safetensors")), data_dir / "big" / "updates.wal"]
        file_bytes = sum(path.stat().st_size for path in files)
        read = _read_seconds(files, from_disk=True)
        cached_read = _read_seconds(files, from_disk=False)
        row(
            "snapshot + log: bytes; time to read them from the disk (evicted from the page cache first) "
            "/ from the page cache",
            f"{file_bytes / MiB:,.0f} MiB ({files[-1].stat().st_size / MiB:,.0f} MiB of log); "
            f"{read:.1f} s / {cached_read:.1f} s",
        )

        def timed_restart(what: str, baseline: float, against: str) -> None:
            """A restart from exec to /readyz 200 (memory not sampled), and its load from the server log."""
            logged = server.log_path.stat().st_size
            seconds, _ = server.start(sample_memory=False)
            row(what, f"{seconds:.1f} s ({seconds / baseline:.1f} x {against})")
            row("... of which the table's load (server log)", _load_log(server.log_path, logged))
            row(
                "... exec to ready (server log's timestamps)",
                _restart_phases(server.log_path, logged, server.exec_time, seconds),
            )

        drop_from_page_cache(files)
        timed_restart(
            "restart after kill -9, files evicted from the page cache: exec to /readyz 200",
            read,
            "the read from the disk",
        )
        server.kill()  # the same restart again, its memory sampled
        drop_from_page_cache(files)
        sampled, peak = server.start()
        up = server.memory()
        row(
            f"restart peak memory (PSS, shared memory once; that restart, sampled: {sampled:.1f} s); once up",
            f"{peak / MiB:,.0f} MiB = state x {peak / state_bytes:.2f}; {up / MiB:,.0f} MiB; "
            f"goal 1.25 x state + 300 MB = {(1.25 * state_bytes + 300e6) / MiB:,.0f} MiB",
        )
        server.kill()
        drop_from_page_cache(files)
        row(
            "the same load alone in one process (no worker starting beside it), files evicted",
            _load_alone(data_dir, shm_dir),
        )
        timed_restart(
            "the same restart again (kill -9), files in the page cache",
            cached_read,
            "the read from the page cache",
        )
        total = sum(path.stat().st_size for path in data_dir.rglob("*") if path.is_file())
        row("data dir size", f"{total / MiB:,.0f} MiB (state {state_bytes / MiB:,.0f} MiB)")
        pusher = Pusher(server.url, args.push_ids, 3)
        for _ in range(20):
            pusher.push()
        row("graceful stop (SIGTERM to exit) with 20 pushes since the restart", f"{server.terminate():.1f} s")
        empty = BigServer(root / "empty", shm_dir, args.workers, root / "server.log", args.tree)
        try:
            empty_start, empty_peak = empty.start()
        finally:
            empty.kill()
        row(
            "for scale: a start with no table, exec to /readyz 200, peak memory",
            f"{empty_start:.1f} s, {empty_peak / MiB:.0f} MiB",
        )
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return _report(args, argv, state_bytes, lines)


def _report(args: argparse.Namespace, argv: Sequence[str] | None, state_bytes: int, lines: list[str]) -> int:
    """Print the Markdown report."""
    print(f"# One server with a big table ({datetime.date.today().isoformat()})\n")
    print(f"- command: `python -m benchmarks.service.big_tables {' '.join(argv or sys.argv[1:])}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    print(
        f"- table: m = {args.memory_size:,} (2^{args.memory_size.bit_length() - 1}), d = {DIM}, Z = {CHUNK}, "
        "adam: "
        f"{state_bytes / MiB:,.0f} MiB of state; {args.workers} workers, "
        f"{'no data directory' if args.no_data_dir else 'fsync always'}; threads: the default"
    )
    if getattr(args, "only_restore", False):
        print("- one process (no server): the restores timed inside it, its memory read from /proc\n")
    else:
        print("- one client on the same machine; latencies measured by the client (binary bodies)\n")
    print("| what | measured |\n|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
