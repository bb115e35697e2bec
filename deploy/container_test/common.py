"""What every part of the container test shares: the checkout, the time budget, failures, commands."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
