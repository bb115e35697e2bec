"""``ReplicatedLog`` on NATS JetStream (client: nats-py).

What lives where, for prefix ``robez`` (``ROBEZ_NATS_PREFIX``):

- catalog: KV bucket ``robez_tables``, key = table name, value = JSON {config, optimizer, incarnation};
  ``create`` is the KV's create-if-absent, so two replicas creating one table race safely.
- updates: one stream per table incarnation, ``robez_<table>_<incarnation>`` on subject
  ``robez.u.<table>.<incarnation>``; stream sequence = position = table version. File storage,
  ``num_replicas`` = ``ROBEZ_NATS_REPLICAS``, ``duplicate_window`` = ``ROBEZ_NATS_DEDUP_WINDOW_S`` (an
  append's key is its ``Nats-Msg-Id``), no age or size limits: only ``trim`` removes entries.
- snapshots: Object Store bucket ``robez_snapshots``, object ``<table>.<incarnation>`` (the newest one
  uploaded), its position in the object's description. Its chunks go on subject
  ``$O.robez_snapshots.C.<table>.<incarnation>.<random>`` (the object's "nuid"), so every chunk of a table
  incarnation, whoever uploaded it, is under one subject prefix: dropping the table purges the prefix,
  and an upload that commits purges every chunk under it stored before its own first one (the previous
  object's and any that an upload killed half-way left).
- upload leases: KV bucket ``robez_leases`` (``max_age`` = the lease TTL), key
  ``snapshot.<table>.<incarnation>``: created if absent by the replica that uploads, renewed while it
  uploads, deleted after. At most one replica uploads a table at a time; the object's meta is written with
  ``Nats-Expected-Last-Subject-Sequence`` = the meta it replaces, so even a holder whose lease expired
  (a frozen process) cannot overwrite a snapshot stored meanwhile: its upload is purged instead.
- loads: the same bucket, object ``load.<table>.<incarnation>.<random>`` per ``POST .../load``, the
  position of the log entry naming it in its description once a replica applied it (its chunks on the
  object store's own ``C.<nuid>`` subjects, outside every table's snapshot chunk prefix).

The snapshots and loads (the Object Store side, leases included) are ``objects.py``'s
(``SnapshotObjects``, a base class of ``JetStreamLog``); the connection, the catalog and the update
streams are here.

- write health: stream ``robez_health`` (memory storage, one message per subject, a minute's age), where
  ``check_writable`` publishes a tiny message: its ack says a quorum is reachable through this connection.

A publish is acknowledged by the stream leader once a quorum of the stream's replicas stored it
(Raft); each node fsyncs per its ``sync_interval`` (docs/replication.md says which setting the promises
need).

A hung server (SIGSTOP, a frozen VM) keeps its sockets open: the connection notices it by its pings
(``ping_interval_s`` x ``max_outstanding_pings``) and moves to another node; a publish waiting there is
sent again on the new connection with the same ``Nats-Msg-Id``, which JetStream stores at most once. A
catalog or snapshot read waiting there is sent again too (``SnapshotObjects.answered``), as is one without
an answer after ``REQUEST_ATTEMPT_S`` (a hung stream leader, until another is elected).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import (
    ObjectStore,
)

from robez_core.errors import BusyError, ConflictError, NotFoundError

from ..faults import NO_FAULTS, Faults
from ..natsauth import NatsAuth
from .log import Appended, CatalogEntry, CatalogEvent, LogEntry, LogTrimmedError
from .natspatch import bound_tls_close
from .objects import SnapshotObjects, unavailable
from .records import SHAPE, update_too_large

logger = logging.getLogger("robez.replication.jetstream")

_MSG_ID = "Nats-Msg-Id"
_EXPECTED_STREAM = "Nats-Expected-Stream"  # what ``js.publish(stream=...)`` adds
_EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
_KV_OPERATION = "KV-Operation"  # a KV bucket's delete marker: "DEL"
_HEADER_LINE = len(b"NATS/1.0\r\n")
# A publish without an ack after this share of the publish timeout is sent again (same Nats-Msg-Id): its
# stream's leader may have hung, and a new one be elected meanwhile.
_PUBLISH_ATTEMPTS = 3
_PUBLISH_RETRY_PAUSE_S = 0.05
# A reader that has seen nothing for this long asks the stream whether it missed something (its
# consumer may have lived on a node that died) and starts a new consumer if so.
_READ_IDLE_S = 1.0
_READ_CHECK_TIMEOUT_S = 2.0
# How often a reader whose idle check is out looks for entries (the check runs beside it).
_READ_POLL_S = 0.05
# At most this many entries, or about this many bytes of payload, in one batch of ``read_batches`` (one
# pass of the applier): a pass of big pushes holds a bounded amount of memory beside nats-py's queue.
READ_BATCH = 64
READ_BATCH_BYTES = 16 << 20
# The timeout of a reader's consumer requests (its subscribe, and the re-creation an ordered consumer
# does by itself after a gap), shorter than the publish timeout: a request that reached the cluster
# between two leaders gets no answer at all, and the reader asks again rather than wait 10 s for it.
_READ_REQUEST_TIMEOUT_S = 3.0
_WATCH_RESYNC_S = 5.0
# JetStream's error code for a publish whose Nats-Expected-Last-Subject-Sequence does not hold.
_WRONG_LAST_SEQUENCE = 10071
_WRONG_LAST_SEQUENCE_CONSTANT = 10164  # the same, as newer servers word it


class JetStreamLog(SnapshotObjects):
    """A ``ReplicatedLog`` over a NATS JetStream cluster.

    Args:
        urls: NATS server URLs (any subset of the cluster's nodes).
        replicas: replication factor of streams and buckets (3 for a 3-node cluster; 1 for development).
        prefix: stream / bucket / subject prefix, so several robez clusters can share one NATS.
        dedup_window_s: how long an append's key suppresses a second append with it.
        client_name: shown by the NATS server's monitoring (the replica name).
        timeout_s: per JetStream API request and per publish (all its attempts together).
        ping_interval_s, max_outstanding_pings: a server that answers no ping for about their product is
            taken for hung and the connection moves to another node.
        auth: credentials and TLS material (``NatsAuth``); None: an unauthenticated plaintext connection.
        lease_ttl_s: a snapshot upload lease not renewed for this long expires (its holder died or hung);
            renewed every third of it. Fixed when the lease bucket is first created.
        faults: testing only, the process's fault hooks (a pause after each uploaded snapshot chunk).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        replicas: int = 3,
        prefix: str = "robez",
        dedup_window_s: float = 600.0,
        client_name: str | None = None,
        timeout_s: float = 10.0,
        ping_interval_s: float = 2.0,
        max_outstanding_pings: int = 2,
        auth: NatsAuth | None = None,
        lease_ttl_s: float = 30.0,
        faults: Faults = NO_FAULTS,
    ) -> None:
        bound_tls_close()  # a hung node's TLS close must not stall reconnects; refuses an unknown nats-py
        self.urls = urls
        self.auth = auth or NatsAuth()
        self.replicas = replicas
        self.prefix = prefix
        self.dedup_window_s = dedup_window_s
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.ping_interval_s = ping_interval_s
        self.max_outstanding_pings = max_outstanding_pings
        self.lease_ttl_s = lease_ttl_s
        self.faults = faults
        self._health_subject = f"{prefix}.health.{secrets.token_hex(6)}"
        # Set (and replaced) at every reconnect: a publish waiting for its ack on the old server resends.
        self._reconnected = asyncio.Event()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._obs: ObjectStore | None = None
        self._leases: KeyValue | None = None

    # -- connection ---------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and make sure the catalog and snapshot buckets exist (creating them is idempotent).
        Raises ``BusyError`` if the cluster does not answer (the caller retries)."""
        try:
            self._nc = await nats.connect(
                servers=self.urls,
                name=self.client_name,
                connect_timeout=2,
                reconnect_time_wait=0.25,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                ping_interval=self.ping_interval_s,
                max_outstanding_pings=self.max_outstanding_pings,
                reconnected_cb=self._on_reconnected,
                error_cb=self._on_error,
                # Replies and pull deliveries (entries with ids and gradients) come to this prefix, which
                # only robez's login may subscribe to; NATS's default `_INBOX.>` is any user's (issue 40.6).
                inbox_prefix=f"_INBOX_{self.prefix}",
                **self.auth.connect_options(),
            )
            logger.info(
                "connected to NATS at %s; max_payload %d bytes", self.connected_to(), self._nc.max_payload
            )
            self._js = self._nc.jetstream(timeout=self.timeout_s)
            self._kv = await self._js.create_key_value(
                KeyValueConfig(
                    bucket=f"{self.prefix}_tables",
                    history=1,
                    replicas=self.replicas,
                    storage=StorageType.FILE,
                    direct=False,  # catalog reads go to the stream leader, never a lagging follower
                )
            )
            self._obs = await self._js.create_object_store(
                f"{self.prefix}_snapshots",
                config=ObjectStoreConfig(replicas=self.replicas, storage=StorageType.FILE),
            )
            self._leases = await self._lease_bucket()
            await self._js.add_stream(
                StreamConfig(
                    name=f"{self.prefix}_health",
                    subjects=[f"{self.prefix}.health.>"],
                    num_replicas=self.replicas,
                    storage=StorageType.MEMORY,
                    max_msgs_per_subject=1,
                    max_age=60.0,
                    discard=DiscardPolicy.OLD,
                )
            )
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            await self.close()
            raise unavailable("connect", exc) from exc

    async def _on_error(self, exc: Exception) -> None:
        # nats-py's default prints a traceback for every refused attempt; a refused login (wrong or missing
        # credentials) or a permission violation must be one clear log line instead.
        logger.warning("NATS: %s: %s", type(exc).__name__, exc)

    async def _lease_bucket(self) -> KeyValue:
        config = KeyValueConfig(
            bucket=f"{self.prefix}_leases",
            history=1,
            ttl=self.lease_ttl_s,
            replicas=self.replicas,
            storage=StorageType.FILE,
            direct=False,
        )
        try:
            return await self.js.create_key_value(config)
        except nats.js.errors.BadRequestError:
            # Created before with another TTL (another replica's setting): the bucket's TTL holds.
            logger.info("the lease bucket exists with another configuration; using it as it is")
            return await self.js.key_value(config.bucket)

    async def _on_reconnected(self) -> None:
        logger.info("reconnected to NATS at %s", self.connected_to())
        moved, self._reconnected = self._reconnected, asyncio.Event()
        moved.set()

    def connected_to(self) -> str | None:
        url = self._nc.connected_url if self._nc is not None else None
        return server_address(url.netloc) if url is not None else None

    async def check_writable(self, timeout_s: float) -> None:
        if self._nc is None or not self._nc.is_connected:
            raise BusyError("not connected to NATS")
        try:
            await self.js.publish(
                self._health_subject, b"", timeout=timeout_s, stream=f"{self.prefix}_health"
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("write check", exc) from exc

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.close()
            except Exception:  # closing a broken connection must not hide the error that broke it
                logger.debug("closing the NATS connection failed", exc_info=True)
        self._nc = self._js = self._kv = self._obs = self._leases = None

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise BusyError("not connected to NATS")
        return self._js

    def _reading_js(self) -> JetStreamContext:
        """A JetStream context for a reader's consumer (``_READ_REQUEST_TIMEOUT_S``)."""
        if self._nc is None:
            raise BusyError("not connected to NATS")
        return self._nc.jetstream(timeout=_READ_REQUEST_TIMEOUT_S)

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise BusyError("not connected to NATS")
        return self._kv

    @property
    def obs(self) -> ObjectStore:
        if self._obs is None:
            raise BusyError("not connected to NATS")
        return self._obs

    # -- names --------------------------------------------------------------------------------------

    def stream_name(self, entry: CatalogEntry) -> str:
        return f"{self.prefix}_{entry.name}_{entry.incarnation}"

    def subject(self, entry: CatalogEntry) -> str:
        return f"{self.prefix}.u.{entry.name}.{entry.incarnation}"

    # -- catalog ------------------------------------------------------------------------------------

    @staticmethod
    def _decode_entry(name: str, value: bytes | None) -> CatalogEntry:
        data = json.loads(value or b"{}")
        return CatalogEntry(name, data["config"], data["optimizer"], data["incarnation"])

    async def create_table(
        self, name: str, config: dict[str, Any], optimizer: dict[str, Any]
    ) -> CatalogEntry:
        # Both requests may be sent twice (``answered``: again on a new connection when a server hangs):
        # adding a stream of the same configuration twice adds it once, and the catalog entry carries a
        # message id, which the catalog's duplicate window answers with the first one's acknowledgement.
        entry = CatalogEntry(name, config, optimizer, secrets.token_hex(6))
        stream = StreamConfig(
            name=self.stream_name(entry),
            subjects=[self.subject(entry)],
            num_replicas=self.replicas,
            storage=StorageType.FILE,
            duplicate_window=self.dedup_window_s,
            allow_direct=True,
        )
        await self.answered("create stream", lambda: self.js.add_stream(stream))
        value = json.dumps({"config": config, "optimizer": optimizer, "incarnation": entry.incarnation})
        try:
            try:
                await self._catalog_write(name, value.encode(), 0, f"create.{entry.incarnation}")
            except nats.js.errors.KeyWrongLastSequenceError:
                # The name has a value: a table, or the marker of a dropped one (written over, as
                # kv.create does).
                try:
                    await self.answered("read catalog", lambda: self.kv.get(name))
                except nats.js.errors.KeyNotFoundError as deleted:  # its entry: the delete marker
                    marker = getattr(deleted, "entry", None)
                    revision = int(marker.revision or 0) if marker is not None else 0
                    await self._catalog_write(name, value.encode(), revision, f"create.{entry.incarnation}")
                else:
                    raise
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            await self._delete_stream(entry)
            raise ConflictError(f"table {name!r} already exists") from exc
        except (TimeoutError, nats.errors.Error, BusyError) as exc:
            await self._delete_stream(entry)
            raise exc if isinstance(exc, BusyError) else unavailable("create table", exc) from exc
        return entry

    async def _catalog_write(
        self, name: str, value: bytes, last: int, key: str, delete: bool = False
    ) -> None:
        """Write (or ``delete``) the catalog entry ``name`` if its revision is still ``last`` (0: none),
        as nats-py's ``KeyValue`` does, with the message id ``key``: sent again on a new connection, it
        is stored once. Raises ``KeyWrongLastSequenceError`` where the revision moved."""
        headers = {_EXPECTED_LAST_SUBJECT_SEQUENCE: str(last), _MSG_ID: key}
        if delete:
            headers[_KV_OPERATION] = "DEL"

        async def publish() -> None:
            try:
                await self.js.publish(f"$KV.{self.prefix}_tables.{name}", value, headers=headers)
            except nats.js.errors.APIError as exc:
                if exc.err_code in (_WRONG_LAST_SEQUENCE, _WRONG_LAST_SEQUENCE_CONSTANT):
                    raise nats.js.errors.KeyWrongLastSequenceError(description=exc.description) from exc
                raise

        await self.answered("write catalog", publish)

    async def get_table(self, name: str) -> CatalogEntry | None:
        try:
            found = await self.answered("read catalog", lambda: self.kv.get(name))
        except nats.js.errors.NotFoundError:  # never created, or deleted
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("read catalog", exc) from exc
        return self._decode_entry(name, found.value)

    async def table_names(self) -> list[str]:
        # Not ``kv.keys()``: it ends at the same early marker as the watch (see ``watch_tables``) and
        # could answer [] for a catalog that has tables (a replica would then add the demo table).
        names: set[str] = set()
        watch = self.watch_tables()
        try:
            async with asyncio.timeout(self.timeout_s):
                async for event in watch:
                    if event.initial_done:
                        return sorted(names)
                    if event.entry is None:
                        names.discard(event.name)
                    else:
                        names.add(event.name)
        except TimeoutError as exc:
            raise unavailable("list catalog", exc) from exc
        finally:
            await watch.aclose()
        raise BusyError("the catalog watch ended; try again")

    async def drop_table(self, name: str) -> None:
        try:
            found = await self.answered("read catalog", lambda: self.kv.get(name))
        except nats.js.errors.NotFoundError as exc:
            raise NotFoundError(f"no table named {name!r}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("read catalog", exc) from exc
        entry = self._decode_entry(name, found.value)
        try:
            await self._catalog_write(name, b"", int(found.revision or 0), f"drop.{entry.incarnation}", True)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise ConflictError(f"table {name!r} changed while being dropped; try again") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("drop table", exc) from exc
        await self._delete_stream(entry)
        with contextlib.suppress(TimeoutError, nats.errors.Error):  # no snapshot yet
            await self.obs.delete(self._snapshot_object(entry))
        # Every chunk of the incarnation, the object's and any an upload in flight or killed left.
        await self._purge_chunks(f"{self._chunk_prefix(entry)}.>")
        try:
            for stored in await self.loads(entry):
                await self.delete_load(entry, stored.name)
        except BusyError as exc:
            logger.warning("table %s dropped; its loaded checkpoints could not be deleted: %s", name, exc)

    async def _delete_stream(self, entry: CatalogEntry) -> None:
        # Sent again on a new connection (``answered``): a stream deleted by the first one is not found.
        try:
            await self.answered("delete stream", lambda: self.js.delete_stream(self.stream_name(entry)))
        except nats.js.errors.NotFoundError:
            pass
        except (TimeoutError, nats.errors.Error, BusyError):
            logger.warning("could not delete stream %s", self.stream_name(entry), exc_info=True)

    async def watch_tables(self) -> AsyncGenerator[CatalogEvent, None]:
        # The watch is restarted every few seconds of silence: its consumer may have lived on a node that
        # died. Each restart replays the whole catalog (last value per key, deletes included), which the
        # caller applies idempotently.
        #
        # The end of the replay is not nats-py's marker (the ``None`` update): the watcher sends it when
        # the consumer reports nothing pending and nothing was received yet, which is also the case while
        # the existing entries are still on their way (measured: 4 watches in 200 on a loaded 3-node
        # cluster got the marker first). A replica then counted the catalog as empty: it was ready with
        # no tables, and on a restarted watch it dropped every table it served. Instead, the catalog's
        # last sequence is read before the watch; the replay is done once an update at or past it came.
        while True:
            try:
                replay_end = await self._catalog_end()
                watcher = await self.kv.watchall()
            except (TimeoutError, nats.errors.Error, BusyError) as exc:
                logger.warning("catalog watch failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            try:
                if replay_end == 0:
                    yield CatalogEvent("", None, initial_done=True)
                while True:
                    try:
                        update = await watcher.updates(timeout=_WATCH_RESYNC_S)
                    except nats.errors.TimeoutError:
                        break
                    if update is None:
                        continue  # nats-py's end-of-replay marker: not trusted (see above)
                    if update.operation in ("DEL", "PURGE") or not update.value:
                        yield CatalogEvent(update.key, None)
                    else:
                        yield CatalogEvent(update.key, self._decode_entry(update.key, update.value))
                    if replay_end and int(update.revision or 0) >= replay_end:
                        replay_end = 0
                        yield CatalogEvent("", None, initial_done=True)
            finally:
                try:
                    await watcher.stop()
                except Exception:
                    logger.debug("stopping the catalog watch failed", exc_info=True)

    async def _catalog_end(self) -> int:
        """The catalog stream's last sequence now (0: it holds nothing). A watch started after this
        replays the last message of each key, and the one at this sequence is one of them (or a later
        update of its key is)."""
        try:
            info = await self.answered(
                "catalog info", lambda: self.js.stream_info(f"KV_{self.prefix}_tables")
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("catalog info", exc) from exc
        return int(info.state.last_seq or 0) if info.state.messages else 0

    # -- updates ------------------------------------------------------------------------------------

    def max_entry_bytes(self) -> int:
        # The connected server's, from its INFO: it may differ from node to node (a config change).
        return int(self._nc.max_payload) if self._nc is not None and self._nc.is_connected else 0

    def entry_bytes(self, entry: CatalogEntry, payload_bytes: int, headers: dict[str, str], key: str) -> int:
        # nats-py's header block: "NATS/1.0\r\n", "Key: value\r\n" each, "\r\n"; the server counts it
        # with the payload against max_payload (and closes the connection of a client that sends more).
        sent = {**headers, _MSG_ID: key, _EXPECTED_STREAM: self.stream_name(entry)}
        block = _HEADER_LINE + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in sent.items()) + 2
        return payload_bytes + block

    async def append(
        self, entry: CatalogEntry, payload: bytes, headers: dict[str, str], key: str
    ) -> Appended:
        deadline = time.monotonic() + self.timeout_s
        failure: BaseException = TimeoutError(f"no ack within {self.timeout_s} s")
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                ack = await self._publish_once(
                    entry,
                    payload,
                    {**headers, _MSG_ID: key},
                    min(remaining, self.timeout_s / _PUBLISH_ATTEMPTS),
                )
                return Appended(int(ack.seq), bool(ack.duplicate))
            except nats.errors.MaxPayloadError as exc:
                # The pre-check (``Replica.update``) passed against another server's limit.
                raise self._too_large(entry, payload, headers, key) from exc
            except nats.js.errors.NotFoundError as exc:
                raise NotFoundError(f"no table named {entry.name!r}") from exc
            except nats.errors.NoRespondersError as exc:
                # No stream listens on the subject: dropped, or (briefly) no leader.
                try:
                    if await self.get_table(entry.name) != entry:
                        raise NotFoundError(f"no table named {entry.name!r}") from exc
                except BusyError:
                    pass
                failure = exc
            except nats.js.errors.APIError as exc:
                if not isinstance(exc, nats.js.errors.ServiceUnavailableError):
                    raise unavailable("publish", exc) from exc
                failure = exc
            except (TimeoutError, nats.errors.Error) as exc:
                failure = exc  # no ack (hung server or leader), or the connection is moving: send again
            await asyncio.sleep(min(_PUBLISH_RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
        raise unavailable("publish", failure)

    async def _publish_once(
        self, entry: CatalogEntry, payload: bytes, headers: dict[str, str], timeout_s: float
    ) -> Any:
        """One publish; ``ConnectionReconnectingError`` as soon as the connection moved to another server
        meanwhile (the ack cannot come back on it)."""
        moved = self._reconnected
        publish = asyncio.ensure_future(
            self.js.publish(
                self.subject(entry),
                payload,
                timeout=timeout_s,
                stream=self.stream_name(entry),
                headers=headers,
            )
        )
        reconnect = asyncio.ensure_future(moved.wait())
        try:
            await asyncio.wait({publish, reconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reconnect.cancel()
            if not publish.done():
                publish.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await publish
        if publish.cancelled():
            raise nats.errors.ConnectionReconnectingError()
        return publish.result()

    def _too_large(
        self, entry: CatalogEntry, payload: bytes, headers: dict[str, str], key: str
    ) -> BaseException:
        try:
            num_rows, dim = (int(part) for part in headers[SHAPE].split(","))
        except (KeyError, ValueError):
            num_rows, dim = 0, 0
        size = self.entry_bytes(entry, len(payload), headers, key)
        return update_too_large(entry.name, num_rows, dim, size, self.max_entry_bytes(), size - len(payload))

    async def read(self, entry: CatalogEntry, after: int) -> AsyncGenerator[LogEntry, None]:
        async with contextlib.aclosing(self.read_batches(entry, after)) as batches:
            async for batch in batches:
                for item in batch:
                    yield item

    async def read_batches(self, entry: CatalogEntry, after: int) -> AsyncGenerator[list[LogEntry], None]:
        """``read``'s entries, each batch every entry delivered so far (up to ``READ_BATCH``): the
        subscription's queue is emptied every time, which is also when nats-py answers the consumer's
        flow control (``PushSubscription.next_msg`` replies only once nothing is left queued; else its
        own loop replies up to 0.25 s later, and the server stops delivering to this reader meanwhile;
        docs/benchmarks/replication-2026-11-27.md has what that cost a push)."""
        position = after
        while True:
            try:
                sub = await self._reading_js().subscribe(
                    self.subject(entry),
                    stream=self.stream_name(entry),
                    ordered_consumer=True,
                    idle_heartbeat=_READ_IDLE_S / 2,
                    config=ConsumerConfig(
                        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=position + 1
                    ),
                )
            except nats.js.errors.NotFoundError as exc:
                raise NotFoundError(f"the log of table {entry.name!r} is gone") from exc
            except (TimeoutError, nats.errors.Error) as exc:
                logger.info("table %s: cannot read the log yet (%s); retrying", entry.name, exc)
                await asyncio.sleep(0.25)
                continue
            # The idle check runs beside the reading, never in its way: while the stream has no leader
            # (its node was killed; the election takes 4-9 s) the check waits its whole timeout, and an
            # entry delivered meanwhile must not wait behind it (measured, leader killed under load: each
            # first push after the election waited 0.1-1.8 s for its apply; now none waits).
            check: asyncio.Future[tuple[int | None, int | None]] | None = None
            try:
                while True:
                    try:
                        msg = await sub.next_msg(timeout=_READ_IDLE_S if check is None else _READ_POLL_S)
                    except nats.errors.TimeoutError:
                        if check is None:
                            check = asyncio.ensure_future(self._bounds_or_unknown(entry))
                            continue
                        if not check.done():
                            continue
                        first, last = check.result()
                        check = None
                        if first is not None and first > position + 1:
                            raise LogTrimmedError(entry.name, position, first) from None
                        if last is not None and last > position:
                            logger.info(
                                "table %s: reader stalled at %d of %d; restarting", entry.name, position, last
                            )
                            break
                        continue
                    if check is not None:  # an entry came: the reader is not stalled
                        check.cancel()
                        check = None
                    messages = await take_queued(sub, msg)
                    batch = []
                    for msg in messages:
                        meta = msg.metadata
                        sequence = int(meta.sequence.stream)
                        if sequence <= position:
                            continue  # redelivered after a consumer reset
                        position = sequence
                        batch.append(
                            LogEntry(
                                sequence,
                                msg.data,
                                dict(msg.headers or {}),
                                meta.timestamp.timestamp() if meta.timestamp is not None else 0.0,
                                int(meta.num_pending or 0),
                            )
                        )
                    if batch:
                        yield batch
            finally:
                if check is not None:
                    check.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await check
                try:
                    await sub.unsubscribe()
                except Exception:
                    logger.debug("unsubscribing the reader failed", exc_info=True)

    async def _bounds_or_unknown(self, entry: CatalogEntry) -> tuple[int | None, int | None]:
        # Briefly: a request sent to a server that hung, or to a stream between leaders, gets no answer;
        # the next check asks again (``read`` keeps taking entries meanwhile).
        try:
            async with asyncio.timeout(_READ_CHECK_TIMEOUT_S):
                first, last = await self.bounds(entry)
        except (BusyError, TimeoutError):
            return None, None
        return first, last

    async def bounds(self, entry: CatalogEntry) -> tuple[int, int]:
        try:
            info = await self.js.stream_info(self.stream_name(entry))
        except nats.js.errors.NotFoundError as exc:
            raise NotFoundError(f"the log of table {entry.name!r} is gone") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("stream info", exc) from exc
        state = info.state
        last = int(state.last_seq or 0)
        first = int(state.first_seq or 0) if state.messages else last + 1
        return first, last

    async def trim(self, entry: CatalogEntry, below: int) -> None:
        if below <= 1:
            return
        try:
            await self.js.purge_stream(self.stream_name(entry), seq=below)
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("trim", exc) from exc


async def take_queued(sub: Any, first: Any) -> list[Any]:
    """``first`` and the messages queued behind it in the subscription ``sub`` (nats-py's), up to
    ``READ_BATCH`` messages or until they hold ``READ_BATCH_BYTES`` of payload."""
    messages, size = [first], len(first.data)
    while sub.pending_msgs and len(messages) < READ_BATCH and size < READ_BATCH_BYTES:
        messages.append(await sub.next_msg(timeout=_READ_POLL_S))
        size += len(messages[-1].data)
    return messages


def server_address(netloc: str) -> str:
    """``host:port`` of a URL's network location, without any ``user:password@`` in it: what robez logs
    and shows on ``/readyz?writes=true`` must never carry a credential that was put in ``--nats``."""
    return netloc.rpartition("@")[2]
