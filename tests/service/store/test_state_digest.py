"""The checksum's digest without a copy (service/log/state_digest.py): filled from the live table and
patched where updates touched it, it equals the digest of the state computed whole; any changed value
changes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.log import live_copy
from service.log.state_digest import StateDigest, digest_of_table, table_arrays


def _table(memory_size: int) -> Table:
    config = TableConfig(num_embeddings=10_000, embedding_dim=8, memory_size=memory_size, chunk_size=4)
    table = Table(config, OptimizerConfig.from_dict({"name": "adam", "lr": 0.1}))
    table.apply_gradients(torch.arange(500), torch.randn(500, 8, generator=torch.Generator().manual_seed(1)))
    return table


@pytest.mark.parametrize("memory_size", [1 << 14, (1 << 14) + 40])  # whole granules only; and a tail
@pytest.mark.parametrize("how", ["patch", "write"])
def test_a_digest_filled_then_patched_where_updates_touched_equals_the_whole_digest(
    memory_size: int, how: str
) -> None:
    table = _table(memory_size)
    digest = StateDigest(table)
    digest.fill(table, pause=lambda: None)
    assert digest.hexdigest() == digest_of_table(table)
    before = digest.hexdigest()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 10_000, (50,), generator=generator)
    # and an id one of whose chunks reaches the last granule (the tail, where there is one)
    every = torch.arange(10_000)
    reach = table.hash(every) + table.config.chunk_size - 1
    last = (-(-memory_size // live_copy.GRANULE) - 1) * live_copy.GRANULE
    ids = torch.cat([ids, every[(reach >= last).any(dim=1)][:1]])
    table.apply_gradients(ids, torch.randn(ids.numel(), 8, generator=generator))
    marks = live_copy.touched(table, [ids.numpy()])
    assert marks[-1] == 1 and marks.mean() < 0.5, marks.mean()  # the last granule, and not all of them
    if how == "patch":  # a lock-free round: the marked granules read again from the live table
        digest.patch(table, marks)
    else:  # the last round: the granules gathered under the lock, written after it
        digest.write(live_copy.gather(table, marks))
    assert digest.hexdigest() == digest_of_table(table) != before


def test_any_changed_value_changes_the_digest_and_a_copy_under_the_lock_gives_the_same() -> None:
    table = _table(4096 + 40)
    first = digest_of_table(table)
    for key in ("weight", "state.exp_avg", "state.step"):
        values = table_arrays(table)[key].reshape(-1)
        for index in {0, values.size // 2, values.size - 1}:
            kept = values[index].copy()
            values[index] = kept + np.ones(1, dtype=values.dtype)[0]
            assert digest_of_table(table) != first, (key, index)
            values[index] = kept
    assert digest_of_table(table) == first
    copied = StateDigest(table)
    copied.fill(table, pause=None)  # under the lock: a private copy, hashed afterwards
    assert copied.hexdigest() == first
