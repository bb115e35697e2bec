"""Page faults of fresh multi-megabyte allocations, and what glibc malloc tuning does to them.

``python -m benchmarks.core.page_faults`` runs, at 1 thread, the calls that allocate megabytes each time:

- the fused dense-Adam pair-model step of ``benchmarks.core.paper_tables`` (rows, products and
  gradients of 13 MB);
- the embedding's share of that step (two lookups, their backward, dense Adam), fused and reference;
- one fused forward lookup of 32768 ids (13 MB of rows);
- the service's lookup path for 4096 ids on its demo table (d = 64): ``Table.hash``, ``Table.gather``
  and the little-endian bytes of the rows, as ``service/store/`` and ``service/codec.py`` do them
  (1 MB of rows and 1 MB of bytes);

each in a fresh process with glibc's defaults and with ``allocator.tune_malloc()``, for the host CPU and
for an emulated AVX2-only CPU (``paper_tables --emulate-avx2``'s environment), in alternating rounds
so that a change of machine load hits every variant alike. Per call it records the wall time and the
minor page faults (``getrusage`` ``ru_minflt`` before and after). The report gives, per variant, the
median and mean time and the faults per call, and reads from the data whether the tuning pays.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import DEFAULT_OUTPUT_DIR, avx2_emulation_env
from benchmarks.core import paper_tables
from benchmarks.core.small_batches import DEMO_CONFIG
from robez_core import hostinfo
from robez_core.allocator import MallocTuning, tune_malloc
from robez_core.config import OptimizerConfig
from robez_core.table import Table

ALLOCATORS = ("default", "tuned")
CPU_KINDS = ("host", "avx2-emulated")
SERVICE_IDS = 4096
# A variant counts as faster or slower than glibc's defaults only past this relative difference of
# medians: on a shared machine smaller differences are noise.
SIGNIFICANT = 0.03


@dataclass(frozen=True)
class Scenario:
    name: str
    calls: int
    run: Callable[[int], object]


def _scenarios(calls: int) -> list[Scenario]:
    """The allocating calls, set up once per process; ``run(i)`` makes call ``i``."""
    settings = paper_tables.BenchSettings()
    memory_size = paper_tables.TARGET_MEMORY_SIZE
    batches = paper_tables.batches_of(paper_tables.BenchSettings(iterations=4, seed=settings.seed))
    shape = (settings.batch_size, settings.embedding_dim)
    generator = torch.Generator().manual_seed(settings.seed + 2)
    output_grads = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    kept: dict[str, object] = {}  # results live until the next call replaces them, as in a training loop

    def step_call(model: str) -> Callable[[int], object]:
        config = paper_tables.RunConfig(model, False, "adam", memory_size)
        pair = paper_tables.PairModel(paper_tables.make_embedding(config, settings))
        optimizer = paper_tables.make_optimizer(config, list(pair.parameters()), settings.lr)

        def call(i: int) -> object:
            pairs, targets = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(pair(pairs), targets)
            loss.backward()
            optimizer.step()
            kept["step"] = loss
            return loss

        return call

    def share_call(model: str) -> Callable[[int], object]:
        config = paper_tables.RunConfig(model, False, "adam", memory_size)
        embedding = paper_tables.make_embedding(config, settings)
        optimizer = paper_tables.make_optimizer(config, list(embedding.parameters()), settings.lr)

        def call(i: int) -> object:
            pairs, _ = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            rows = (embedding(pairs[:, 0]), embedding(pairs[:, 1]))
            torch.autograd.backward(rows, output_grads)
            optimizer.step()
            kept[f"share {model}"] = rows
            return rows

        return call

    fused = paper_tables.make_embedding(paper_tables.RunConfig("fused", False, "adam", memory_size), settings)
    ids = batches[0][0][:, 0].contiguous()

    def forward_call(i: int) -> object:
        kept["forward"] = rows = fused(ids)
        return rows

    table = Table(DEMO_CONFIG, OptimizerConfig("adam", lr=1e-3))
    generator = torch.Generator().manual_seed(settings.seed + 4)
    service_ids = [torch.randint(0, 10_000_000, (SERVICE_IDS,), generator=generator) for _ in range(4)]

    def service_call(i: int) -> object:
        rows = table.gather(table.hash(service_ids[i % len(service_ids)]))
        kept["service"] = body = np.ascontiguousarray(rows.numpy(), dtype="<f4").tobytes()
        return body

    slow_calls = max(5, calls // 4)  # the reference share is ~15x slower
    return [
        Scenario("fused dense-Adam pair step (m=262144)", calls, step_call("fused")),
        Scenario("fused embedding share (2 lookups, backward, dense Adam)", calls, share_call("fused")),
        Scenario("reference embedding share (same work)", slow_calls, share_call("reference")),
        Scenario("fused forward lookup, 32768 ids x 100", calls, forward_call),
        Scenario(f"service lookup path, {SERVICE_IDS} ids x 64 + bytes", calls, service_call),
    ]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_worker(allocator: str, calls: int) -> dict[str, object]:
    """This process's measurements: per scenario the times (s) and minor faults of each call."""
    tuned = tune_malloc(MallocTuning()) if allocator == "tuned" else False
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for scenario in _scenarios(calls):
        for i in range(3):  # warm-up: numba cache load, lazy optimizer state, allocator growth
            scenario.run(i)
        seconds, faults = [], []
        for i in range(scenario.calls):
            faults_before = _minor_faults()
            start = time.perf_counter()
            scenario.run(i)
            seconds.append(time.perf_counter() - start)
            faults.append(_minor_faults() - faults_before)
        results[scenario.name] = {"seconds": seconds, "faults": faults}
    return {
        "allocator": allocator,
        "tuned": tuned,
        "kernel target": hostinfo.kernel_target(),
        "torch": hostinfo.torch_capability(),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "scenarios": results,
    }


# --------------------------------------------------------------------------------------------------
# parent: alternating rounds of workers


@dataclass
class Cell:
    """One (cpu kind, allocator, scenario): every call of every round."""

    round_medians_ms: list[float]
    seconds: list[float]
    faults: list[int]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.round_medians_ms)

    @property
    def mean_ms(self) -> float:
        return 1e3 * statistics.fmean(self.seconds)

    @property
    def p90_ms(self) -> float:
        return 1e3 * statistics.quantiles(self.seconds, n=10)[-1]

    @property
    def faults_per_call(self) -> float:
        return statistics.fmean(self.faults)

    @property
    def faulting_share(self) -> float:
        return sum(1 for f in self.faults if f) / len(self.faults)


@dataclass
class FaultResult:
    started: dt.datetime
    command: str
    rounds: int
    cells: dict[tuple[str, str, str], Cell]
    workers: dict[tuple[str, str], dict[str, object]]
    seconds: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]


def _worker_env(cpu: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CPU_", "MALLOC_"))}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cpu == "avx2-emulated":
        env.update(avx2_emulation_env())
    return env


def run_rounds(
    rounds: int, calls: int, cpus: Sequence[str], log: Callable[[str], None] | None = None
) -> FaultResult:
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    started = dt.datetime.now(dt.UTC)
    load_before = hostinfo.load_average()
    clock = time.perf_counter()
    cells: dict[tuple[str, str, str], Cell] = {}
    workers: dict[tuple[str, str], dict[str, object]] = {}
    for number in range(rounds):
        # alternate the order too, so neither allocator always runs first in a round
        order = ALLOCATORS if number % 2 == 0 else ALLOCATORS[::-1]
        for cpu in cpus:
            for allocator in order:
                command = [sys.executable, "-m", "benchmarks.core.page_faults", "--worker", allocator]
                command += ["--calls", str(calls)]
                output = subprocess.run(
                    command, env=_worker_env(cpu), capture_output=True, text=True, check=True, timeout=600
                ).stdout
                data = json.loads(output.strip().splitlines()[-1])
                workers[(cpu, allocator)] = data
                for name, values in data["scenarios"].items():
                    cell = cells.setdefault((cpu, allocator, name), Cell([], [], []))
                    cell.round_medians_ms.append(1e3 * statistics.median(values["seconds"]))
                    cell.seconds.extend(values["seconds"])
                    cell.faults.extend(values["faults"])
                say(f"round {number + 1}/{rounds} {cpu} {allocator}: done")
    return FaultResult(
        started,
        "",
        rounds,
        cells,
        workers,
        time.perf_counter() - clock,
        load_before,
        hostinfo.load_average(),
    )


def _verdict(default: Cell, tuned: Cell) -> str:
    change = tuned.median_ms / default.median_ms - 1
    if default.faults_per_call < 1:
        return f"no faults to remove ({100 * change:+.0f}%: noise)"
    if change <= -SIGNIFICANT:
        return f"tuned faster by {-100 * change:.0f}%"
    if change >= SIGNIFICANT:
        return f"tuned slower by {100 * change:.0f}%"
    return f"same within {100 * SIGNIFICANT:.0f}% ({100 * change:+.1f}%)"


def reading(result: FaultResult) -> list[str]:
    """What the data says, per CPU kind: which calls fault with glibc's defaults, and for those whether
    the tuning removed the faults and the time. A call that takes no fault either way cannot gain from
    the tuning, so a difference there is the machine's noise, not the allocator."""
    lines = []
    cpus = sorted({cpu for (cpu, _, _) in result.cells})
    names = list(dict.fromkeys(name for (_, _, name) in result.cells))
    paid: list[str] = []
    unpaid: list[str] = []
    for cpu in cpus:
        for name in names:
            default = result.cells.get((cpu, "default", name))
            tuned = result.cells.get((cpu, "tuned", name))
            if default is None or tuned is None:
                continue
            if default.faults_per_call < 1:
                continue
            change = tuned.median_ms / default.median_ms - 1
            text = (
                f"{cpu}, {name}: {default.faults_per_call:.0f} -> {tuned.faults_per_call:.0f} faults per "
                f"call, median {default.median_ms:.2f} -> {tuned.median_ms:.2f} ms ({100 * change:+.0f}%)"
            )
            (paid if change <= -SIGNIFICANT else unpaid).append(text)
    quiet = [
        f"{cpu}: {name}"
        for cpu in cpus
        for name in names
        if (cpu, "default", name) in result.cells and result.cells[(cpu, "default", name)].faults_per_call < 1
    ]
    lines.append("Faulting with glibc's defaults, and faster tuned: " + ("; ".join(paid) or "none") + ".")
    lines.append("Faulting with glibc's defaults, not faster tuned: " + ("; ".join(unpaid) or "none") + ".")
    lines.append(
        "Below one fault per call with glibc's defaults already (nothing for the tuning to remove): "
        + ("; ".join(quiet) or "none")
        + "."
    )
    return lines


def render_markdown(result: FaultResult) -> str:
    lines = [
        f"# Page faults of fresh allocations, {result.started:%Y-%m-%d %H:%M} UTC",
        "",
        f"Produced by `{result.command}` in {result.seconds:.0f} s: {result.rounds} alternating rounds, "
        "each variant in a fresh process, 1 thread. `default` is glibc's malloc as it comes; `tuned` is "
        f"`robez_core.allocator.tune_malloc()` ({MallocTuning()}).",
        "",
        "| | |",
        "|---|---|",
    ]
    info = hostinfo.machine_facts()
    info.pop("fused kernels compiled for", None)
    info.pop("torch kernels dispatched for", None)
    lines += [f"| {key} | {value} |" for key, value in info.items()]
    for (cpu, allocator), data in sorted(result.workers.items()):
        if allocator == "default":
            lines.append(f"| fused kernels compiled for ({cpu}) | {data['kernel target']} |")
            lines.append(f"| torch kernels dispatched for ({cpu}) | {data['torch']} |")
    lines.append(f"| glibc | {platform.libc_ver()[1] or 'not glibc'} |")
    load_before = " ".join(f"{v:.2f}" for v in result.load_before)
    load_after = " ".join(f"{v:.2f}" for v in result.load_after)
    lines.append(f"| load average (1/5/15 min) | before {load_before}, after {load_after} |")
    lines += ["", "## Reading", ""]
    lines += [f"- {line}" for line in reading(result)]
    for cpu in sorted({cpu for (cpu, _, _) in result.cells}):
        lines += [
            "",
            f"## {cpu}",
            "",
            "Median ms: median over rounds of each process's median call; mean and p90 over every call; "
            "faults: minor page faults per call (mean) and the share of calls that took any.",
            "",
            "| call | default median ms | tuned median ms | default mean / p90 ms | tuned mean / p90 ms "
            "| default faults/call | tuned faults/call | verdict |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name in dict.fromkeys(name for (c, _, name) in result.cells if c == cpu):
            default = result.cells[(cpu, "default", name)]
            tuned = result.cells[(cpu, "tuned", name)]
            lines.append(
                f"| {name} | {default.median_ms:.3f} | {tuned.median_ms:.3f} "
                f"| {default.mean_ms:.3f} / {default.p90_ms:.3f} | {tuned.mean_ms:.3f} / {tuned.p90_ms:.3f} "
                f"| {default.faults_per_call:.1f} ({100 * default.faulting_share:.0f}% of calls) "
                f"| {tuned.faults_per_call:.1f} ({100 * tuned.faulting_share:.0f}% of calls) "
                f"| {_verdict(default, tuned)} |"
            )
        rss = {a: result.workers[(cpu, a)]["max_rss_mib"] for a in ALLOCATORS if (cpu, a) in result.workers}
        lines += [
            "",
            "Peak resident memory of the last round's process: "
            + ", ".join(f"{a} {float(v):.0f} MiB" for a, v in rss.items())  # type: ignore[arg-type]
            + ".",
        ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core.page_faults", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per scenario and process")
    parser.add_argument(
        "--host-only", action="store_true", help="skip the emulated AVX2-only CPU (x86-64 only anyway)"
    )
    parser.add_argument("--no-report", action="store_true", help="print only, write no file")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--worker", choices=ALLOCATORS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.calls < 4:
        raise SystemExit("--rounds must be >= 1 and --calls >= 4")
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.calls)))
        return 0
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    cpus = CPU_KINDS if x86 and not args.host_only else CPU_KINDS[:1]
    result = run_rounds(args.rounds, args.calls, cpus)
    result.command = "python -m benchmarks.core.page_faults " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result.command = result.command.strip()
    text = render_markdown(result)
    print(text)
    if not args.no_report:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        path = args.output_dir / f"page-faults-{result.started:%Y-%m-%d}.md"
        path.write_text(text)
        print(f"report: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
