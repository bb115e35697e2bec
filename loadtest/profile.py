"""Sample the server's Python stacks with py-spy during a run and summarise where its time goes.

py-spy (``pip install py-spy``) is optional: without it, or where ptrace is not permitted, the report
says so and carries no profile. Profiled runs are extra runs: sampling costs CPU, so their throughput
is not used anywhere else in the report.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .launch import affinity

_LINE_NUMBER = re.compile(r":\d+\)$")
# Frames worth naming in the inclusive table: the service's own request path, the core, and the thread
# hand-off machinery; the start-up chain (cli, uvicorn.run) and pass-through middleware are in every stack.
_INTERESTING = (
    "service/routes/",
    "service/store",
    "service/codec",
    "service/metrics",
    "service/http",
    "service/auth",
    "robez_core/",
    "anyio/",
    "starlette/concurrency",
    "numba/",
)


def py_spy_path() -> str | None:
    """The py-spy executable next to this interpreter, else on PATH; None when not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


@dataclass(frozen=True)
class ProfileSummary:
    """Shares (0..1) of the sampled stacks: innermost frames (self) and frames anywhere (inclusive).

    Samples are of the thread holding the GIL, i.e. Python-level work; kernels running without the GIL
    and waits in C (epoll) are not in them.
    """

    label: str
    samples: int
    top_self: list[tuple[str, float]]
    top_inclusive: list[tuple[str, float]]
    error: str | None = None
    requests: int = 0


def summarise(collapsed: str, label: str, limit: int = 12) -> ProfileSummary:
    """Summarise py-spy's ``--format raw`` output (``frame;frame;... count`` per line).

    Frames are merged across line numbers (``f (file.py:12)`` and ``f (file.py:15)`` are one function).
    """
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_LINE_NUMBER.sub(")", frame) for frame in stack.split(";")[1:]]  # [0] names the process
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if total == 0:
        return ProfileSummary(label, 0, [], [], error="py-spy recorded no samples")
    top_self = [(frame, count / total) for frame, count in self_counts.most_common(limit)]
    interesting = [(f, c) for f, c in inclusive.most_common() if any(p in f for p in _INTERESTING)]
    top_inclusive = [(frame, count / total) for frame, count in interesting[:limit]]
    return ProfileSummary(label, total, top_self, top_inclusive)


class Profiler:
    """``py-spy record`` of a process tree for ``duration_s``; ``finish()`` returns the summary."""

    def __init__(self, pid: int, label: str, duration_s: float, cores: tuple[int, ...] | None) -> None:
        self.label = label
        executable = py_spy_path()
        self._output = Path(tempfile.mkstemp(prefix="robez-pyspy-", suffix=".txt")[1])
        self._process: subprocess.Popen[bytes] | None = None
        self._error: str | None = None
        if executable is None:
            self._error = "py-spy is not installed (pip install py-spy)"
            return
        # --gil: sample only the thread holding the GIL, so threads parked in waits are not counted
        command = [executable, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--gil"]
        command += ["--duration", str(max(1, round(duration_s))), "--rate", "250", "--format", "raw"]
        command += ["--output", str(self._output)]
        # on the clients' cores, so the sampler takes no CPU from the server it measures
        with affinity(cores):
            self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish(self, timeout_s: float = 60.0) -> ProfileSummary:
        try:
            if self._error is not None or self._process is None:
                return ProfileSummary(self.label, 0, [], [], error=self._error)
            try:
                _, stderr = self._process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.communicate()
                return ProfileSummary(self.label, 0, [], [], error="py-spy did not finish in time")
            if self._process.returncode != 0:
                message = stderr.decode(errors="replace").strip().splitlines()
                return ProfileSummary(self.label, 0, [], [], error=f"py-spy failed: {message[-1:] or '?'}")
            return summarise(self._output.read_text(errors="replace"), self.label)
        finally:
            self._output.unlink(missing_ok=True)
