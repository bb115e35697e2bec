"""What every part of the container test shares (and `make k8s-test`, which runs on the same engine state):
the checkout, the time budget, failures, commands, the run's start and its recorded summary."""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]


class Failure(Exception):
    """A check or a step failed; the message says which and why."""


class Deadline:
    """The whole run's time budget; every subprocess gets at most what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise Failure("the run's time budget (--timeout) is spent")
        return min(cap, remaining)


def log(message: str) -> None:
    print(f"[container-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(
    command: Sequence[str],
    deadline: Deadline,
    *,
    cap: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
    capture: bool = True,
    stdin: Any = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command with a timeout; on failure raise Failure with its output tail."""
    timeout = deadline.left(cap)
    try:
        result = subprocess.run(
            list(command),
            env=env,
            cwd=REPO,
            text=True,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        raise Failure(f"timed out after {timeout:.0f} s: {shlex.join(command)}") from error
    if check and result.returncode != 0:
        tail = (result.stdout or "")[-4000:]
        raise Failure(f"exit {result.returncode}: {shlex.join(command)}\n{tail}")
    return result


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def begin_run(tool: str, root_for: str, state: Path, timeout: float) -> tuple[Deadline, IO[str]] | None:
    """Start a run of ``tool`` on the engine state folder ``state``: it needs root (``root_for`` says
    why); SIGTERM (a CI cancel, ``timeout``) unwinds through the finally blocks like Ctrl-C does; the
    state folder's lock is held for the run (the container test and the k8s test share the folder).
    Returns the run's deadline and the held lock, or None (said on stderr) when it cannot start."""
    if os.geteuid() != 0:
        print(f"{tool} needs root ({root_for})", file=sys.stderr)
        return None
    deadline = Deadline(timeout)
    signal.signal(signal.SIGTERM, _interrupt)
    state.mkdir(parents=True, exist_ok=True)
    lock = (state / "lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        print(f"another container-test or k8s-test holds {state / 'lock'}", file=sys.stderr)
        return None
    return deadline, lock


def write_summary(lines: list[str], record: Path | None, begin: str, end: str) -> None:
    """Print the run's summary; with ``record``, also replace the block between the ``begin`` and ``end``
    markers of that file with it."""
    text = "\n".join(lines)
    print(text, flush=True)
    if record is None:
        return
    head, found_begin, rest = record.read_text().partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise Failure(f"{record} has no {begin} ... {end} block to replace")
    record.write_text(f"{head}{begin}\n```\n{text}\n```\n{end}{tail}")
    log(f"summary written to {record}")
