"""Issue 39's figures: what a refused upload costs a worker, and what create/drop churn leaves in the
multiprocess metric files.

- ``load``: ``robez serve`` (1 worker) is sent ``POST /v1/tables/t/load`` with, in turn: a ~1 MB deflated
  torch.save zip whose one tensor (``junk``, not a ROBE-Z key) declares ``--declared-mib`` MiB (1 GiB:
  within the default limits); the same size of a paper state_dict of the right keys, dtypes and shapes
  whose ``helper_E1sR`` is wrong (only its values tell), deflated; and that state_dict as torch.save
  writes it (stored) at ``--stored-mib`` MiB, under ``max_body_bytes`` (64 MiB). Reported: the answer, and
  how far the peak RSS (VmHWM, reset through ``/proc/<pid>/clear_refs`` first) of each server process rose
  above its RSS before the request.
- ``churn``: ``robez serve --workers 2`` makes ``--cycles`` tables (create, one lookup, delete), scraping
  ``/metrics`` every 50 cycles; after the first 10 and after all of them (each followed by 8 scrapes, so
  both workers answer some): the series in the metric files (``<shared dir>/metrics/*.db``), their bytes in
  use, and ``/metrics``'s size and table labels.

    python -m benchmarks.service.loose_ends [--tree DIR] [--declared-mib 1024] [--cycles 2000]

``--tree``: the source tree whose ``python -m service`` runs (default: this checkout); the report in
docs/benchmarks/loose-ends-*.md runs it on main's tree and on this one. Prints Markdown.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import struct
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch

from loadtest.launch import RobezProcess

_SMALL = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 256, "chunk_size": 4}


def _server(tree: Path, workdir: Path, *extra: str) -> RobezProcess:
    env = {
        "ROBEZ_SHM_DIR": str(workdir / "shm"),
        "ROBEZ_THREADS_PER_WORKER": "1",
        "ROBEZ_DEFAULT_TABLE": "false",
        "PYTHONPATH": str(tree),
    }
    program = [sys.executable, "-m", "service"]
    process = RobezProcess(list(extra), env, log_path=workdir / "server.log", program=program, cwd=tree)
    return process.start(300.0, interval_s=0.2)


def _paper(mib: int) -> dict[str, torch.Tensor]:
    """A paper RobezEmbedding state_dict (d 8, Z 4) with a ``mib`` MiB weight whose helper_E1sR is wrong."""
    j = torch.arange(8, dtype=torch.int64)
    return {
        "weight": torch.empty(mib << 18).zero_(),
        "random_numbers": torch.tensor([2038074743, *range(3, 13)], dtype=torch.int64),
        "helper_Eidx_base": j // 4,
        "helper_Eidx_offset": j % 4,
        "helper_E1sR": torch.zeros(8, dtype=torch.int64),
    }


def _bomb(kind: str, mib: int, directory: Path) -> bytes:
    """A torch.save zip: ``junk``: ``{"junk": <mib MiB of float32 zeros>}``, every member deflated;
    ``paper``: ``_paper(mib)``, every member deflated; ``stored``: ``_paper(mib)`` as torch.save writes it."""
    plain = directory / "plain.pt"
    torch.save({"junk": torch.empty(mib << 18).zero_()} if kind == "junk" else _paper(mib), plain)
    if kind == "stored":
        data = plain.read_bytes()
        plain.unlink()
        return data
    out = io.BytesIO()
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            with source.open(member) as reader, target.open(member.filename, "w", force_zip64=True) as writer:
                while chunk := reader.read(1 << 22):
                    writer.write(chunk)
    plain.unlink()
    return out.getvalue()


def _group(leader: int) -> list[int]:
    """The pids of ``leader``'s process group (the server and its workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == leader:
                pids.append(int(entry.name))
    return pids


def _status_kib(pid: int, field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) if match else 0


def refused_load(tree: Path, kind: str, mib: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="robez-bench-load-") as directory:
        workdir = Path(directory)
        body = _bomb(kind, mib, workdir)
        server = _server(tree, workdir, "--data-dir", str(workdir / "data"))
        try:
            pids = _group(server.pid)
            for pid in pids:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            before = {pid: _status_kib(pid, "VmRSS") for pid in pids}
            began = time.perf_counter()
            response = httpx.post(
                f"{server.url}/v1/tables/t/load?chunk_size=4",
                content=body,
                headers={"Content-Type": "application/octet-stream"},
                timeout=300,
            )
            seconds = time.perf_counter() - began
            grown = {pid: _status_kib(pid, "VmHWM") - before[pid] for pid in pids}
            exists = httpx.get(f"{server.url}/v1/tables/t", timeout=30).status_code
        finally:
            server.stop()
    return [
        f"| upload ({kind}) | {len(body) / 2**20:.2f} MiB declaring {mib} MiB |",
        f"| answer | {response.status_code}: {response.json().get('error', '')[:110]} |",
        f"| table afterwards | GET answers {exists} |",
        f"| peak RSS growth, largest server process | {max(grown.values()) / 1024:.1f} MiB |",
        f"| peak RSS growth, all {len(pids)} server processes | {sum(grown.values()) / 1024:.1f} MiB |",
        f"| time to the answer | {seconds:.2f} s |",
    ]


def _files(shm_dir: Path) -> tuple[int, int, int]:
    """(files, series, bytes in use) of the metric files (``<shared dir>/metrics/*.db``)."""
    paths = sorted(shm_dir.rglob("metrics/*.db"))
    series = used = 0
    for path in paths:
        data = path.read_bytes()
        used += struct.unpack_from("i", data, 0)[0]
        position = 8
        while position < struct.unpack_from("i", data, 0)[0]:
            length = struct.unpack_from("i", data, position)[0]
            position += 4 + length + (8 - (length + 4) % 8) + 16
            series += 1
    return len(paths), series, used


def metric_churn(tree: Path, cycles: int) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="robez-bench-churn-") as directory:
        workdir = Path(directory)
        server = _server(tree, workdir, "--workers", "2")
        try:
            began = time.perf_counter()
            done = 0
            for upto in (10, cycles):
                for index in range(done, upto):
                    # a new connection each cycle: both workers take some of them
                    with httpx.Client(base_url=server.url, timeout=60) as client:
                        name = f"churn{index}"
                        created = client.post("/v1/tables", json={"name": name, "config": _SMALL})
                        assert created.status_code == 201, created.text
                        assert (
                            client.post(f"/v1/tables/{name}/lookup", json={"ids": [1, 2]}).status_code == 200
                        )
                        assert client.delete(f"/v1/tables/{name}").status_code == 204
                        if index % 50 == 0:
                            client.get("/metrics")
                done = upto
                texts = [httpx.get(f"{server.url}/metrics", timeout=60).text for _ in range(8)]
                files, series, used = _files(workdir / "shm")
                labels = set(re.findall(r'table="([^"]*)"', texts[-1])) - {""}
                rows.append(
                    f"| after {upto} cycles | {files} | {series} | {used / 1024:.1f} | "
                    f"{len(texts[-1]) / 1024:.1f} | {sorted(labels) or '-'} |"
                )
            seconds = time.perf_counter() - began
        finally:
            server.stop()
    return [
        "| | metric files | series in them | KiB in use | /metrics KiB | table labels in /metrics |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        f"\n({cycles} cycles in {seconds:.0f} s)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service.loose_ends", description=__doc__)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--declared-mib", type=int, default=1024)
    parser.add_argument("--stored-mib", type=int, default=60)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--only", choices=("load", "churn"))
    args = parser.parse_args(argv)
    print(f"tree: {args.tree}; load average before: {os.getloadavg()}\n")
    if args.only in (None, "load"):
        for kind, mib in (
            ("junk", args.declared_mib),
            ("paper", args.declared_mib),
            ("stored", args.stored_mib),
        ):
            print("| refused load | |\n| --- | --- |")
            print("\n".join(refused_load(args.tree, kind, mib)) + "\n", flush=True)
    if args.only in (None, "churn"):
        print("\n".join(metric_churn(args.tree, args.cycles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
