"""``python -m loadtest``: measure the embedding server and write the report under ``docs/loadtest/``.

Examples::

    python -m loadtest                       # full sweep: --cpus 1..nproc, own servers, report + plots
    python -m loadtest --quick               # under a minute: fewer batch sizes, short runs
    python -m loadtest --url http://127.0.0.1:8000 --table demo --scenarios binary,json

Exit status: 0 when every run got only expected answers, 1 when any request failed (non-2xx,
transport error, malformed body) or a client crashed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from .scenarios import MAX_BATCH_SIZE, SCENARIOS
from .stats import ZipfSampler
from .sweep import Sweep, SweepConfig, python_command
from .transport import TRANSPORTS, loopback_target

QUICK_BATCH_SIZES = (1, 4096)
QUICK_DURATION_S = 0.6
QUICK_MAX_REQUESTS = 20_000
QUICK_OPEN_LOOP = (0.5, 1.1)
QUICK_KERNEL_SECONDS = 0.3


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _scenario_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    return names


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    cores = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load-test the robez server on loopback; write a markdown report, a CSV and plots.",
    )
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="test a running server (loopback only) instead of starting robez serve")
    target.add_argument(
        "--table", help="table to look up (default: the load test's own 'loadtest'; 'demo' with --url)"
    )
    target.add_argument("--tables", help="comma-separated tables for the multi-table scenario (with --url)")
    target.add_argument("--server-pid", type=int, help="with --url: pid of the server, to report its CPU use")
    target.add_argument(
        "--api-key", help="bearer key sent with every request (default: $ROBEZ_API_KEY, if set)"
    )
    target.add_argument(
        "--server-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for the started servers, e.g. ROBEZ_THREADS_PER_WORKER=1 (repeatable)",
    )  # fmt: skip
    sweep = parser.add_argument_group("what to measure")
    sweep.add_argument(
        "--cpus", type=_int_list, default=tuple(range(1, cores + 1)),
        help=f"worker counts to sweep, each pinned to that many cores (default: 1..{cores})",
    )  # fmt: skip
    sweep.add_argument(
        "--scenarios", type=_scenario_list, default=SCENARIOS, help=f"subset of {','.join(SCENARIOS)}"
    )
    sweep.add_argument(
        "--batch-sizes", type=_int_list,
        help=f"ids per binary lookup, 1..{MAX_BATCH_SIZE} (default: 1,64,512,4096,32768; quick: 1,4096)",
    )  # fmt: skip
    sweep.add_argument("--feature-batch", type=int, default=SweepConfig.feature_batch,
                       help="batch of the pooled / multi / update / mix / step runs")  # fmt: skip
    sweep.add_argument("--bag-size", type=int, default=SweepConfig.bag_size, help="ids per bag (pooled)")
    sweep.add_argument("--distribution", choices=("uniform", "zipf"), default="uniform")
    sweep.add_argument("--zipf-exponent", type=float, default=SweepConfig.zipf_exponent)
    sweep.add_argument(
        "--num-ids", type=int, default=SweepConfig.num_ids, help="ids are drawn from [0, num_ids)"
    )
    sweep.add_argument(
        "--features-every-count", action="store_true",
        help="run pooled / multi / update / mix / step against every worker count (default: the first only)",
    )  # fmt: skip
    sweep.add_argument(
        "--open-loop", type=_float_list, default=SweepConfig.open_loop_fractions, metavar="FRACTIONS",
        help="open-loop steps as fractions of the measured closed-loop capacity (default 0.25,...,1.1)",
    )  # fmt: skip
    load = parser.add_argument_group("load")
    load.add_argument("--duration", type=float, help=f"seconds per run (default {SweepConfig.duration_s:g})")
    load.add_argument(
        "--max-requests", type=int, help=f"requests per run (default {SweepConfig.max_requests})"
    )
    load.add_argument("--concurrency", type=int, default=SweepConfig.concurrency_per_worker,
                      help="closed-loop requests in flight per server worker")  # fmt: skip
    load.add_argument("--clients", type=int, help="client processes (default: one per core left to clients)")
    load.add_argument(
        "--transport", choices=TRANSPORTS, default="raw", help="HTTP client (see loadtest/transport.py)"
    )
    load.add_argument("--seed", type=int, default=0)
    output = parser.add_argument_group("output")
    output.add_argument(
        "--quick", action="store_true", help="a short run (< 1 min): batch 1 and 4096, short steps"
    )
    output.add_argument("--out", type=Path, default=Path("docs/loadtest"), help="report directory")
    output.add_argument("--no-latest", action="store_true", help="do not update latest.md")
    output.add_argument(
        "--machine-name", help="the machine's name in the report and its file names (default: the host name)"
    )
    output.add_argument(
        "--note", action="append", default=[], help="a line for the report's machine section (repeatable)"
    )
    output.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the py-spy profile of the server (never run by --quick)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """Validate the options into a ``SweepConfig``; raises ValueError with a readable message."""
    quick = bool(args.quick)
    batch_sizes: tuple[int, ...] = args.batch_sizes or (
        QUICK_BATCH_SIZES if quick else SweepConfig.batch_sizes
    )
    duration: float = args.duration or (QUICK_DURATION_S if quick else SweepConfig.duration_s)
    max_requests: int = args.max_requests or (QUICK_MAX_REQUESTS if quick else SweepConfig.max_requests)
    if args.url:
        loopback_target(args.url)
    for batch in batch_sizes:
        if not 1 <= batch <= MAX_BATCH_SIZE:
            raise ValueError(f"batch sizes must be in [1, {MAX_BATCH_SIZE}], got {batch}")
    if not 1 <= args.feature_batch <= MAX_BATCH_SIZE:
        raise ValueError(f"--feature-batch must be in [1, {MAX_BATCH_SIZE}]")
    if args.distribution == "zipf" and not 1 <= args.num_ids <= ZipfSampler.MAX_IDS:
        raise ValueError(f"--num-ids with zipf must be in [1, {ZipfSampler.MAX_IDS}]")
    if args.num_ids < 1 or args.bag_size < 1 or args.concurrency < 1:
        raise ValueError("--num-ids, --bag-size and --concurrency must be >= 1")
    if duration <= 0 or max_requests < 1:
        raise ValueError("--duration must be > 0 and --max-requests >= 1")
    if args.clients is not None and args.clients < 1:
        raise ValueError("--clients must be >= 1")
    if any(k < 1 for k in args.cpus):
        raise ValueError("--cpus values must be >= 1")
    if args.machine_name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", args.machine_name):
        raise ValueError("--machine-name names the report's files: letters, digits, '.', '_' and '-' only")
    if any(not f > 0 for f in args.open_loop):
        raise ValueError("--open-loop fractions must be > 0")
    api_key = args.api_key if args.api_key is not None else os.environ.get("ROBEZ_API_KEY") or None
    config = SweepConfig(
        url=args.url,
        table=args.table,
        multi_tables=tuple(t for t in args.tables.split(",") if t) if args.tables else None,
        cpus=args.cpus,
        scenarios=args.scenarios,
        batch_sizes=tuple(batch_sizes),
        feature_batch=args.feature_batch,
        duration_s=float(duration),
        max_requests=int(max_requests),
        concurrency_per_worker=args.concurrency,
        clients=args.clients,
        transport=args.transport,
        distribution=args.distribution,
        zipf_exponent=args.zipf_exponent,
        num_ids=args.num_ids,
        bag_size=args.bag_size,
        open_loop_fractions=args.open_loop,
        api_key=api_key,
        server_pid=args.server_pid,
        server_env=dict(args.server_env),
        seed=args.seed,
        quick=args.quick,
        profile=not (args.quick or args.no_profile),
        notes=tuple(args.note),
        features_every_count=args.features_every_count,
        machine_name=args.machine_name,
    )
    if args.quick:
        config = replace(config, open_loop_fractions=QUICK_OPEN_LOOP, kernel_seconds=QUICK_KERNEL_SECONDS)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    started = time.monotonic()
    # SIGTERM (timeout, CI cancel) unwinds like Ctrl-C, so started servers are stopped on the way out
    previous_handler = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return _run(config, args, started, sys.argv[1:] if argv is None else argv)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _run(config: SweepConfig, args: argparse.Namespace, started: float, argv: list[str]) -> int:
    from .report import floor_checks, target_checks, write_report  # matplotlib once the arguments are good

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", flush=True)

    result = Sweep(config, python_command(argv), progress).run()
    files = write_report(result, args.out, update_latest=not (args.no_latest or config.quick))
    for check in [*target_checks(result), *floor_checks(result)]:
        progress(f"target: {check.name}: {check.status} ({check.detail})")
    progress(f"report: {files.markdown}  csv: {files.csv}  plots: {', '.join(str(p) for p in files.plots)}")
    failed = result.failed_runs
    if failed:
        progress(
            f"FAILED: {len(failed)} run(s) had unexpected errors: " + ", ".join(r.spec.label for r in failed)
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
