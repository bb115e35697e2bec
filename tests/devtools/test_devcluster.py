"""``make cluster`` (devtools/devcluster.py) stops quietly on Ctrl-C: the terminal's SIGINT reaches the
whole foreground process group, so the NATS nodes must not be in it, or they die while the replicas
still use them and every replica logs its lost connections."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.launch import free_port

pytestmark = pytest.mark.slow


def test_ctrl_c_stops_the_replicas_before_the_nats_nodes(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
    env.update(ROBEZ_DEFAULT_TABLE="false", ROBEZ_LOG_FORMAT="text")
    command = [sys.executable, "-m", "devtools.devcluster", "--replicas", "1"]
    command += ["--port", str(free_port()), "--dir", str(tmp_path)]
    # its own process group, as a shell gives a foreground job: os.killpg is the terminal's Ctrl-C
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    output = b""
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 120
        while b"Ctrl-C stops everything" not in output:
            line = process.stdout.readline()
            assert line and time.monotonic() < deadline, output.decode(errors="replace")
            output += line
        os.killpg(process.pid, signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
        output += rest
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    warnings = [line for line in text.splitlines() if "WARNING" in line or "ERROR" in line]
    assert warnings == [], text
