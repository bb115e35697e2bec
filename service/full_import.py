"""``robez import --compress-to M``: a trained full embedding table compressed into a served ROBE-Z table.

The checkpoint holds one full (n, d) table: a safetensors file, or a ``torch.save`` state_dict (read with
``weights_only=True``) such as ``nn.Embedding(n, d).state_dict()``. ``key`` names the tensor when the file
holds several 2-D tensors (e.g. ``"emb.weight"`` in a whole model's state_dict). The array is the
least-squares fit of ``robez_core.compress.least_squares_array`` (what ``RobezEmbedding.from_pretrained``
builds); the result is a ``Table`` the offline import writes at version 0.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Mapping

import torch
from safetensors.torch import load as load_safetensors

from robez_core.compress import least_squares_array
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import InvalidInputError
from robez_core.table import Table

from .wal import checkpoint_format

__all__ = ["compress_full_checkpoint", "read_full_table", "table_bytes"]


def read_full_table(data: bytes, key: str | None = None) -> torch.Tensor:
    """The (n, d) tensor of a full-table checkpoint; ``InvalidInputError`` when there is not exactly one."""
    tensors: Mapping[str, object]
    try:
        if checkpoint_format(data) == "paper":  # a torch.save file
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        else:
            tensors = load_safetensors(data)
    except Exception as error:  # each reader has its own error types; all mean "not a checkpoint"
        raise InvalidInputError(f"not a safetensors or torch.save(state_dict) file: {error}") from error
    if isinstance(tensors, torch.Tensor):
        tensors = {"weight": tensors}
    if not isinstance(tensors, Mapping):
        raise InvalidInputError("the file must hold a state_dict: a mapping of names to tensors")
    tables = {str(name): value for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    if key is not None:
        if key not in tables:
            raise InvalidInputError(f"no tensor {key!r} in the file; it has {sorted(tables)}")
        chosen = tables[key]
    else:
        matrices = {name: value for name, value in tables.items() if value.dim() == 2}
        if len(matrices) != 1:
            raise InvalidInputError(
                f"the file holds {len(matrices)} 2-D tensors ({sorted(matrices)}); name one with --key"
            )
        chosen = next(iter(matrices.values()))
    if chosen.dim() != 2 or not chosen.is_floating_point() or min(chosen.shape) < 1:
        raise InvalidInputError(f"a full table must be a non-empty 2-D float tensor, got {chosen.dtype} "
                                f"{tuple(chosen.shape)}")  # fmt: skip
    if not bool(torch.isfinite(chosen).all()):
        raise InvalidInputError("the full table holds NaN or infinite values")
    return chosen


def compress_full_checkpoint(
    data: bytes,
    memory_size: int,
    *,
    key: str | None = None,
    chunk_size: int = 32,
    val_offset: int = 0,
    optimizer: OptimizerConfig | None = None,
) -> Table:
    """A new ``Table`` of ``memory_size`` floats fitted to the full table in ``data``."""
    full = read_full_table(data, key)
    config = TableConfig(
        num_embeddings=int(full.shape[0]),
        embedding_dim=int(full.shape[1]),
        memory_size=memory_size,
        chunk_size=chunk_size,
        val_offset=val_offset,
    )
    array = least_squares_array(
        [full],
        memory_size,
        val_offsets=[val_offset],
        chunk_size=chunk_size,
        seed=config.seed,
        hash=config.hash,
        init_scale=config.init_scale,
    )
    return Table(config, optimizer, weight=array)


def table_bytes(table: Table) -> bytes:
    """The table as a robez checkpoint (``Table.save``'s safetensors bytes)."""
    with tempfile.TemporaryDirectory(prefix="robez-compress-") as folder:
        path = f"{folder}/table.safetensors"
        table.save(path)
        with open(path, "rb") as handle:
            return handle.read()
