"""How much memory decoding a request body takes, per body shape, and what that bounds per worker.

Each case runs in a fresh process: build the body, reset the peak-RSS counter, decode it as the route
does (``codec.decode_update_json`` / ``decode_lookup_json`` + ``inputs()``), and report the peak RSS
above the process before decoding (the body itself excluded). JSON becomes one Python object per number
before it becomes a tensor, so it grows far more than binary, which is viewed in place.

    python -m benchmarks.service.body_memory [--sizes-mib 4,60]

Prints a Markdown table plus the bound it implies for one worker with the default settings: at most
``max_in_flight`` bodies held (each at most ``max_json_body_bytes`` for JSON) and at most
``COMPUTE_SLOTS`` (service/app.py) being decoded at once. Output goes to
docs/benchmarks/body-memory-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path

import numpy as np

from robez_core import hostinfo

MiB = 1 << 20
DIM = 64  # the demo table's embedding_dim
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _hwm_bytes() -> int:
    """Peak resident set size of this process (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _update_json(size: int, value: bytes) -> bytes:
    """An update of ``DIM``-wide rows of ``value``, about ``size`` bytes."""
    row = b"[" + b",".join([value] * DIM) + b"]"
    n = max(1, size // (len(row) + 3))
    return b'{"ids":[' + b",".join([b"0"] * n) + b'],"grads":[' + b",".join([row] * n) + b"]}"


def _lookup_json(size: int, value: bytes) -> bytes:
    n = max(1, size // (len(value) + 1))
    return b'{"ids":[' + b",".join([value] * n) + b"]}"


def _binary_update(size: int) -> bytes:
    n = max(1, size // (8 + 4 * DIM))
    return np.zeros(n, dtype="<i8").tobytes() + np.zeros((n, DIM), dtype="<f4").tobytes()


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in hostinfo.load_average())


# case name -> (body builder, decoder); the decoders are what the routes call.
def _cases() -> dict[str, tuple[Callable[[int], bytes], Callable[[bytes], object]]]:
    from service import codec

    def update(body: bytes) -> object:
        return codec.decode_update_json(body, DIM)

    def lookup(body: bytes) -> object:
        return codec.decode_lookup_json(body).inputs()

    def binary(body: bytes) -> object:
        return codec.decode_update_binary(body, f"{len(body) // (8 + 4 * DIM)},{DIM}")

    return {
        'update JSON, grads "0"': (lambda size: _update_json(size, b"0"), update),
        'update JSON, grads "0.5"': (lambda size: _update_json(size, b"0.5"), update),
        'update JSON, grads "-0.012345678"': (lambda size: _update_json(size, b"-0.012345678"), update),
        'lookup JSON, ids "0"': (lambda size: _lookup_json(size, b"0"), lookup),
        'lookup JSON, ids "1234567890123"': (lambda size: _lookup_json(size, b"1234567890123"), lookup),
        "update binary": (_binary_update, binary),
    }


def measure_one(case: str, size: int) -> dict[str, float]:
    """In this process: the peak RSS growth of decoding one body of ``case`` and about ``size`` bytes."""
    build, decode = _cases()[case]
    body = build(size)
    decode(build(1024))  # imports, kernels and allocator pools warmed outside the measurement
    before = _rss_bytes()
    _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
    decoded = decode(body)
    peak = _hwm_bytes()
    del decoded
    return {"body_bytes": len(body), "peak_bytes": peak - before}


def _measure_in_child(case: str, size: int) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.service.body_memory", "--one", case, "--size", str(size)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    figures: dict[str, float] = json.loads(result.stdout)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="4,60", help="body sizes (MiB), comma-separated")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.one, args.size)))
        return 0

    from service.app import COMPUTE_SLOTS
    from service.config import Settings

    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    sizes = [int(float(text) * MiB) for text in args.sizes_mib.split(",")]
    print(f"# Memory to decode one request body ({datetime.date.today().isoformat()})\n")
    cpus = hostinfo.logical_cpus()
    print(f"Machine: {platform.node()}, {hostinfo.cpu_model()}, {cpus} CPUs, {platform.machine()}.")
    print(
        f"Python {platform.python_version()}, pydantic {version('pydantic')}, pydantic-core "
        f"{version('pydantic-core')}, numpy {version('numpy')}; load average before: {_load()}."
    )
    print(f"Command: `python -m benchmarks.service.body_memory --sizes-mib {args.sizes_mib}`\n")
    print("| body | size (MiB) | peak extra RSS while decoding (MiB) | x body size |")
    print("|---|---:|---:|---:|")
    worst_json = 0.0
    for case in _cases():
        for size in sizes:
            figures = _measure_in_child(case, size)
            ratio = figures["peak_bytes"] / figures["body_bytes"]
            if "JSON" in case:
                worst_json = max(worst_json, ratio)
            body_mib, peak_mib = figures["body_bytes"] / MiB, figures["peak_bytes"] / MiB
            print(f"| {case} | {body_mib:.1f} | {peak_mib:.0f} | {ratio:.1f} |")
    held = settings.max_in_flight * settings.max_json_body_bytes
    decoding = COMPUTE_SLOTS * worst_json * settings.max_json_body_bytes
    print(f"\nLoad average after: {_load()} (other developers share this machine; memory, not time).")
    print(
        f"\nOne worker with the defaults holds at most max_in_flight={settings.max_in_flight} JSON bodies of "
        f"max_json_body_bytes={settings.max_json_body_bytes // MiB} MiB ({held / MiB:.0f} MiB) and decodes "
        f"compute_slots={COMPUTE_SLOTS} at once at up to {worst_json:.1f}x "
        f"({decoding / MiB:.0f} MiB): about {(held + decoding) / MiB:.0f} MiB for JSON bodies."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
