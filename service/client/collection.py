"""``RemoteEmbeddingBagCollection``: ``robez_core.RobezEmbeddingBagCollection``'s interface over tables on a
robez server, for online training: one multi-table pull (``POST /v1/lookup``) and one multi-table push
(``POST /v1/update``) per step, whatever the number of features; or one request a step, the push carrying
the next batch's pull (``prefetch_after_push``, ``push_with_next_pull``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from robez_core.collection import (
    EmbeddingBagConfig,
    JaggedFeatures,
    PooledEmbeddings,
    check_table_configs,
    parse_jagged,
    per_id_gradients,
)
from robez_core.config import DEFAULT_INIT_SCALE, OptimizerConfig
from robez_core.hashing import DEFAULT_SEED

from .base import TLSVerify
from .sync_client import RobezClient

T = TypeVar("T")
_Updates = dict[str, tuple[Tensor, Tensor]]  # one push: {table: (ids (n,), grads (n, d))}


@dataclass(frozen=True)
class _Feature:
    name: str
    table: str  # the server table it reads
    dim: int
    mean: bool
    num_embeddings: int


@dataclass
class _Batch:
    """One parsed jagged batch: per feature (collection order) its ids and bag offsets (B + 1,)."""

    bounds: Tensor
    batch_size: int
    ids: dict[str, Tensor]  # feature -> int64 (N_f,)
    offsets: dict[str, Tensor]  # feature -> int64 (B + 1,)
    single: bool = False
    """Every bag holds one id (Criteo's features): each id's gradient is its bag's column slice."""
    unique: dict[str, tuple[Tensor, dict[str, Tensor]]] = field(default_factory=dict)
    """server table -> (its distinct ids (U_t,), feature -> each id's index into them (N_f,))"""


@dataclass
class StepStats:
    """What the collection's requests cost, summed since the last ``reset_stats()``.

    ``requests``: requests sent; ``server_ms``: their ``Server-Timing`` totals (the server's own time);
    ``pull_wait_ms`` / ``push_wait_ms``: time the trainer's thread waited for pulls and pushes (a
    prefetched pull or a non-blocking push waits less than it took)."""

    requests: int = 0
    server_ms: float = 0.0
    pull_wait_ms: float = 0.0
    push_wait_ms: float = 0.0


class _RemotePooled(torch.autograd.Function):
    """Forward: the pooled output computed from the fetched rows. Backward: pushes every feature's per-id
    gradients in one request (the server steps them); ``anchor`` is an empty leaf that requires grad,
    the only reason autograd calls backward (the weights are on the server)."""

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, pooled: Tensor, batch: _Batch, module: RemoteEmbeddingBagCollection
    ) -> Tensor:
        ctx.batch, ctx.module = batch, module
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None, None, None]:
        ctx.module._push(ctx.batch, grad_output)
        return None, None, None, None


class RemoteEmbeddingBagCollection(nn.Module):
    """Many pooled features whose tables live on a robez server: the ``RobezEmbeddingBagCollection``
    interface (same configs, input and output) for online training. Each step costs two requests: one
    pull of every feature's distinct rows (``lookup_many``) and, in ``backward``, one push of every
    feature's per-id gradients (``update_many``, applied all-or-nothing); one request with
    ``prefetch_after_push`` (and ``prefetch``) or ``push_with_next_pull``: the push carries the next
    pull. The server runs the tables' optimizer; there are no local parameters (a local ``torch.optim``
    trains the rest of the model).

    Trained without ``prefetch`` and with blocking pushes, the server's array ends bit for bit where the
    local collection's would (same batches, same robez optimizer step, tables made by ``create_tables``).

    Args:
        client: a ``RobezClient`` or the server's URL (``api_key``, ``verify`` as for ``RobezClient``).
            Give each trainer its own client: one keep-alive connection each, so two trainers can be
            served by two server workers.
        tables: the ``EmbeddingBagConfig`` s of the local collection; each is the server table of its
            ``name`` (``create_tables`` makes them), or ``table_names[name]``.
        lr: sent with every push (None: the tables' own).
        max_pending_pushes: 0 (default): ``backward`` returns once the server applied the push. N > 0:
            ``backward`` returns at once and at most N pushes are in flight; the N+1th waits for the
            oldest. A failed push is raised by the next call of this module (``forward``, ``prefetch``,
            ``flush``); none is lost silently. Pulls are sent after every push already made (one
            connection, in order), so without prefetch the rows read still include every earlier push.
        validate_ids: refuse ids outside ``[0, num_embeddings)`` before sending (as the local one).
        prefetch_after_push: a ``prefetch`` made between a ``forward`` and its ``backward`` is pulled by
            that backward's push (False: at once): one request (``update_and_lookup``) applies the push
            and answers the next batch's rows, which include it, so nothing is stale (the same bits as
            without prefetch) and a step costs one request. ``backward`` then returns once the request
            is sent; the next ``forward`` waits for its answer (and raises its error), so the request
            overlaps what the trainer does in between (the dense optimizer step).
        push_with_next_pull: ``backward`` holds its push (unless a ``prefetch`` is waiting for it, as
            above) until the next ``forward`` or ``prefetch``, whose pull it then carries: one request a
            step without calling ``prefetch``, the same bits as without it. ``flush()`` (and ``close``,
            the context manager's exit) sends a held push; so does a second ``backward`` before a
            ``forward``. Nothing else reads the server's tables meanwhile through this module, but
            another client reading them sees the held step only once it is sent.

    Prefetch (opt-in): ``prefetch(next_batch)`` right after this step's ``forward`` pulls the next
    batch's rows while this batch computes; the next ``forward`` given that batch uses them. They were
    read before this step's push, so a prefetched step trains on rows one step stale (a pipeline, as
    in asynchronous SGD); with N pending pushes, up to N + 1 steps stale. With ``prefetch_after_push``
    the pull goes with this step's push (one request) and nothing is stale.

    Finish with ``flush()`` (or use the module as a context manager): it sends a held push, waits for
    pending pushes and raises any that failed.

    Shapes: as ``RobezEmbeddingBagCollection.forward``: a ``KeyedJaggedTensor`` (or ``keys``, ``values``
    int64 (N,), ``lengths`` (F * B,) or ``offsets`` (F * B + 1,)) -> ``PooledEmbeddings`` (B, sum of
    dims) in the collection's feature order.

    Example::

        RemoteEmbeddingBagCollection.create_tables(client, tables, memory_size=1 << 22,
                                                   optimizer=OptimizerConfig("adagrad", lr=0.05))
        with RemoteEmbeddingBagCollection(client, tables) as ebc:
            for batch, next_batch in pairwise(batches):
                pooled = ebc(batch)
                ebc.prefetch(next_batch)               # optional: overlaps the next pull
                loss(mlp(pooled.values())).backward()  # one push: the server steps every table
    """

    def __init__(
        self,
        client: RobezClient | str,
        tables: Sequence[EmbeddingBagConfig],
        *,
        table_names: Mapping[str, str] | None = None,
        lr: float | None = None,
        max_pending_pushes: int = 0,
        validate_ids: bool = True,
        prefetch_after_push: bool = False,
        push_with_next_pull: bool = False,
        api_key: str | None = None,
        verify: TLSVerify = True,
    ) -> None:
        super().__init__()
        tables = check_table_configs(tables)  # ConfigError, a ValueError
        if max_pending_pushes < 0:
            raise ValueError(f"max_pending_pushes must be >= 0, got {max_pending_pushes}")
        names = dict(table_names or {})
        self.client = (
            client if isinstance(client, RobezClient) else RobezClient(client, api_key, verify=verify)
        )
        self.tables = tables
        self._features: dict[str, _Feature] = {}
        for table in tables:
            for name in table.feature_names:
                if name in self._features:
                    raise ValueError(f"feature {name!r} appears in two tables")
                self._features[name] = _Feature(
                    name,
                    names.get(table.name, table.name),
                    table.embedding_dim,
                    table.pooling == "mean",
                    table.num_embeddings,
                )
        self.feature_names = list(self._features)
        self.lr = lr
        self.max_pending_pushes = max_pending_pushes
        self.validate_ids = validate_ids
        self.stats = StepStats()
        self.versions: dict[str, int] = {}
        """Each server table's version after the last push that finished."""
        # Every request goes through this one thread, in submission order, on the client's one
        # connection: a pull sent after a push sees it, and the client is never used by two threads.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="robez-ebc")
        self._pending: deque[Future[None]] = deque()
        self._failed: list[BaseException] = []
        self._failed_lock = threading.Lock()
        self.prefetch_after_push = prefetch_after_push
        self.push_with_next_pull = push_with_next_pull
        # (inputs, batch, its pull: None while it waits for a push, whether that pull carries a push)
        self._prefetched: tuple[tuple[Any, ...], _Batch, Future[dict[str, Tensor]] | None, bool] | None = None
        self._held: _Updates | None = None  # a push waiting for the next pull (push_with_next_pull)
        self._forwards_to_push = 0  # forwards with autograd whose backward has not pushed yet

    # ------------------------------------------------------------------ server tables

    @staticmethod
    def create_tables(
        client: RobezClient,
        tables: Sequence[EmbeddingBagConfig],
        *,
        memory_size: int,
        optimizer: OptimizerConfig | None = None,
        chunk_size: int = 32,
        seed: int = DEFAULT_SEED,
        hash: str = "paper",
        init_scale: float = DEFAULT_INIT_SCALE,
    ) -> None:
        """Create one server table per ``EmbeddingBagConfig``, all over one shared array of ``memory_size``
        floats, with the ``val_offset`` s, initial array (same ``seed``) and optimizer the local
        ``RobezEmbeddingBagCollection(tables, memory_size, ...)`` would have (sharing needs a server
        without a data directory: docs/api.md)."""
        first: str | None = None
        next_offset = 0
        for table in tables:
            val_offset = next_offset if table.val_offset is None else table.val_offset
            next_offset = val_offset + table.num_embeddings
            config = {
                "num_embeddings": table.num_embeddings,
                "embedding_dim": table.embedding_dim,
                "memory_size": memory_size,
                "chunk_size": chunk_size,
                "seed": seed,
                "val_offset": val_offset,
                "hash": hash,
                "init_scale": init_scale,
            }
            client.create_table(
                table.name, config, None if optimizer is None else optimizer.to_dict(), share_array_with=first
            )
            first = first or table.name

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        features: JaggedFeatures | None = None,
        *,
        keys: Sequence[str] | None = None,
        values: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> PooledEmbeddings:
        """Pooled features of one batch (see the class docstring); one pull unless prefetched."""
        self._raise_failed()
        inputs = (features, keys, values, lengths, offsets)
        prefetched = self._take_prefetched(inputs)
        if prefetched is not None:
            batch, future = prefetched
        else:
            batch = self._batch(*inputs)
            future = self._pull_soon(batch)
        rows = self._wait(future, "pull_wait_ms")
        pooled = (
            torch.cat([self._pool(batch, rows, feature) for feature in self._features.values()], dim=1)
            if batch.batch_size
            else torch.zeros(0, sum(f.dim for f in self._features.values()))
        )
        if torch.is_grad_enabled():
            self._forwards_to_push += 1
            anchor = torch.empty(0, requires_grad=True)
            pooled = _RemotePooled.apply(anchor, pooled, batch, self)
        return PooledEmbeddings(list(self.feature_names), [f.dim for f in self._features.values()], pooled)

    def prefetch(
        self,
        features: JaggedFeatures | None = None,
        *,
        keys: Sequence[str] | None = None,
        values: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> None:
        """Start pulling the rows of the batch the next ``forward`` will get (same ``values`` tensor);
        returns at once. The rows are read before the pushes made after this call (staleness: see the
        class docstring)."""
        self._raise_failed()
        inputs = (features, keys, values, lengths, offsets)
        batch = self._batch(*inputs)
        self._drop_prefetched()
        if self.prefetch_after_push and self._forwards_to_push > 0:
            self._prefetched = (inputs, batch, None, False)  # sent by the next push (``_send_deferred``)
        else:
            carries = self._held is not None
            self._prefetched = (inputs, batch, self._pull_soon(batch), carries)

    def _pull_soon(self, batch: _Batch) -> Future[dict[str, Tensor]]:
        """The pull of ``batch``, queued; with a held push, one request of both (the rows include it)."""
        if self._held is None:
            return self._submit(lambda: self._pull(batch))
        held, self._held = self._held, None
        return self._submit(lambda: self._push_and_pull(held, batch))

    def _send_deferred(self) -> None:
        """Send the pull of a prefetch that waited for a push (now queued behind it)."""
        if self._prefetched is not None and self._prefetched[2] is None:
            inputs, batch, _, _ = self._prefetched
            self._prefetched = (inputs, batch, self._submit(lambda: self._pull(batch)), False)

    def _drop_prefetched(self) -> None:
        """Forget a prefetch that will not be used: one whose request carries a push is waited for (its
        error raised), one still waiting for a push is never sent, a pull already sent just ends."""
        if self._prefetched is None:
            return
        _, _, future, carries = self._prefetched
        self._prefetched = None
        if future is None:
            return
        if carries:
            self._wait(future, "push_wait_ms")
        else:
            future.cancel()

    def _take_prefetched(self, inputs: tuple[Any, ...]) -> tuple[_Batch, Future[dict[str, Tensor]]] | None:
        """The prefetched batch and its pull when ``inputs`` are the very objects given to ``prefetch``
        (keys equal); otherwise the prefetch is dropped (a pull already running just ends). A pull still
        waiting for a push that never came (no backward) is sent now."""
        if self._prefetched is None:
            return None
        self._send_deferred()
        prefetched_inputs, batch, future, _ = self._prefetched
        same = all(
            (a == b) if index == 1 else (a is b)
            for index, (a, b) in enumerate(zip(inputs, prefetched_inputs, strict=True))
        )
        assert future is not None  # sent by _send_deferred above
        if not same:
            self._drop_prefetched()
            return None
        self._prefetched = None
        return batch, future

    def _pool(self, batch: _Batch, rows: dict[str, Tensor], feature: _Feature) -> Tensor:
        """(B, d) of one feature, pooled as the local collection's kernel does: each bag's rows added in
        order from zero, a mean bag then times float32(1 / length)."""
        table_rows = rows[feature.table]
        if table_rows.shape[0] == 0:
            return torch.zeros(batch.batch_size, feature.dim)
        _, inverse = batch.unique[feature.table]
        offsets = batch.offsets[feature.name]
        pooled = F.embedding_bag(
            inverse[feature.name], table_rows, offsets, mode="sum", include_last_offset=True
        )
        if feature.mean:  # torch's "mean" divides; the kernel multiplies by the float32 reciprocal
            counts = (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)
            pooled = pooled * (1.0 / counts).unsqueeze(1)
        return pooled

    # ------------------------------------------------------------------ requests (the worker thread)

    def _pull(self, batch: _Batch) -> dict[str, Tensor]:
        rows = self.client.lookup_many({table: unique for table, (unique, _) in batch.unique.items()})
        self._count(self.client.last_timing)
        return rows

    def _push_and_pull(self, updates: _Updates, batch: _Batch) -> dict[str, Tensor]:
        """One request: the push, then the rows of ``batch`` (read after it: ``update_and_lookup``)."""
        lookups = {table: unique for table, (unique, _) in batch.unique.items()}
        versions, rows = self.client.update_and_lookup(updates, lookups, lr=self.lr)
        self.versions.update(versions)
        self._count(self.client.last_timing)
        return rows

    def _push(self, batch: _Batch, grad_output: Tensor) -> None:
        """Every feature's per-id gradients (its bag's gradient, over its length for a mean bag), in the
        collection's feature order, the features of one table concatenated: one ``update_many`` (with
        the next batch's pull where one waits for it, or is to come: ``push_with_next_pull``)."""
        grad_output = grad_output.contiguous()
        parts: dict[str, tuple[list[Tensor], list[Tensor]]] = {}
        column = 0
        for feature in self._features.values():
            grad_pooled = grad_output[:, column : column + feature.dim]
            column += feature.dim
            if batch.single:  # a view: the encoder copies it once into the body (x / 1 is x for mean)
                grads = grad_pooled
            else:
                offsets = batch.offsets[feature.name]
                grads = per_id_gradients(grad_pooled, offsets, "mean" if feature.mean else "sum")
            ids_list, grads_list = parts.setdefault(feature.table, ([], []))
            ids_list.append(batch.ids[feature.name])
            grads_list.append(grads)
        updates = {
            table: (torch.cat(ids) if len(ids) > 1 else ids[0], torch.cat(g) if len(g) > 1 else g[0])
            for table, (ids, g) in parts.items()
        }
        self._forwards_to_push = max(0, self._forwards_to_push - 1)
        self._send_held()  # a push still held (two backwards in a row): sent first, in order
        if self._prefetched is not None and self._prefetched[2] is None:
            # A prefetch waits for this push: one request of both; the next forward waits for it.
            inputs, next_batch, _, _ = self._prefetched
            future = self._submit(lambda: self._push_and_pull(updates, next_batch))
            self._prefetched = (inputs, next_batch, future, True)
            return
        if self.push_with_next_pull:
            self._held = updates  # sent by the next forward or prefetch, with its pull
            return
        self._send_push(updates)

    def _send_held(self) -> None:
        """Send a held push on its own (``flush``, or another push before a pull came)."""
        if self._held is not None:
            held, self._held = self._held, None
            self._send_push(held)

    def _send_push(self, updates: _Updates) -> None:
        def send() -> None:
            self.versions.update(self.client.update_many(updates, lr=self.lr))
            self._count(self.client.last_timing)

        # (A prefetch waiting for a push is never sent from here: ``_push`` sends it with its push; a
        # held push sent first must not take it, or its rows would miss the push it waits for.)
        future = self._submit(send)
        if self.max_pending_pushes == 0:
            self._wait(future, "push_wait_ms")
            return
        future.add_done_callback(self._note_failure)
        self._pending.append(future)
        while len(self._pending) > self.max_pending_pushes:
            self._wait_quietly(self._pending.popleft())

    def _count(self, timing: Mapping[str, float]) -> None:
        self.stats.requests += 1
        self.stats.server_ms += timing.get("total", 0.0)

    def _submit(self, work: Callable[[], T]) -> Future[T]:
        return self._executor.submit(work)

    def _wait(self, future: Future[T], stat: str) -> T:
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            setattr(self.stats, stat, getattr(self.stats, stat) + (time.perf_counter() - start) * 1e3)

    def _wait_quietly(self, future: Future[None]) -> None:
        """Wait for a non-blocking push; its error, if any, is kept (``_note_failure``) for the next call."""
        start = time.perf_counter()
        with contextlib.suppress(Exception):  # recorded by _note_failure, raised by _raise_failed
            future.result()
        self.stats.push_wait_ms += (time.perf_counter() - start) * 1e3

    def _note_failure(self, future: Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            with self._failed_lock:
                self._failed.append(error)

    def _raise_failed(self) -> None:
        """Raise the first non-blocking push that failed since the last call (the count of others noted)."""
        with self._failed_lock:
            failed, self._failed = self._failed, []
        if failed:
            error = failed[0]
            if len(failed) > 1:
                error.add_note(f"{len(failed) - 1} more non-blocking pushes failed after this one")
            raise error

    # ------------------------------------------------------------------ end of training

    def flush(self) -> None:
        """Send a held push, wait until every push made so far is applied; raise the first that failed.
        A prefetch stays usable (a push it carries is waited for here)."""
        self._send_held()
        if self._prefetched is not None and self._prefetched[3]:
            future = self._prefetched[2]
            assert future is not None
            try:
                self._wait(future, "push_wait_ms")
            except BaseException:
                self._prefetched = None  # raised here, not again by the next forward
                raise
        while self._pending:
            self._wait_quietly(self._pending.popleft())
        self._raise_failed()

    def close(self) -> None:
        """``flush``, then stop the worker thread (the client stays open: it is the caller's)."""
        try:
            self.flush()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> RemoteEmbeddingBagCollection:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: still wait for the pushes in flight, without hiding the first error.
        with contextlib.suppress(Exception):
            self.close()

    def reset_stats(self) -> StepStats:
        """The stats so far, and start counting again from zero."""
        stats, self.stats = self.stats, StepStats()
        return stats

    # ------------------------------------------------------------------ input

    def _batch(
        self,
        features: JaggedFeatures | None,
        keys: Sequence[str] | None,
        values: Tensor | None,
        lengths: Tensor | None,
        offsets: Tensor | None,
    ) -> _Batch:
        key_tuple, ids, bounds = parse_jagged(
            features, keys=keys, values=values, lengths=lengths, offsets=offsets
        )
        key_list = list(key_tuple)
        unknown = [key for key in key_list if key not in self._features]
        if unknown:
            raise ValueError(f"unknown feature keys {unknown}; this collection has {self.feature_names}")
        if len(set(key_list)) != len(key_list) or len(key_list) != len(self._features):
            missing = sorted(set(self._features) - set(key_list))
            raise ValueError(f"the input must give every feature once: keys {key_list}, missing {missing}")
        batch_size = (bounds.numel() - 1) // len(key_list)
        batch = _Batch(
            bounds, batch_size, {}, {}, single=bool(torch.equal(bounds, torch.arange(bounds.numel())))
        )
        for index, key in enumerate(key_list):
            start, stop = int(bounds[index * batch_size]), int(bounds[(index + 1) * batch_size])
            feature_ids = ids[start:stop]
            if self.validate_ids and feature_ids.numel():
                low, high = int(feature_ids.min()), int(feature_ids.max())
                if low < 0 or high >= self._features[key].num_embeddings:
                    bad = low if low < 0 else high
                    raise ValueError(
                        f"feature {key!r}: id {bad} is outside [0, {self._features[key].num_embeddings})"
                    )
            batch.ids[key] = feature_ids
            batch.offsets[key] = bounds[index * batch_size : (index + 1) * batch_size + 1] - start
        by_table: dict[str, list[str]] = {}
        for feature in self._features.values():
            by_table.setdefault(feature.table, []).append(feature.name)
        for table, names in by_table.items():
            together = (
                torch.cat([batch.ids[name] for name in names]) if len(names) > 1 else batch.ids[names[0]]
            )
            unique, inverse = torch.unique(together, return_inverse=True)
            per_feature, start = {}, 0
            for name in names:
                count = batch.ids[name].numel()
                per_feature[name] = inverse[start : start + count]
                start += count
            batch.unique[table] = (unique, per_feature)
        return batch

    def extra_repr(self) -> str:
        return (
            f"features={len(self.feature_names)}, tables={len(self.tables)}, lr={self.lr}, "
            f"max_pending_pushes={self.max_pending_pushes}, prefetch_after_push={self.prefetch_after_push}, "
            f"push_with_next_pull={self.push_with_next_pull}"
        )


__all__ = ["RemoteEmbeddingBagCollection", "StepStats"]
