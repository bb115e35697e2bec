"""The gRPC hostile-client figures of docs/benchmarks/oip-transports-2026-11-27.md: the two attacks of
tests/service/test_grpc_limits.py (typed contents past max_ids_per_request; calls stalled mid-message)
against ``robez serve`` run from a checkout, RSS of the server's process tree in MiB.

    python benchmarks/service/grpc_hostile.py <checkout dir>
"""

import importlib
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tempfile

import grpc

# The tests' own attack helpers and server (imported at run time: the product's type check stays out of
# the tests).
_server = importlib.import_module("tests.service.subprocess_server")
_attacks = importlib.import_module("tests.service.test_grpc_limits")
RobezServer, free_port = _server.RobezServer, _server.free_port
INFER, MiB, _rss_mib, _stall, _typed_request = (
    _attacks.INFER,
    _attacks.MiB,
    _attacks._rss_mib,
    _attacks._stall,
    _attacks._typed_request,
)

tmp = Path(tempfile.mkdtemp(prefix="robez-hostile-"))
port = free_port()
env = {
    "ROBEZ_SHM_DIR": str(tmp / "shm"),
    "ROBEZ_MAX_BODY_BYTES": str(24 * MiB),
    "ROBEZ_MAX_BODY_BYTES_HELD": str(52 * MiB),
    "ROBEZ_BODY_TIMEOUT_S": "1.5",
    "ROBEZ_MAX_IDS_PER_REQUEST": str(1 << 16),
}
server = RobezServer(tmp / "server.log", ["--grpc-port", str(port)], env, cwd=Path(sys.argv[1]))
server.start()
pid = server.process.pid
address = f"127.0.0.1:{port}"
try:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(INFER)
        try:
            call(_typed_request(60_000), timeout=60)
        except grpc.RpcError as e:
            print("warm call", e.code())
        before = _rss_mib(pid)
        times = []
        msg = _typed_request(10_000_000)
        for _ in range(3):
            t = time.monotonic()
            try:
                call(msg, timeout=120)
            except grpc.RpcError as e:
                code = e.code()
            times.append(round(time.monotonic() - t, 2))
        time.sleep(1)
        print(
            f"typed 10M ids (20 MiB) x3: {code}, seconds {times}, RSS {before:.0f} -> {_rss_mib(pid):.0f} MiB"
        )
    before = _rss_mib(pid)
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak.append(_rss_mib(pid))

    th = threading.Thread(target=sample)
    th.start()
    accepted, closed = _stall(address, streams=8, declared=20 * MiB, send=16 * MiB, seconds=8)
    stop.set()
    th.join()
    time.sleep(1)
    print(
        f"8 stalled calls (20 MiB declared, 16 MiB sent): let in {accepted / MiB:.0f} MiB, "
        f"ended by server {closed}/8 within 8 s, "
        f"RSS {before:.0f} -> peak {max(peak):.0f} -> {_rss_mib(pid):.0f} MiB"
    )
finally:
    server.stop()
