"""What the benchmarks share: where reports go, the emulated AVX2-only CPU, the machine table.

The machine table (host, CPU, what the kernels were compiled for, versions...) is
:func:`robez_core.hostinfo.machine_facts`, the one reader of the machine's facts: ``loadtest``, which is
installed, prints it too, so it cannot live here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT_DIR = REPO / "docs" / "benchmarks"

# An AVX2-only CPU of the kind cloud fleets are full of (AMD Zen 2: AVX2, FMA, BMI2, no AVX-512).
EMULATED_AVX2_CPU = "znver2"
# Set in the environment of a benchmark re-run under the emulation (numba and torch read it at import).
EMULATION_MARK = "ROBEZ_BENCH_EMULATED"


def checkout_revision(source: Path) -> str:
    """``<short hash> <subject>`` of a checkout's HEAD (cut to 90 characters), or its path outside git: which
    code a row of a report ran."""
    found = subprocess.run(
        ["git", "-C", str(source), "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip()[:90] or str(source)


def append_report(out: Path, title: str, section: str) -> None:
    """Add ``section`` to the report ``out`` (created under the heading ``title`` if it is new): a
    benchmark run again the same day adds its run below the earlier ones."""
    if out.exists():
        out.write_text(out.read_text() + "\n" + section)
    else:
        out.write_text(f"# {title}\n\n" + section)
    print(section)
    print(f"written to {out}")


def avx2_emulation_env() -> dict[str, str]:
    """Environment that makes this process's compiled code target an AVX2-only CPU on a bigger host.

    numba compiles for ``NUMBA_CPU_NAME`` with exactly ``NUMBA_CPU_FEATURES`` (the host's features with
    every AVX-512, AVX10, AMX, AVX-VNNI and GFNI one switched off; its kernel cache is kept apart by CPU
    name and features), and torch, MKL and oneDNN are held to their AVX2 kernels, so the reference and
    ``nn.Embedding`` rows run what they would run on such a CPU too.
    """
    from llvmlite import binding

    features = []
    for item in binding.get_host_cpu_features().flatten().split(","):
        name = item[1:]
        disabled = name.startswith(("avx512", "avx10", "amx")) or name in ("avxvnni", "gfni")
        features.append("-" + name if disabled else item)
    return {
        "NUMBA_CPU_NAME": EMULATED_AVX2_CPU,
        "NUMBA_CPU_FEATURES": ",".join(features),
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        EMULATION_MARK: "avx2",
    }
