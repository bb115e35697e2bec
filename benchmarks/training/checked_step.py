"""The server's push step, checked then applied in two passes or in one (issue 37), alternating.

A push is refused when its step would leave a non-finite value, so the server used to run the step's
dry run (``kernels.adagrad_nonfinite``) and then the step (``kernels.adagrad_step``): two passes of
random reads over the touched locations of a 105 MB array and its 105 MB Adagrad state, which mostly
miss the TLB (4 KiB pages; the server's arrays are ``/dev/shm`` files, which get no huge pages here).
``kernels.checked_step`` reads each location once, writes it where every new value is finite and puts
the old values back if any is not. This times both on the same coalesced steps (26 tables x ``--batch``
Zipf ids, d = 16, Z = 32, as ``benchmarks/training/dlrm.py``), each way on its own copy of the arrays
(in a ``/dev/shm`` file as the server has them, and in torch's private memory), alternating which goes
first, and checks that both copies end with the same bits.

    flock /tmp/robez-bench.lock python -m benchmarks.training.checked_step
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from robez_core import kernels

from .array_memory import dlrm_steps, step_arguments

LR, EPS = 0.05, 1e-10


def _two_passes(
    weight: torch.Tensor, state: torch.Tensor, locations: torch.Tensor, values: torch.Tensor
) -> None:
    assert kernels.adagrad_nonfinite(weight, state, locations, values, LR, EPS) == 0
    kernels.adagrad_step(weight, state, locations, values, LR, EPS)


def _one_pass(
    weight: torch.Tensor, state: torch.Tensor, locations: torch.Tensor, values: torch.Tensor
) -> None:
    assert kernels.checked_step("adagrad", weight, [state], locations, values, (LR, EPS)) == 0


WAYS = {"two passes (check, then step)": _two_passes, "one pass (checked_step)": _one_pass}


def main() -> None:
    args = step_arguments(__doc__ or "")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    m = args.floats
    steps = dlrm_steps(m, args.batch, args.steps, grad_scale=0.01)
    times: dict[tuple[str, str], list[float]] = {}
    same_bits = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="robez-checked-step-") as shm_dir:
        for memory in ("/dev/shm file", "torch private"):
            copies = {}
            for way in WAYS:
                if memory == "torch private":
                    copies[way] = (torch.empty(m), torch.empty(m))
                    continue
                files = [os.path.join(shm_dir, f"{len(copies)}-{name}") for name in ("weight", "sum")]
                for file in files:
                    with open(file, "wb") as handle:
                        handle.truncate(m * 4)
                copies[way] = tuple(  # type: ignore[assignment]
                    torch.from_file(file, shared=True, size=m, dtype=torch.float32) for file in files
                )
            for weight, state in copies.values():
                weight.fill_(0.01)
                state.fill_(0.0)
            names = list(WAYS)
            for index in range(args.passes):
                for step_index, (locations, values) in enumerate(steps):
                    for way in names if (index + step_index) % 2 == 0 else names[::-1]:
                        start = time.perf_counter()
                        WAYS[way](*copies[way], locations, values)
                        if index:  # the first pass compiles and faults pages in
                            times.setdefault((memory, way), []).append((time.perf_counter() - start) * 1e3)
            (w1, s1), (w2, s2) = copies.values()
            same_bits[memory] = torch.equal(w1, w2) and torch.equal(s1, s2)
            del copies
    print(f"load average before / after: {load_before} / {os.getloadavg()}")
    print(f"array {m:,} floats; {steps[0][0].numel():,} locations a step; {args.passes - 1} timed passes")
    for (memory, way), ms in times.items():
        print(
            f"{memory:>14} | {way:>30}: median {statistics.median(ms):.2f} ms, "
            f"min {min(ms):.2f} ms ({len(ms)} steps)"
        )
    for memory, same in same_bits.items():
        print(f"{memory}: both ways end with the same bits: {same}")


if __name__ == "__main__":
    main()
