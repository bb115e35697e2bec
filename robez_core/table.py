"""``Table``: one ROBE-Z array with its config and optimizer state, and the paper's state_dict import.

This is what the service builds on. A table never reallocates the tensors it was given (they may live in
shared memory across worker processes); every update happens in place through the fused kernels.
Checkpoints (``save`` / ``load``) are safetensors files written and read by ``checkpoint.py``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch
from torch import Tensor

from . import kernels, optim
from .checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    STATE_PREFIX,
    CheckpointFile,
    CheckpointWriter,
    PendingCheckpoint,
)
from .config import OptimizerConfig, TableConfig
from .errors import ConfigError, CorruptionError, InvalidInputError
from .hashing import NUM_RANDOM_NUMBERS, paper_random_numbers, validate_random_numbers
from .init import init_weight
from .optim import PreparedStep
from .small import SMALL_BATCH_MAX_IDS, SmallPath, small_grads, small_ids

if TYPE_CHECKING:
    from .modules import RobezEmbedding

__all__ = ["Table", "import_paper_state_dict"]


class Table:
    """A ROBE-Z table: ``weight`` float32 (m,), its ``TableConfig``, optimizer config and state.

    Args:
        config: shape and hash of the table.
        optimizer: the server-side optimizer for :meth:`apply_gradients`; default ``OptimizerConfig()``
            (sgd, lr 0.01).
        weight: an existing float32 (m,) contiguous CPU array to use in place (e.g. in shared memory);
            None draws a new one U(-init_scale, init_scale) from ``torch.Generator`` seeded ``config.seed``.
        state: existing optimizer state tensors per :meth:`state_layout`, used in place; None makes fresh
            ones.

    Example::

        >>> config = TableConfig(1_000_000, 64, memory_size=1 << 20)
        >>> table = Table(config, OptimizerConfig("adagrad", lr=0.05))
        >>> ids = torch.tensor([7, 7, 42])
        >>> rows = table.lookup(ids)                       # (3, 64)
        >>> table.apply_gradients(ids, torch.ones(3, 64))  # duplicates summed, one Adagrad step
        >>> table.save("t.safetensors"); Table.load("t.safetensors")
    """

    def __init__(
        self,
        config: TableConfig,
        optimizer: OptimizerConfig | None = None,
        *,
        weight: Tensor | None = None,
        state: dict[str, Tensor] | None = None,
    ) -> None:
        self.config = config
        self.optimizer = optimizer if optimizer is not None else OptimizerConfig()
        if config.random_numbers is None:
            self.random_numbers = paper_random_numbers(config.seed)
        else:
            self.random_numbers = torch.tensor(config.random_numbers, dtype=torch.int64)
        memory_size = config.memory_size
        if weight is None:
            weight = init_weight(memory_size, config.init_scale, config.seed)
        elif (
            tuple(weight.shape) != (memory_size,)
            or weight.dtype != torch.float32
            or not weight.is_contiguous()
            or weight.device.type != "cpu"
        ):
            raise ConfigError(
                f"weight must be a contiguous float32 CPU tensor of shape ({memory_size},), "
                f"got {weight.dtype} {tuple(weight.shape)}"
            )
        if state is None:
            state = optim.init_state(self.optimizer, memory_size)
        else:
            optim.validate_state(self.optimizer, memory_size, state)
        self.weight: Tensor = weight.detach()
        self.state: dict[str, Tensor] = dict(state)
        self._small: SmallPath | None = None
        self._hash_spec: kernels.TableHash | None = None

    def _small_path(self) -> SmallPath:
        small = self._small
        if small is None or small.weight is not self.weight or small.state is not self.state:
            small = self._small = SmallPath(self)
        return small

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Table(num_embeddings={c.num_embeddings}, embedding_dim={c.embedding_dim}, "
            f"memory_size={c.memory_size}, chunk_size={c.chunk_size}, hash={c.hash!r}, "
            f"val_offset={c.val_offset}, optimizer={self.optimizer.name!r})"
        )

    @staticmethod
    def state_layout(
        optimizer: OptimizerConfig, memory_size: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of each optimizer state tensor (see ``optim.py``)."""
        return optim.state_layout(optimizer, memory_size)

    # ------------------------------------------------------------------ validation

    def validate_ids(self, ids: Tensor) -> None:
        """Raise ``InvalidInputError`` unless ``ids`` is a 1-D int64 CPU tensor (any int64 value is valid)."""
        if not isinstance(ids, Tensor):
            raise InvalidInputError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu":
            raise InvalidInputError(
                f"ids must be a 1-D int64 CPU tensor, got {ids.dtype} {tuple(ids.shape)} on {ids.device}"
            )
        if ids.layout != torch.strided:
            raise InvalidInputError(f"ids must be a dense tensor, got layout {ids.layout}")

    def validate_grads(self, ids: Tensor, grads: Tensor, *, finite: bool = True) -> None:
        """Raise ``InvalidInputError`` unless ``grads`` is finite float32 (len(ids), d) on the CPU.
        ``finite=False``: everything but the values (for a caller whose kernel checks them as it reads
        them: ``kernels.coalesce_table_pushes``)."""
        self.validate_ids(ids)
        self._validate_grad_rows(grads, ids.shape[0], finite)

    def _validate_grad_rows(self, grads: Tensor, num_rows: int, finite: bool = True) -> None:
        d = self.config.embedding_dim
        if not isinstance(grads, Tensor):
            raise InvalidInputError(f"grads must be a torch.Tensor, got {type(grads).__name__}")
        if grads.dtype != torch.float32 or tuple(grads.shape) != (num_rows, d) or grads.device.type != "cpu":
            raise InvalidInputError(
                f"grads must be a float32 CPU tensor of shape ({num_rows}, {d}), "
                f"got {grads.dtype} {tuple(grads.shape)}"
            )
        # A sparse gradient would fail below with torch's or numpy's own error (TypeError and others);
        # callers with one densify it (grads.to_dense()).
        if grads.layout != torch.strided:
            raise InvalidInputError(f"grads must be a dense tensor, got layout {grads.layout}")
        # numpy's check costs ~1 us on a small batch, torch's ~6 us; on a (2048, 16) batch 12 us, torch's
        # 80 us (a collection's push checks 26 of them: docs/benchmarks/dlrm-*.md)
        if finite and not bool(np.isfinite(grads.detach().numpy()).all()):
            raise InvalidInputError("grads contain NaN or Inf")

    def _validate_offsets(self, offsets: Tensor) -> None:
        c = self.config
        if (
            not isinstance(offsets, Tensor)
            or offsets.dtype != torch.int64
            or offsets.dim() != 2
            or offsets.layout != torch.strided
        ):
            raise InvalidInputError("offsets must be a dense 2-D int64 tensor of chunk offsets")
        if offsets.shape[1] != c.num_chunks or offsets.device.type != "cpu":
            raise InvalidInputError(
                f"offsets must have shape (N, {c.num_chunks}), got {tuple(offsets.shape)}"
            )
        # Offsets outside the array would read or write out of bounds in the kernels.
        if offsets.shape[0] <= SMALL_BATCH_MAX_IDS:  # numpy's reductions cost far less on a few values
            values = offsets.numpy()
            out_of_bounds = values.size > 0 and (
                int(values.min()) < 0 or int(values.max()) > c.memory_size - c.chunk_size
            )
        else:
            out_of_bounds = offsets.numel() > 0 and (
                int(offsets.min()) < 0 or int(offsets.max()) > c.memory_size - c.chunk_size
            )
        if out_of_bounds:
            raise InvalidInputError(f"offsets must lie in [0, {c.memory_size - c.chunk_size}]")

    @staticmethod
    def _validate_lr(lr: float | None) -> None:
        if lr is not None and not (isinstance(lr, int | float) and lr > 0 and math.isfinite(lr)):
            raise InvalidInputError(f"lr must be a positive finite number, got {lr!r}")

    # ------------------------------------------------------------------ reads

    def hash(self, ids: Tensor) -> Tensor:
        """Chunk offsets of ``ids`` int64 (N,): int64 (N, C) in ``[0, m - Z]``."""
        ids_np = small_ids(ids)
        if ids_np is not None:
            return torch.from_numpy(self._small_path().hash(ids_np))
        self.validate_ids(ids)
        c = self.config
        return kernels.chunk_offsets(
            ids.contiguous(),
            c.num_chunks,
            c.chunk_size,
            c.memory_size,
            self.random_numbers,
            c.val_offset,
            c.hash,
        )

    def hash_spec(self) -> kernels.TableHash:
        """How ``hash`` hashes this table's ids, for a kernel that hashes several tables in one call
        (``kernels.coalesce_table_pushes``); worked out once (the config and constants do not change)."""
        spec = self._hash_spec
        if spec is None:
            c = self.config
            spec = self._hash_spec = kernels.TableHash.of(
                c.hash, self.random_numbers, c.memory_size, c.chunk_size, c.embedding_dim, c.val_offset
            )
        return spec

    def gather(self, offsets: Tensor) -> Tensor:
        """Rows at chunk ``offsets`` int64 (N, C): float32 (N, d)."""
        self._validate_offsets(offsets)
        if offsets.shape[0] <= SMALL_BATCH_MAX_IDS:
            return torch.from_numpy(self._small_path().gather(offsets.contiguous().numpy()))
        return kernels.gather(
            self.weight, offsets.contiguous(), self.config.embedding_dim, self.config.chunk_size
        )

    def lookup(self, ids: Tensor) -> Tensor:
        """Rows of ``ids`` int64 (N,): float32 (N, d), hashing fused with the gather."""
        ids_np = small_ids(ids)
        if ids_np is not None:
            return torch.from_numpy(self._small_path().lookup(ids_np))
        self.validate_ids(ids)
        c = self.config
        return kernels.lookup(
            self.weight,
            ids.contiguous(),
            c.embedding_dim,
            c.chunk_size,
            self.random_numbers,
            c.val_offset,
            c.hash,
        )

    @overload
    def lookup_timed(self, ids: Tensor) -> tuple[Tensor, float, float]: ...

    @overload
    def lookup_timed(self, ids: np.ndarray) -> tuple[np.ndarray, float, float]: ...

    def lookup_timed(self, ids: Tensor | np.ndarray) -> tuple[Tensor | np.ndarray, float, float]:
        """``lookup`` in two timed steps: (rows, seconds hashing, seconds gathering). The service reports
        both stages (``Server-Timing``); the offsets come from this table's own hash, so unlike ``gather``
        they are not checked again. ``ids`` may be a numpy int64 (N,) array, and the rows are then one
        too: the service decodes ids to and encodes rows from numpy, and a small lookup then makes no
        tensor at all (each costs microseconds of a request)."""
        ids_np = small_ids(ids, arrays=True)
        if ids_np is not None:
            small = self._small_path()
            start = time.perf_counter()
            offsets_np = small.hash(ids_np)
            hashed = time.perf_counter()
            rows_np = small.gather(offsets_np)
            gathered = time.perf_counter()
            rows: Tensor | np.ndarray = rows_np if type(ids) is np.ndarray else torch.from_numpy(rows_np)
            return rows, hashed - start, gathered - hashed
        as_array = isinstance(ids, np.ndarray)
        if isinstance(ids, np.ndarray):
            if ids.dtype != np.int64 or ids.ndim != 1:
                raise InvalidInputError(f"ids must be a 1-D int64 array, got {ids.dtype} {ids.shape}")
            ids = torch.from_numpy(ids)
        start = time.perf_counter()
        offsets = self.hash(ids)  # checks ids
        hashed = time.perf_counter()
        c = self.config
        gathered_rows = kernels.gather(self.weight, offsets, c.embedding_dim, c.chunk_size)
        gathered = time.perf_counter()
        return (gathered_rows.numpy() if as_array else gathered_rows), hashed - start, gathered - hashed

    def lookup_bag(
        self,
        ids: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        mode: str = "sum",
    ) -> Tensor:
        """Pooled rows float32 (B, d) of ``ids`` int64 (N,) in bags starting at ``offsets`` int64 (B,).

        As ``torch.nn.functional.embedding_bag``: bag b is ``ids[offsets[b]:offsets[b+1]]`` (the last runs
        to N); ``mode`` ``"sum"`` or ``"mean"``; ``per_sample_weights`` float32 (N,) with ``"sum"`` only.
        """
        self.validate_ids(ids)
        if mode not in ("sum", "mean"):
            raise InvalidInputError(f"mode must be 'sum' or 'mean', got {mode!r}")
        if not isinstance(offsets, Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
            raise InvalidInputError("bag offsets must be a 1-D int64 tensor")
        if per_sample_weights is not None and (
            per_sample_weights.dtype != torch.float32 or tuple(per_sample_weights.shape) != tuple(ids.shape)
        ):
            raise InvalidInputError("per_sample_weights must be float32 with the shape of ids")
        c = self.config
        return kernels.lookup_bag(
            self.weight,
            ids.contiguous(),
            offsets.contiguous(),
            per_sample_weights,
            mode,  # type: ignore[arg-type]
            c.embedding_dim,
            c.chunk_size,
            self.random_numbers,
            c.val_offset,
            c.hash,
        )

    # ------------------------------------------------------------------ updates

    def apply_gradients(self, ids: Tensor, grads: Tensor, lr: float | None = None) -> None:
        """One fused optimizer step from output-row gradients ``grads`` float32 (N, d) of ``ids`` (N,).

        Gradients of duplicate ids (and of ids whose blocks overlap) are summed first; only the hashed
        locations change. ``lr`` overrides the optimizer's. Invalid input raises ``InvalidInputError``
        before anything changes.
        """
        ids_np = small_ids(ids)
        grads_np = None if ids_np is None else self._small_update_grads(grads, ids_np.shape[0], lr)
        if ids_np is not None and grads_np is not None:
            small = self._small_path()
            small.apply(small.hash(ids_np), grads_np, self.optimizer.lr if lr is None else lr)
            return
        self.validate_grads(ids, grads)
        self._validate_lr(lr)
        self._apply(self.hash(ids), grads, lr)

    def _small_update_grads(self, grads: object, num_rows: int, lr: float | None) -> np.ndarray | None:
        """The numpy view of a small update's grads when they and lr pass every check of the general path
        (which, when this is None, runs the checks again and raises the error)."""
        grads_np = small_grads(grads, num_rows, self.config.embedding_dim)
        if (
            grads_np is None
            or not np.isfinite(grads_np).all()
            or not (lr is None or (type(lr) is float and lr > 0 and math.isfinite(lr)))
        ):
            return None
        return grads_np

    def try_checked_update(
        self, ids: Tensor | np.ndarray, grads: Tensor | np.ndarray, lr: float
    ) -> tuple[float, float] | None:
        """``hash`` + ``prepare_step`` + ``check_step`` + ``apply_step`` of a small batch in two compiled
        calls (the hash, then the rest): (seconds hashing, seconds coalescing, checking and stepping) once
        applied. None, having changed nothing, when the general path must take the update: not a small
        batch, an input or a step it refuses (it then raises the error), or an lr over ``max_lr``. The
        caller holds the lock that ``check_step`` and ``apply_step`` need, and has checked that ``lr`` is
        positive and finite. ``ids`` and ``grads`` may be numpy arrays (int64 (N,), C-contiguous float32
        (N, d)): the service's, which then makes no tensor. Bit-identical to the three-part path
        (tests/core/test_table.py)."""
        ids_np = small_ids(ids, arrays=True)
        if ids_np is None or lr > self.optimizer.max_lr:
            return None
        grads_np = small_grads(grads, ids_np.shape[0], self.config.embedding_dim, arrays=True)
        if grads_np is None:
            return None
        small = self._small_path()
        start = time.perf_counter()
        offsets_np = small.hash(ids_np)
        hashed = time.perf_counter()
        # A non-finite gradient makes a coalesced value non-finite: the dry run refuses it.
        if not small.checked_step(offsets_np, grads_np, lr):
            return None
        return hashed - start, time.perf_counter() - hashed

    def apply_gradients_at(self, offsets: Tensor, grads: Tensor, lr: float | None = None) -> None:
        """As :meth:`apply_gradients` with ids already hashed to chunk ``offsets`` int64 (N, C)."""
        self._validate_offsets(offsets)
        num_rows = offsets.shape[0]
        grads_np = (
            self._small_update_grads(grads, num_rows, lr) if 1 <= num_rows <= SMALL_BATCH_MAX_IDS else None
        )
        if grads_np is not None:
            small = self._small_path()
            offsets_np = offsets.contiguous().numpy()
            small.apply(offsets_np, grads_np, self.optimizer.lr if lr is None else lr)
            return
        self._validate_grad_rows(grads, num_rows)
        self._validate_lr(lr)
        self._apply(offsets.contiguous(), grads, lr)

    def _apply(self, offsets: Tensor, grads: Tensor, lr: float | None) -> None:
        optim.fused_update(
            self.optimizer, self.weight, self.state, offsets, grads.contiguous(), self.config.chunk_size, lr
        )

    # The same step as ``apply_gradients_at`` in three parts, for a caller that must refuse an update
    # before it is logged (the service): ``prepare_step`` reads only the config (no lock needed),
    # ``check_step`` reads the array, ``apply_step`` writes it. prepare + apply == apply_gradients_at.

    def prepare_step(
        self, offsets: Tensor, grads: Tensor, lr: float | None = None, *, offsets_from_hash: bool = False
    ) -> PreparedStep:
        """Validate and coalesce an update of chunk ``offsets`` (N, C) with ``grads`` (N, d); ``lr`` must
        be at most ``optimizer.max_lr``. Changes nothing. ``offsets_from_hash``: ``offsets`` are what this
        table's own ``hash`` returned, so their bounds are not checked again."""
        if not offsets_from_hash:
            self._validate_offsets(offsets)
        self._validate_grad_rows(grads, offsets.shape[0])
        self._validate_lr(lr)
        step_lr = self.optimizer.lr if lr is None else float(lr)
        if step_lr > self.optimizer.max_lr:
            raise InvalidInputError(
                f"lr {step_lr:g} is over this table's max_lr={self.optimizer.max_lr:g} (its optimizer config)"
            )
        if offsets.shape[0] <= SMALL_BATCH_MAX_IDS:  # the same sums, without the general path's set-up
            small = self._small_path()
            grads_np = grads.detach().contiguous().numpy()
            locations_np, values_np = small.coalesce(offsets.contiguous().numpy(), grads_np)
            return PreparedStep(torch.from_numpy(locations_np), torch.from_numpy(values_np), step_lr, small)
        locations, values = kernels.coalesce_grad(
            grads.contiguous(), offsets.contiguous(), self.config.chunk_size, self.config.memory_size
        )
        return PreparedStep(locations, values, step_lr)

    def check_step(self, step: PreparedStep) -> None:
        """Raise ``InvalidInputError`` if ``apply_step(step)``, now, would leave any array value or optimizer
        state non-finite (lr x gradient overflowing float32, say). Reads the K touched locations only; call
        it under the same lock as ``apply_step`` so that nothing changes in between."""
        small = self._small_step_path(step)
        if small is not None:
            bad = optim.small_nonfinite(self.optimizer, *small.step_arrays(step))
        else:
            bad = optim.count_nonfinite(
                self.optimizer, self.weight, self.state, step.locations, step.values, step.lr
            )
        if bad:
            raise _non_finite_step(bad, step)

    def apply_step(self, step: PreparedStep) -> None:
        """Apply a step from ``prepare_step`` of this table (its config), in place."""
        small = self._small_step_path(step)
        if small is not None:
            optim.small_step(self.optimizer, *small.step_arrays(step))
            return
        optim.apply_coalesced(self.optimizer, self.weight, self.state, step.locations, step.values, step.lr)

    def apply_checked_step(self, step: PreparedStep) -> None:
        """``check_step`` and ``apply_step`` with one read of each touched location instead of two
        (``optim.apply_coalesced_checked``; the same bits): refused, with ``check_step``'s error and
        every value as it was, when the step would leave one non-finite. A reader that does not hold the
        update lock may meanwhile see finite values of a step that ends refused."""
        if self._small_step_path(step) is not None:  # a small step's two calls read a few rows
            self.check_step(step)
            self.apply_step(step)
            return
        bad = optim.apply_coalesced_checked(
            self.optimizer, self.weight, self.state, step.locations, step.values, step.lr
        )
        if bad:
            raise _non_finite_step(bad, step)

    def _small_step_path(self, step: PreparedStep) -> SmallPath | None:
        """The small path a step was prepared on, if it is still this table's (same tensors)."""
        if step.small is None:
            return None
        small = self._small_path()
        return small if step.small is small else None

    # ------------------------------------------------------------------ checkpoints

    def tensors(self) -> dict[str, Tensor]:
        """Everything a checkpoint stores: ``{"weight": (m,), "state.<name>": ...}`` (the live tensors)."""
        out = {"weight": self.weight}
        out.update({STATE_PREFIX + name: tensor for name, tensor in self.state.items()})
        return out

    def metadata(self) -> dict[str, str]:
        """Checkpoint header metadata: format, version, config, constants, optimizer (JSON strings)."""
        return {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "config": json.dumps(self.config.to_dict(), sort_keys=True),
            "random_numbers": json.dumps(self.random_numbers.tolist()),
            "optimizer": json.dumps(self.optimizer.to_dict(), sort_keys=True),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a safetensors checkpoint atomically: temp file, fsync, rename over ``path``, fsync the dir.

        A crash leaves either the old file or the new one, never a torn one; write failures raise
        ``OSError`` and leave no temp file. The caller keeps the table from changing during the save
        (the service holds the table's update lock). Streamed: the tensors' memory is written to the file
        as it is, no copy of the table is made (``begin_save`` + ``PendingCheckpoint.finish``).
        """
        self.begin_save(path).finish()

    def begin_save(self, path: str | os.PathLike[str]) -> PendingCheckpoint:
        """The part of ``save`` that reads the table: its tensors written as they are to a temp file beside
        ``path`` (the header's checksums left blank). Only this call needs the table unchanged (the service
        holds the update lock for it alone); ``finish()`` on the result computes the checksums from the
        file, completes the header and moves it into place, ``discard()`` removes it. Raises ``OSError``
        (no temp file left)."""
        return PendingCheckpoint.write(Path(path), self.tensors(), self.metadata())

    def begin_write(self, fd: int) -> CheckpointWriter:
        """``begin_save`` into a file the caller opened (empty, read-write) and names, renames or unlinks
        itself: the tensors written as they are, the header's checksums blank; ``finish(fd)`` on the
        result completes the file in place. Only this call needs the table unchanged. Raises ``OSError``
        (the caller removes the file)."""
        return CheckpointWriter.write(fd, self.tensors(), self.metadata())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Table:
        """Read a checkpoint written by :meth:`save` (or any safetensors file of the same tensors and
        metadata): a bitwise-identical table, read from the file piece by piece into its own memory.

        Raises ``NotFoundError`` when ``path`` does not exist and ``CorruptionError`` when it is not a valid
        robez checkpoint (unreadable header, wrong format or version, bad config, missing/extra/misshapen
        tensors, checksum mismatch).
        """
        checkpoint = CheckpointFile.open(path)
        tensors = {
            name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in checkpoint.layout.items()
        }
        checkpoint.read_into(tensors)
        state = {name[len(STATE_PREFIX) :]: t for name, t in tensors.items() if name != "weight"}
        return cls(checkpoint.config, checkpoint.optimizer, weight=tensors["weight"], state=state)

    # ------------------------------------------------------------------ modules

    @classmethod
    def from_module(cls, module: Any, optimizer: OptimizerConfig | None = None) -> Table:
        """A table over the same array as a ``RobezEmbedding(Bag)`` (shared, not copied)."""
        config = module.config
        random_numbers = tuple(module.random_numbers.tolist())
        if (
            config.random_numbers is None
            and list(random_numbers) == paper_random_numbers(config.seed).tolist()
        ):
            rn_config: tuple[int, ...] | None = None
        else:
            rn_config = random_numbers
        config = TableConfig.from_dict({**config.to_dict(), "random_numbers": rn_config})
        return cls(config, optimizer, weight=module.weight.data)

    def to_module(self, *, sparse: bool = False, backend: str = "fused") -> RobezEmbedding:
        """A ``RobezEmbedding`` whose ``weight`` Parameter shares this table's array."""
        from .modules import RobezEmbedding

        c = self.config
        return RobezEmbedding(
            c.num_embeddings,
            c.embedding_dim,
            weight=self.weight,
            chunk_size=c.chunk_size,
            seed=c.seed,
            val_offset=c.val_offset,
            hash=c.hash,
            sparse=sparse,
            backend=backend,  # type: ignore[arg-type]
            init_scale=c.init_scale,
            random_numbers=c.random_numbers,
        )


# ---------------------------------------------------------------------- the paper's state_dict

_PAPER_KEYS = ("weight", "random_numbers", "helper_Eidx_base", "helper_Eidx_offset", "helper_E1sR")


def _infer_chunk_size(embedding_dim: int, eidx_offset: list[int], chunk_size: int | None) -> int:
    """Z from ``helper_Eidx_offset`` = ``[j % Z for j < d]``.

    When d > Z the offsets wrap to 0 at j = Z, which pins Z down. When d <= Z they are just 0..d-1 and
    every Z >= d fits, yet Z still enters the hash (its range is m - Z + 1): the caller must say.
    """
    wraps = [j for j in range(1, embedding_dim) if eidx_offset[j] == 0]
    if wraps:
        inferred = wraps[0]
        if chunk_size is not None and chunk_size != inferred:
            raise ConfigError(
                f"chunk_size={chunk_size} disagrees with the state_dict's helpers (Z = {inferred})"
            )
        return inferred
    if chunk_size is None:
        raise ConfigError(
            f"the state_dict cannot tell chunk_size: embedding_dim ({embedding_dim}) is at most one chunk, "
            "so any chunk_size >= embedding_dim fits its helpers; pass chunk_size= (the paper's "
            "robez_chunk_size)"
        )
    if chunk_size < embedding_dim:
        raise ConfigError(
            f"chunk_size={chunk_size} disagrees with the state_dict's helpers (Z >= {embedding_dim})"
        )
    return chunk_size


def import_paper_state_dict(
    state_dict: Mapping[str, Tensor],
    *,
    num_embeddings: int | None = None,
    chunk_size: int | None = None,
    val_offset: int = 0,
    optimizer: OptimizerConfig | None = None,
) -> Table:
    """A ``Table`` reading exactly the rows of the paper's ``RobezEmbedding`` with this ``state_dict``.

    The paper's module stores ``weight`` float32 (m,), ``random_numbers`` int64 (11,) = P then ten draws,
    and int64 (d,) helpers ``helper_Eidx_base`` (j // Z), ``helper_Eidx_offset`` (j % Z) and
    ``helper_E1sR`` (R[3] repeated). The hash constants come from ``random_numbers`` (never re-derived
    from a seed); d comes from the helpers; Z from ``helper_Eidx_offset`` when d > Z, otherwise from
    ``chunk_size`` (required then). ``num_embeddings`` and ``val_offset`` are module attributes the
    state_dict does not hold: pass them (``num_embeddings`` defaults to m, which only affects reporting).
    A missing key raises ``ConfigError``; tensors that contradict each other raise ``CorruptionError``.
    """
    missing = [key for key in _PAPER_KEYS if key not in state_dict]
    if missing:
        raise ConfigError(
            f"not a paper ROBE-Z state_dict: missing {missing} (expected keys {list(_PAPER_KEYS)})"
        )
    weight = state_dict["weight"].detach()
    base, offset, e1sr = (state_dict[k].detach() for k in _PAPER_KEYS[2:])
    if weight.dim() != 1 or weight.dtype != torch.float32 or weight.numel() == 0:
        raise CorruptionError(f"weight must be float32 (m,), got {weight.dtype} {tuple(weight.shape)}")
    try:
        random_numbers = validate_random_numbers(state_dict["random_numbers"].detach().cpu())
    except ConfigError as exc:
        raise CorruptionError(f"random_numbers: {exc}") from exc
    for name, helper in zip(_PAPER_KEYS[2:], (base, offset, e1sr), strict=True):
        if helper.dim() != 1 or helper.dtype != torch.int64 or helper.numel() == 0:
            raise CorruptionError(f"{name} must be int64 (d,), got {helper.dtype} {tuple(helper.shape)}")
    embedding_dim = base.numel()
    if offset.numel() != embedding_dim or e1sr.numel() != embedding_dim:
        raise CorruptionError("helper_Eidx_base, helper_Eidx_offset and helper_E1sR differ in length")
    z = _infer_chunk_size(embedding_dim, offset.tolist(), chunk_size)
    j = torch.arange(embedding_dim, dtype=torch.int64)
    if not torch.equal(offset.cpu(), j % z) or not torch.equal(base.cpu(), j // z):
        raise CorruptionError(f"helper_Eidx_base / helper_Eidx_offset are not j // Z, j % Z for Z = {z}")
    if not bool((e1sr.cpu() == random_numbers[3]).all()):
        raise CorruptionError("helper_E1sR must repeat random_numbers[3] (the id multiplier)")
    memory_size = weight.numel()
    if memory_size < z:
        raise CorruptionError(f"weight has {memory_size} values, fewer than one chunk ({z})")
    rn = tuple(random_numbers.tolist())
    assert len(rn) == NUM_RANDOM_NUMBERS
    config = TableConfig(
        num_embeddings=memory_size if num_embeddings is None else num_embeddings,
        embedding_dim=embedding_dim,
        memory_size=memory_size,
        chunk_size=z,
        val_offset=val_offset,
        hash="paper",
        random_numbers=rn,
    )
    return Table(config, optimizer, weight=weight.cpu().contiguous().clone())


def _non_finite_step(bad: int, step: PreparedStep) -> InvalidInputError:
    return InvalidInputError(
        f"the update would make {bad} of the {step.locations.numel()} array locations it touches "
        f"non-finite (lr {step.lr:g} x gradient overflows float32); refused, nothing changed"
    )
