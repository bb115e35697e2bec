"""Building one DLRM step's push body in the client, two ways, alternating in one process (issue 37).

The push of ``benchmarks/training/dlrm.py`` (26 tables x ``--batch`` ids, d = 16, each table's gradients
a column slice of the (B, 26 * 16) output gradient): ``parts`` is ``update_many_calls`` as the client
builds it now (each table's ids and gradients gathered once into a part, the parts sent as they are);
``joined`` is how it was built before 2026-11-27 17:00 (each array copied contiguous, then to bytes,
sliced, concatenated per table and joined: the 3.8 MB body copied 3-4 times).

    flock /tmp/robez-bench.lock python -m benchmarks.training.push_body
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from service.client.calls import update_many_calls

FEATURES, DIM = 26, 16


def joined(updates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """The body as the client built it before: per table, ids and gradients to bytes, sliced, joined."""
    pieces = []
    for ids, grads in updates.values():
        ids_body = np.ascontiguousarray(ids.numpy(), dtype="<i8").tobytes()
        grads_body = np.ascontiguousarray(grads.numpy(), dtype="<f4").tobytes()
        n = len(ids)
        pieces.append(ids_body[: n * 8] + grads_body[: n * DIM * 4])
    return b"".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    grad_output = torch.randn(args.batch, FEATURES * DIM)
    updates = {
        f"t{f}": (torch.randint(0, 10**6, (args.batch,)), grad_output[:, f * DIM : (f + 1) * DIM])
        for f in range(FEATURES)
    }
    (call,) = update_many_calls(updates, None, "k", None)
    assert call.body() == joined(updates), "the two ways must give the same bytes"
    ways: dict[str, Callable[[], object]] = {
        "parts (now)": lambda: update_many_calls(updates, None, "k", None),
        "joined (before)": lambda: joined(updates),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for index in range(args.rounds):
        for name in ways if index % 2 == 0 else list(ways)[::-1]:
            start = time.perf_counter()
            ways[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"load average before / after: {load_before} / {os.getloadavg()}")
    parts = len(call.content or ())
    print(f"body {len(call.body()):,} bytes in {parts} parts; {args.rounds} rounds, alternated")
    for name, values in times.items():
        print(f"{name:>16}: median {statistics.median(values):.2f} ms, min {min(values):.2f} ms")


if __name__ == "__main__":
    main()
