#!/usr/bin/env bash
# The recipe for a lent 16-core machine (issue 31, part 1): the load test's CPU-scaling sweep,
# `python -m loadtest --cpus 1,2,4,8`, server workers pinned to cores 0..k-1 and the clients on the rest,
# for /healthz, single-id lookups (JSON and binary), binary 4096-id lookups, the update scenario and the
# 95/5 mix, each measured at every worker count (--features-every-count). CI never runs it (nor make test).
#
# Run from the repository root, with the wheels of what the machine lacks in .whl/ (see
# docs/loadtest/README.md, "On a lent 16-core machine"):
#     OUT=/some/empty/dir devtools/device_sweep.sh
# It installs .whl/*.whl into /tmp/site (never into the machine's Python), checks every import the server
# and the load test need (exit 3 naming what is missing), warms numba's cache once, then sweeps; the
# report (.md), its CSV, the plots and sweep.log land flat in $OUT (at most 6 files). Exit status: the
# load test's (0 all runs clean, 1 a run had unexpected errors), 2 for a bad setting, 3 for a missing import.
#
# Settings (environment):
#     OUT             where the files go (required)
#     PYTHON          the interpreter (default python3)
#     WHEELS          folder of wheels to install first (default .whl; "none": PYTHON's packages as they are)
#     SWEEP_CPUS      worker counts (default 1,2,4,8)
#     SWEEP_DURATION  seconds per run (default 6; 31 runs: see the estimate below)
#     SWEEP_QUICK=1   a short trial (--quick: 0.6 s runs, 0.3 s kernel baseline), for a dry run elsewhere
#     SWEEP_NAME      the machine's name in the report's file names (default device-<nproc>c)
#     SWEEP_SITE      where the wheels are installed (default /tmp/site)
#     SWEEP_LIMIT_S   the sweep's own time limit (default 420 s; SIGTERM stops its servers)
# Estimate at the defaults: 4 worker counts x 7 runs (/healthz, JSON 1, binary 1 and 4096, update 8 and
# 512 ids, mix of 512) + 3 at 1 worker (2 open-loop steps, /healthz with httpx) = 31 runs of 6 s (0.05 s
# between runs in the 2-core dry run), the kernel baseline (9 s there), a server and its clients started
# per count (3-7 s there): about 4 minutes, after ~30 s of wheels, imports and numba's first compilation
# (12 s there); SWEEP_LIMIT_S bounds it.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

if [ -z "${OUT:-}" ]; then
    echo "device_sweep.sh: set OUT to the folder the report goes to" >&2
    exit 2
fi
mkdir -p "$OUT"
exec > >(tee "$OUT/sweep.log") 2>&1

PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
CPUS="${SWEEP_CPUS:-1,2,4,8}"
DURATION="${SWEEP_DURATION:-6}"
LIMIT_S="${SWEEP_LIMIT_S:-420}"
NAME="${SWEEP_NAME:-device-$(nproc)c}"
SITE="${SWEEP_SITE:-/tmp/site}"
started=$(date +%s)
stamp() { echo "[$(($(date +%s) - started))s] $*"; }

# --- the packages the machine lacks -----------------------------------------------------------------
if [ "$WHEELS" != none ]; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "device_sweep.sh: no wheels in $WHEELS (carry .whl, or WHEELS=none)" >&2
        exit 3
    fi
    stamp "installing ${#wheels[@]} wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "${wheels[@]}" || { echo "device_sweep.sh: the wheels do not install for $PY" >&2; exit 3; }
    export PYTHONPATH="$SITE:$ROOT"
    packages="${#wheels[@]} wheels from $WHEELS installed into $SITE"
else
    export PYTHONPATH="$ROOT"
    packages="$PY's own packages"
fi
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/tmp/robez-numba-cache}"
mkdir -p "$NUMBA_CACHE_DIR"

# --- the machine, and every import the server and the load test make ---------------------------------
stamp "machine"
cpu_model=$( (lscpu 2>/dev/null || true) | sed -n 's/^Model name: *//p' | head -1)
memory_gib=$(awk '/^MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
echo "nproc $(nproc); CPU: ${cpu_model:-unknown}; ${memory_gib} GiB; kernel $(uname -r)"
(lscpu 2>/dev/null || true) | grep -E '^(Thread|Core|Socket|NUMA node|L2|L3)' || true
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
echo "GPU (unused by this sweep): ${gpu:-none}"
uptime
"$PY" - <<'PYCHECK' || exit 3
import importlib
import importlib.metadata
import platform
import sys

distributions = importlib.metadata.packages_distributions()


def version(name: str, module: object) -> str:
    found = getattr(module, "__version__", None)
    if found is None and distributions.get(name):
        found = importlib.metadata.version(distributions[name][0])
    return str(found or "?")


print("python", platform.python_version(), sys.executable)
missing = []
for name in (
    "torch", "numpy", "numba", "llvmlite", "safetensors", "fastapi", "starlette", "pydantic",
    "pydantic_core", "pydantic_settings", "uvicorn", "httptools", "uvloop", "orjson", "prometheus_client", "cryptography",
    "httpx", "anyio", "matplotlib", "typing_extensions",
):
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a package broken by another's version
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
        continue
    print(f"  {name:18} {version(name, module):12} {getattr(module, '__file__', '')}")
for name in ("service.app", "service.cli", "service.tls", "service.warmup", "loadtest.__main__", "loadtest.report"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("device_sweep.sh: MISSING imports, nothing measured:\n  " + "\n  ".join(missing), file=sys.stderr)
    sys.exit(3)
print("imports: all good")
PYCHECK

# --- numba's cache, once: the kernels compile here, not in the first server's start ------------------
stamp "warming numba's cache in $NUMBA_CACHE_DIR (python -m service.warmup, core 0)"
pin=()
if command -v taskset >/dev/null; then pin=(taskset -c 0); fi
"${pin[@]}" "$PY" -m service.warmup
stamp "warm"

# --- the sweep ---------------------------------------------------------------------------------------
args=(
    --cpus "$CPUS" --scenarios healthz,json,binary,update,mix --batch-sizes 1,4096 --features-every-count
    --open-loop 0.5,0.9 --max-requests 2000000 --no-profile --no-latest --out "$OUT"
    --machine-name "$NAME"
    --note "run by devtools/device_sweep.sh ($packages; numba's cache warmed before the sweep)"
    --note "CPU ${cpu_model:-unknown}, $(nproc) cores; GPU: ${gpu:-none} (idle during the sweep)"
)
if [ "${SWEEP_QUICK:-0}" = 1 ]; then
    args+=(--quick)
else
    args+=(--duration "$DURATION")
fi
stamp "python -m loadtest ${args[*]}"
status=0
timeout --signal=TERM --kill-after=30 "$LIMIT_S" "$PY" -m loadtest "${args[@]}" || status=$?
stamp "loadtest exit status $status"
uptime
ls -la "$OUT"
exit "$status"
