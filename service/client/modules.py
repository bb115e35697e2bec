"""Online training, one table per module: ``RemoteEmbedding`` and ``RemoteEmbeddingBag``, whose rows live
on a robez server. Forward looks rows up; backward pushes their gradients and the server steps them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import TLSVerify
from .sync_client import RobezClient

POOLING_MODES = ("sum", "mean", "max")


class _RemoteLookup(torch.autograd.Function):
    """Forward: rows of unique ids from the server. Backward: pushes their gradients to the server.

    ``anchor`` is an empty tensor that requires grad: it is the only reason autograd calls backward,
    since the real "weights" are on the server and have no local leaf.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, unique_ids: Tensor, module: RemoteEmbedding, lr: float | None
    ) -> Tensor:
        ctx.unique_ids = unique_ids
        ctx.module = module
        ctx.lr = lr
        return module.client.lookup(module.table, unique_ids, min_version=module.last_version)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[None, None, None, None]:
        ctx.module._push(ctx.unique_ids, grad_rows, ctx.lr)
        return None, None, None, None


class RemoteEmbedding(nn.Module):
    """An embedding whose table lives on a robez server: an online-training ``nn.Embedding``.

    ``forward`` looks up the rows of ``ids`` (each distinct id crosses the wire once). When autograd is
    on, ``loss.backward()`` pushes dLoss/dRow for those ids back with ``client.update``: the **server**
    applies the table's optimizer (sgd, adagrad or adam, with the table's lr unless ``lr`` overrides it)
    and the next lookup, by this or any other client, sees the change. There are no local parameters,
    so a local ``torch.optim`` optimizer never sees this module; it trains only the rest of the model.

    The gradient pushed is exactly what autograd computed (a mean-reduced loss divides it by the batch
    size), so pick the table's lr with that scale in mind. Pushes happen inside ``backward`` and block
    until the server has applied them; a failed push raises ``RobezClientError`` out of ``backward``.
    Lookups after a push ask for at least the version it produced (``X-Robez-Min-Version``), so behind
    a load balancer over replicas the module still reads its own writes.

    Args:
        client: a ``RobezClient`` connected to the server, or the server's URL (a client is made with
            ``api_key`` and ``verify``).
        table: the table's name on the server.
        lr: learning rate sent with every push (None: the table's own).
        embedding_dim: d, when known; otherwise read from the server once.
        api_key, verify: for a URL ``client``: as for ``RobezClient`` (``verify``: the CA bundle of an
            ``https://`` server).

    Shape:
        ids (*) int64 -> (*, d) float32.

    Example::

        users = RemoteEmbedding(RobezClient(url), "users")
        loss = model(users(user_ids)).mean()
        loss.backward()            # users' rows updated on the server here
    """

    def __init__(
        self,
        client: RobezClient | str,
        table: str,
        *,
        lr: float | None = None,
        embedding_dim: int | None = None,
        api_key: str | None = None,
        verify: TLSVerify = True,
    ) -> None:
        super().__init__()
        self.client = (
            client if isinstance(client, RobezClient) else RobezClient(client, api_key, verify=verify)
        )
        self.table = table
        self.lr = lr
        self.embedding_dim = (
            embedding_dim if embedding_dim is not None else table_dim(self.client.table(table))
        )
        self.pushes = 0
        """Gradient pushes made so far (one per backward through a forward of this module)."""
        self.last_version: int | None = None
        """The table version the last push produced."""
        self.last_push_timing: dict[str, float] = {}
        """Server-Timing of the last push (ms by stage: hash, apply, total)."""

    def forward(self, ids: Tensor, lr: float | None = None) -> Tensor:
        """Rows of ``ids`` (*) -> (*, d); ``lr`` overrides ``self.lr`` for the push of this call only."""
        rows, inverse = self.unique_rows(ids, lr)
        # Indexing scatters gradients of repeated ids back onto their one unique row before the push.
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def unique_rows(self, ids: Tensor, lr: float | None = None) -> tuple[Tensor, Tensor]:
        """(rows (U, d) of the U distinct ids, inverse (N,) index of each of the N ``ids`` into them).

        The rows carry the push in their backward (when autograd is on): whatever reads them, e.g. a
        pooling, feeds the one push of the distinct ids' gradients."""
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() == 0:
            return torch.zeros(0, self.embedding_dim), torch.zeros(0, dtype=torch.int64)
        unique_ids, inverse = torch.unique(flat, return_inverse=True)
        if torch.is_grad_enabled():
            anchor = torch.empty(0, requires_grad=True)
            rows = _RemoteLookup.apply(anchor, unique_ids, self, self.lr if lr is None else lr)
        else:
            rows = self.client.lookup(self.table, unique_ids, min_version=self.last_version)
        return rows, inverse

    def _push(self, unique_ids: Tensor, grad_rows: Tensor, lr: float | None) -> None:
        self.last_version = self.client.update(self.table, unique_ids, grad_rows, lr=lr)
        self.last_push_timing = dict(self.client.last_timing)
        self.pushes += 1

    def extra_repr(self) -> str:
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}, lr={self.lr}"


class RemoteEmbeddingBag(nn.Module):
    """A drop-in ``nn.EmbeddingBag`` over a remote table: the distinct ids' rows are fetched and trained
    as by ``RemoteEmbedding`` and pooled locally by ``torch.nn.functional.embedding_bag``, so pooling,
    bags and their gradients are torch's own, and the pooling's backward feeds the one push.

    Args:
        client, table, lr, embedding_dim: as for ``RemoteEmbedding``.
        mode: ``"mean"`` (the default, as ``nn.EmbeddingBag``'s), ``"sum"`` or ``"max"``; empty bags
            give zeros. (Up to robez 0.1.0 the default was ``"sum"``: pass ``mode="sum"`` for the old output.)
        include_last_offset: as ``nn.EmbeddingBag``'s: ``offsets`` has B+1 entries, the last one the
            number of ids (the torchrec/FBGEMM layout). Without it, B+1 offsets are B+1 bags, the last
            one empty, as torch reads them.
        sparse: accepted for ``nn.EmbeddingBag`` compatibility; it changes nothing, since there is no
            local weight: what crosses the wire is always the touched rows' gradients only.

    Shape:
        ``input`` (B, L) with ``offsets=None`` (fixed-size bags), or ``input`` (N,) with ``offsets`` (B,)
        bag starts (B+1 with ``include_last_offset``) -> (B, d). ``per_sample_weights`` (like
        ``input``) only with ``mode="sum"``.
    """

    def __init__(
        self,
        client: RobezClient | str,
        table: str,
        *,
        mode: str = "mean",
        include_last_offset: bool = False,
        sparse: bool = False,
        lr: float | None = None,
        embedding_dim: int | None = None,
        api_key: str | None = None,
        verify: TLSVerify = True,
    ) -> None:
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"mode must be one of {POOLING_MODES}, got {mode!r}")
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.sparse = sparse
        self.embedding = RemoteEmbedding(
            client, table, lr=lr, embedding_dim=embedding_dim, api_key=api_key, verify=verify
        )

    @property
    def embedding_dim(self) -> int:
        return self.embedding.embedding_dim

    def forward(
        self,
        input: Tensor,
        offsets: Tensor | None = None,
        per_sample_weights: Tensor | None = None,
        lr: float | None = None,
    ) -> Tensor:
        """Pooled bags (B, d); ``lr`` overrides the module's for this call's push only."""
        if per_sample_weights is not None and self.mode != "sum":
            raise ValueError("per_sample_weights is only supported with mode='sum'")
        if offsets is None:
            if input.dim() != 2:
                raise ValueError(f"input must be 2-D (B, L) when offsets is None, got {tuple(input.shape)}")
        else:
            if input.dim() != 1 or offsets.dim() != 1:
                raise ValueError("with offsets, input and offsets must be 1-D")
            offsets = offsets.to(torch.int64)
            check_offsets(offsets, int(input.shape[0]), self.include_last_offset)
        rows, inverse = self.embedding.unique_rows(input, lr)
        if rows.shape[0] == 0:  # no ids at all: F.embedding_bag wants a weight with rows
            rows = torch.zeros(1, self.embedding_dim)
        return F.embedding_bag(
            inverse.reshape(input.shape),
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, include_last_offset={self.include_last_offset}"


def check_offsets(offsets: Tensor, num_ids: int, include_last_offset: bool = False) -> None:
    """Bag starts as ``nn.EmbeddingBag`` reads them: from 0, non-decreasing, at most ``num_ids``; with
    ``include_last_offset``, at least one entry (the end). ``ValueError`` otherwise."""
    if include_last_offset and offsets.numel() == 0:
        raise ValueError("include_last_offset needs at least one offset (the end of the last bag)")
    if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())):
        raise ValueError("offsets must start at 0 and be non-decreasing")
    if offsets.numel() and int(offsets[-1]) > num_ids:
        raise ValueError(f"offsets point past the {num_ids} ids")


def table_dim(info: Mapping[str, Any]) -> int:
    """``embedding_dim`` from a ``GET /v1/tables/{name}`` answer."""
    config = info.get("config", info)
    return int(config["embedding_dim"])
