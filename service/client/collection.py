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
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
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
from robez_core.kernels import distinct_by_table

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
    """One parsed jagged batch in the collection's feature order (a table's features are adjacent in it,
    tables in order): every feature's ids one after the other, and what its pull and push need."""

    batch_size: int
    ids: Tensor
    """int64 (N,): the ids, feature by feature in the collection's order (the input's values where the
    keys came in that order)"""
    bounds: Tensor
    """int64 (F * B + 1,): bag ``f * B + b`` (feature f, sample b) is ``ids[bounds[i]:bounds[i + 1]]``"""
    lookups: dict[str, Tensor]
    """server table (in order) -> its distinct ids (U_t,) in order of first appearance: the pull"""
    inverse: Tensor
    """int64 (N,): each id's row in the pull's rows of every table one after the other (U,)"""
    starts: list[int]
    """F + 1: feature f's ids are ``ids[starts[f]:starts[f + 1]]``"""
    single: bool = False
    """Every bag holds one id (Criteo's features): each id's gradient is its bag's."""


def _take(values: Tensor, ranges: list[tuple[int, int]]) -> Tensor:
    """``values`` ' rows in ``ranges``, one after the other (a view for one range)."""
    if len(ranges) == 1:
        return values[ranges[0][0] : ranges[0][1]]
    return torch.cat([values[start:stop] for start, stop in ranges])


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
    local collection's would (same batches, same robez optimizer step, tables made by ``create_tables``),
    for batches whose keys come in the collection's order: the push goes table by table in that order,
    while the local step adds a location's gradients in the order of the keys given (other orders pool
    the same, but train a few last bits apart where features collide in the array).

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
        features = list(self._features.values())
        self._width = sum(feature.dim for feature in features)
        self._table_features: dict[str, list[int]] = {}  # server table -> its features' indices
        for index, feature in enumerate(features):
            self._table_features.setdefault(feature.table, []).append(index)
        table_index = {table: index for index, table in enumerate(self._table_features)}
        self._tables = np.array([table_index[feature.table] for feature in features], dtype=np.int64)
        self._limits = np.array([feature.num_embeddings for feature in features], dtype=np.int64)
        self._mean = torch.tensor([feature.mean for feature in features])
        dims = {feature.dim for feature in features}
        self._dim = dims.pop() if len(dims) == 1 else None  # one dim: one pooling op for every feature
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
        pooled = self._pool(batch, rows)
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

    def _pool(self, batch: _Batch, rows: dict[str, Tensor]) -> Tensor:
        """(B, sum of dims), pooled as the local collection's kernel does: each bag's rows added in order
        from zero, a mean bag then times float32(1 / length). Features of one dim: one op for all bags,
        taken sample by sample (bag ``b * F + f``), so that its (B * F, d) output is the (B, F * d) one."""
        size, count, total = batch.batch_size, len(self._features), batch.ids.numel()
        if size == 0:
            return torch.zeros(0, self._width)
        if self._dim is not None:
            weight = torch.cat([rows[table] for table in batch.lookups])
            if batch.single:
                index, offsets = batch.inverse.view(count, size).t().reshape(-1), torch.arange(total + 1)
            else:
                lengths = batch.bounds.diff().view(count, size).t().reshape(-1)
                offsets = torch.zeros(count * size + 1, dtype=torch.int64)
                torch.cumsum(lengths, 0, out=offsets[1:])
                firsts = batch.bounds[:-1].view(count, size).t().reshape(-1)  # each bag's first id
                moves = torch.repeat_interleave(firsts - offsets[:-1], lengths, output_size=total)
                index = batch.inverse[moves + torch.arange(total)]
            pooled = F.embedding_bag(index, weight, offsets, mode="sum", include_last_offset=True)
            if not batch.single and bool(self._mean.any()):  # one id a bag: times 1 is the same bits
                scale = 1.0 / lengths.clamp(min=1).to(torch.float32)
                pooled *= torch.where(self._mean.repeat(size), scale, 1.0).unsqueeze(1)
            return pooled.view(size, count * self._dim)
        columns: list[Tensor] = []
        first_row, row = {}, 0
        for table in batch.lookups:
            first_row[table], row = row, row + rows[table].shape[0]
        for position, feature in enumerate(self._features.values()):
            table_rows = rows[feature.table]
            if table_rows.shape[0] == 0:
                columns.append(torch.zeros(size, feature.dim))
                continue
            start, stop = batch.starts[position], batch.starts[position + 1]
            offsets = batch.bounds[position * size : (position + 1) * size + 1] - start
            inverse = batch.inverse[start:stop] - first_row[feature.table]
            pooled = F.embedding_bag(inverse, table_rows, offsets, mode="sum", include_last_offset=True)
            if feature.mean:  # torch's "mean" divides; the kernel multiplies by the float32 reciprocal
                counts = (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)
                pooled = pooled * (1.0 / counts).unsqueeze(1)
            columns.append(pooled)
        return torch.cat(columns, dim=1)

    # ------------------------------------------------------------------ requests (the worker thread)

    def _pull(self, batch: _Batch) -> dict[str, Tensor]:
        rows = self.client.lookup_many(batch.lookups)
        self._count(self.client.last_timing)
        return rows

    def _push_and_pull(self, updates: _Updates, batch: _Batch) -> dict[str, Tensor]:
        """One request: the push, then the rows of ``batch`` (read after it: ``update_and_lookup``)."""
        versions, rows = self.client.update_and_lookup(updates, batch.lookups, lr=self.lr)
        self.versions.update(versions)
        self._count(self.client.last_timing)
        return rows

    def _push(self, batch: _Batch, grad_output: Tensor) -> None:
        """Every feature's per-id gradients (its bag's gradient, over its length for a mean bag), in the
        collection's feature order, the features of one table concatenated: one ``update_many`` (with
        the next batch's pull where one waits for it, or is to come: ``push_with_next_pull``)."""
        grads = self._per_id_gradients(batch, grad_output.contiguous())
        updates = {}
        for table, members in self._table_features.items():
            ranges: list[tuple[int, int]] = []  # the table's ids in the batch: its features, runs joined
            for index in members:
                start, stop = batch.starts[index], batch.starts[index + 1]
                if ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], stop)
                else:
                    ranges.append((start, stop))
            if isinstance(grads, Tensor):
                table_grads = _take(grads, ranges)
            else:
                table_grads = (
                    grads[members[0]] if len(members) == 1 else torch.cat([grads[i] for i in members])
                )
            updates[table] = (_take(batch.ids, ranges), table_grads)
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

    def _per_id_gradients(self, batch: _Batch, grad_output: Tensor) -> Tensor | list[Tensor]:
        """Each id's gradient (its bag's, over its length for a mean bag, as ``per_id_gradients``): one
        (N, d) tensor in the batch's id order for features of one dim in bags of several ids (one
        gather), else one per feature (for bags of one id, a column view: the encoder gathers it once
        into the body, and x / 1 is x for mean)."""
        size, count, total = batch.batch_size, len(self._features), batch.ids.numel()
        if batch.single or self._dim is None:
            pieces, column = [], 0
            for index, feature in enumerate(self._features.values()):
                grad_pooled = grad_output[:, column : column + feature.dim]
                column += feature.dim
                if not batch.single:
                    offsets = batch.bounds[index * size : (index + 1) * size + 1] - batch.starts[index]
                    grad_pooled = per_id_gradients(grad_pooled, offsets, "mean" if feature.mean else "sum")
                pieces.append(grad_pooled)
            return pieces
        lengths = batch.bounds.diff()
        bag = torch.repeat_interleave(torch.arange(count * size), lengths, output_size=total)
        grads = grad_output.view(size * count, self._dim)[(bag % size) * count + bag // size]
        if bool(self._mean.any()):  # x / 1 is x: a sum bag's ids keep their bag's gradient
            divisor = torch.where(self._mean.repeat_interleave(size), lengths.to(torch.float32), 1.0)
            grads = grads / divisor[bag].unsqueeze(1)
        return grads

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
        count = len(key_list)
        size = (bounds.numel() - 1) // count
        starts = bounds[torch.arange(count + 1) * size].tolist()
        if key_list != self.feature_names:  # into the collection's order
            order = [key_list.index(name) for name in self.feature_names]
            ids = torch.cat([ids[starts[key] : starts[key + 1]] for key in order])
            bag_lengths = bounds.diff().view(count, size)[order].reshape(-1)
            bounds = torch.zeros_like(bounds)
            torch.cumsum(bag_lengths, 0, out=bounds[1:])
            starts = bounds[torch.arange(count + 1) * size].tolist()
        total = ids.numel()
        # every table's distinct ids, in one pass (and the first id outside its feature's range)
        distinct, inverse, table_starts, bad = distinct_by_table(ids, starts, self._tables, self._limits)
        if bad >= 0 and self.validate_ids:
            index = next(f for f in range(count) if starts[f] <= bad < starts[f + 1])
            feature = self._features[self.feature_names[index]]
            raise ValueError(
                f"feature {feature.name!r}: id {int(ids[bad])} is outside [0, {feature.num_embeddings})"
            )
        lookups = {
            table: distinct[table_starts[index] : table_starts[index + 1]]
            for index, table in enumerate(self._table_features)
        }
        single = total == count * size and bool(torch.equal(bounds, torch.arange(bounds.numel())))
        return _Batch(size, ids, bounds, lookups, inverse, starts, single)

    def extra_repr(self) -> str:
        return (
            f"features={len(self.feature_names)}, tables={len(self.tables)}, lr={self.lr}, "
            f"max_pending_pushes={self.max_pending_pushes}, prefetch_after_push={self.prefetch_after_push}, "
            f"push_with_next_pull={self.push_with_next_pull}"
        )


__all__ = ["RemoteEmbeddingBagCollection", "StepStats"]
