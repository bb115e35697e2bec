"""The output-buffer pool: large outputs are reused only once nothing refers to them any more."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from robez_core import buffers, kernels
from robez_core.hashing import paper_random_numbers, reference_indices

ROWS = (buffers.MIN_POOLED_BYTES // 4 // 64 + 1, 64)  # float32 rows just above the pooling size


@pytest.fixture(autouse=True)
def _fresh_pool() -> Iterator[None]:
    previous = buffers.max_bytes()
    buffers.clear()
    buffers.set_max_bytes(buffers.DEFAULT_MAX_BYTES)
    try:
        yield
    finally:
        buffers.clear()
        buffers.set_max_bytes(previous)


def _pointer(array: np.ndarray | torch.Tensor) -> int:
    return array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data


def test_a_dropped_output_is_reused_and_a_held_one_is_not() -> None:
    first = kernels._empty(ROWS, np.float32)
    second = kernels._empty(ROWS, np.float32)
    assert _pointer(first) != _pointer(second)
    address = _pointer(first)
    del first
    third = kernels._empty(ROWS, np.float32)
    assert _pointer(third) == address
    assert buffers.pooled_bytes() == 2 * ROWS[0] * ROWS[1] * 4


@pytest.mark.parametrize(
    "keep",
    [
        lambda t: t[1:],  # a torch view
        lambda t: t.reshape(-1),
        lambda t: t.numpy(),  # a numpy view of the tensor
        lambda t: t.numpy()[::2],
        lambda t: t.untyped_storage(),
    ],
)
def test_any_view_keeps_the_buffer_out_of_the_pool(keep) -> None:
    tensor = kernels._empty(ROWS, np.float32)
    address = _pointer(tensor)
    view = keep(tensor)
    del tensor
    others = [kernels._empty(ROWS, np.float32) for _ in range(3)]
    assert address not in {_pointer(other) for other in others}
    del view, others
    assert _pointer(kernels._empty(ROWS, np.float32)) == address


def test_small_outputs_and_a_zero_limit_are_not_pooled() -> None:
    small = kernels._empty((10, 64), np.float32)
    assert small.numel() == 640 and buffers.pooled_bytes() == 0
    buffers.set_max_bytes(0)
    kernels._empty(ROWS, np.float32)
    assert buffers.pooled_bytes() == 0
    with pytest.raises(ValueError):
        buffers.set_max_bytes(-1)


def test_the_pool_stays_under_its_limit_and_makes_room_for_new_sizes() -> None:
    nbytes = ROWS[0] * ROWS[1] * 4
    buffers.set_max_bytes(2 * nbytes)
    held = [kernels._empty(ROWS, np.float32) for _ in range(4)]  # the last two are not pooled
    assert buffers.pooled_bytes() == 2 * nbytes
    del held
    bigger = (ROWS[0] * 2, ROWS[1])
    kept = kernels._empty(bigger, np.float32)  # evicts idle buffers of the old size to fit
    assert buffers.pooled_bytes() <= 2 * nbytes
    assert kept.shape == bigger
    buffers.set_max_bytes(0)  # idle buffers beyond the new limit are dropped; the held one stays
    del kept
    buffers.set_max_bytes(0)
    assert buffers.pooled_bytes() == 0


def test_other_dtypes_and_shapes_share_a_buffer_of_the_same_size() -> None:
    rows = kernels._empty(ROWS, np.float32)
    address = _pointer(rows)
    del rows
    ints = kernels._empty((ROWS[0] * ROWS[1] // 2,), np.int64)
    assert ints.dtype == torch.int64 and _pointer(ints) == address
    ints.fill_(7)
    assert bool((ints == 7).all())


def test_threads_never_hold_the_same_buffer() -> None:
    barrier = threading.Barrier(4)
    failures: list[str] = []

    def worker(label: int) -> None:
        for _ in range(20):
            mine = kernels._empty(ROWS, np.float32)
            mine.fill_(label)
            barrier.wait(timeout=30)  # everyone holds one now
            if not bool((mine == label).all()):
                failures.append(f"thread {label} saw another thread's writes")
            barrier.wait(timeout=30)
            del mine

    threads = [threading.Thread(target=worker, args=(label,)) for label in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures


def test_reused_buffers_give_exact_lookups_and_gathers() -> None:
    """Lookups into recycled memory (holding the previous batch's rows) are bit-exact."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(50_000, generator=generator)
    rn = paper_random_numbers()
    num_ids = ROWS[0]
    for round_ in range(3):
        ids = torch.randint(-(1 << 62), 1 << 62, (num_ids,), generator=generator)
        expected = weight[reference_indices(ids, 64, 16, 50_000, rn)]
        assert torch.equal(kernels.lookup(weight, ids, 64, 16, rn), expected), round_
        offsets = kernels.chunk_offsets(ids, 4, 16, 50_000, rn)
        assert torch.equal(kernels.gather(weight, offsets, 64, 16), expected), round_
    assert buffers.pooled_bytes() > 0


def test_pooled_dense_gradients_start_from_zero_every_step() -> None:
    """The dense (m,) gradient comes from the pool; a recycled one must hold this step's sum only."""
    from robez_core.modules import RobezEmbedding

    memory_size = buffers.MIN_POOLED_BYTES // 4 + 1000
    tables = {
        backend: RobezEmbedding(1000, 40, memory_size=memory_size, chunk_size=16, backend=backend)
        for backend in ("fused", "reference")
    }
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        pairs = torch.randint(0, 1000, (300, 2), generator=generator)
        output_grads = torch.randn(2, 300, 40, generator=generator)
        grads = {}
        for backend, table in tables.items():
            table.weight.grad = None
            rows = (table(pairs[:, 0]), table(pairs[:, 1]))
            torch.autograd.backward(rows, list(output_grads))
            grads[backend] = table.weight.grad
        torch.testing.assert_close(grads["fused"], grads["reference"], rtol=1e-5, atol=1e-5, msg=str(step))
    assert buffers.pooled_bytes() >= memory_size * 4
