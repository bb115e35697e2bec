"""Python scripts run as forks of one process that imported robez already, instead of a fresh ``python -c``
each (~2 s of CPU for torch's and the service's imports): for tests whose script is a real process that
kill -9s itself at a fault point (a dying worker or pusher), or one that has run no kernel yet (what the
start-up's warm-up compiles). Each script still runs in its own process
(a fork, as ``robez serve``'s workers are forks of its fork server), with its own argv, environment,
stdout and stderr; what the helper process imported is all it shares with it.

The helper runs no kernel, so numba's OpenMP pool is not running when it forks (the pool starts at the
first kernel call, ``robez_core/kernels/runtime.py``: GNU OpenMP aborts a fork's first parallel region
once it runs in the parent); each script starts a pool of its own if it needs one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["ForkedPython", "Ran"]

# The helper: imports the modules the scripts use, then, for each request line (JSON), forks a child
# that runs the script and answers the child's pid, then its exit status (a negative signal number when
# killed).
_HELPER = """
import json, os, sys, traceback
import torch  # noqa: F401
import robez_core.table, service.config, service.faults, service.log.journal, service.shm  # noqa: F401
import service.store, service.wal  # noqa: F401

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.environ.update(request["env"])
            sys.argv = ["-c", *request["argv"]]
            exec(compile(request["script"], "<forked>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps(pid), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


class Ran:
    """What a forked script did: its exit status (``-signal.SIGKILL`` when it killed itself), stdout and
    stderr (``subprocess.CompletedProcess``'s names)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class ForkedPython:
    """The helper process (started on the first ``run``, stopped by ``close``); ``folder`` holds each
    script's output files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._process: subprocess.Popen[bytes] | None = None
        self._runs = 0

    def run(
        self, script: str, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0
    ) -> Ran:
        """Runs ``script`` (``python -c script *argv``, with ``env`` added to the helper's environment,
        which has no ``ROBEZ_`` variable) in a fork, and waits for it to end (at most ``timeout_s``: then
        it is killed and the test fails)."""
        if self._process is None:
            clean = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
            with (self.folder / "helper.err").open("w") as errors:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _HELPER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    env=clean,
                    bufsize=0,  # unbuffered: select() on the answers' pipe sees every line not read yet
                )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._runs += 1
        out, err = self.folder / f"run-{self._runs}.out", self.folder / f"run-{self._runs}.err"
        request = {"script": script, "argv": argv, "env": env or {}, "stdout": str(out), "stderr": str(err)}
        self._process.stdin.write(json.dumps(request).encode() + b"\n")
        self._process.stdin.flush()
        pid = self._answer()
        ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        status = self._answer()
        assert ready, f"the forked script ran past {timeout_s} s:\n{err.read_text()[-3000:]}"
        return Ran(status, out.read_text(), err.read_text())

    def _answer(self) -> int:
        assert self._process is not None and self._process.stdout is not None
        line = b""
        while not line.endswith(b"\n"):  # byte by byte: nothing read ahead of what select() watches
            byte = os.read(self._process.stdout.fileno(), 1)
            if not byte:
                break
            line += byte
        helper_log = (self.folder / "helper.err").read_text()[-3000:]
        assert line.endswith(b"\n"), f"the fork helper died:\n{helper_log}"
        return int(json.loads(line))

    def close(self) -> None:
        if self._process is None:
            return
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=30)
        self._process = None
