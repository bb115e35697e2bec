"""Python client for the robez service, and modules for online training against it.

Lookups and updates travel as binary ``application/octet-stream`` (little-endian int64 ids, float32
row-major rows, ``X-Robez-Shape: n,d``); the smaller control calls use JSON. One concept per module:

- ``wire``: headers, binary encoding and decoding, ``RobezClientError`` (``parse_server_timing`` is
  ``service.servertiming``'s, re-exported);
- ``calls``: every request as data (``Call``), shared by both clients;
- ``base``: what both clients share (retries, bookkeeping, multi-request plans, TLS);
- ``sync_client`` (``RobezClient``) and ``async_client`` (``AsyncRobezClient``);
- ``modules``: ``RemoteEmbedding`` and ``RemoteEmbeddingBag`` (one table each);
- ``collection``: ``RemoteEmbeddingBagCollection`` (a whole model's tables: one pull, one push a step).

Example::

    client = RobezClient("http://127.0.0.1:8000")
    rows = client.lookup("demo", torch.tensor([1, 2, 3]))          # float32 (3, 64)
    version = client.update("demo", torch.tensor([1]), torch.ones(1, 64), lr=0.1)
    client.last_timing                                              # {"hash": 0.01, "apply": ..., ...} ms
"""

from ..servertiming import parse_server_timing
from .async_client import AsyncRobezClient
from .base import DEFAULT_BUSY_RETRIES, DEFAULT_TIMEOUT_S, DEFAULT_URL, TLSVerify, tls_verify
from .collection import RemoteEmbeddingBagCollection, StepStats
from .modules import RemoteEmbedding, RemoteEmbeddingBag
from .sync_client import RobezClient
from .wire import (
    IDEMPOTENCY_HEADER,
    MAX_UPDATE_BYTES_HEADER,
    MIN_VERSION_HEADER,
    OCTET_STREAM,
    REPLICA_HEADER,
    SHAPE_HEADER,
    SHAPES_HEADER,
    TABLES_HEADER,
    VERSION_HEADER,
    IdsLike,
    RobezClientError,
    decode_rows,
    encode_ids,
    encode_rows,
    encode_update,
    parse_shape,
)

__all__ = [
    "DEFAULT_BUSY_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "IDEMPOTENCY_HEADER",
    "MAX_UPDATE_BYTES_HEADER",
    "MIN_VERSION_HEADER",
    "OCTET_STREAM",
    "REPLICA_HEADER",
    "SHAPES_HEADER",
    "SHAPE_HEADER",
    "TABLES_HEADER",
    "VERSION_HEADER",
    "AsyncRobezClient",
    "IdsLike",
    "RemoteEmbedding",
    "RemoteEmbeddingBag",
    "RemoteEmbeddingBagCollection",
    "RobezClient",
    "RobezClientError",
    "StepStats",
    "TLSVerify",
    "decode_rows",
    "encode_ids",
    "encode_rows",
    "encode_update",
    "parse_server_timing",
    "parse_shape",
    "tls_verify",
]
