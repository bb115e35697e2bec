"""The object store side of ``JetStreamLog`` (``jetstream.py``): table snapshots in the Object Store
bucket ``<prefix>_snapshots`` (chunk subjects per table incarnation, the upload lease and its
compare-and-set on the object's meta) and the checkpoints of loads. The layout and guarantees are in
``jetstream.py``'s docstring. ``SnapshotObjects`` is a base class of ``JetStreamLog``: the connection
(``js``, ``obs``, the lease bucket) is the log's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import Header, ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.kv import MSG_ROLLUP_SUBJECT, KeyValue
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)

from robez_core.errors import BusyError, ConflictError, CorruptionError

from ..faults import Faults
from .localsnap import SCRATCH_PREFIX
from .log import CatalogEntry, Snapshot, StoredLoad

logger = logging.getLogger("robez.replication.jetstream")

# A snapshot download that has waited this long for its next chunk checks whether the object was replaced
# meanwhile (then it reads the new one, at most this many times in a row).
_SNAPSHOT_CHUNK_IDLE_S = 1.0
_SNAPSHOT_READ_ATTEMPTS = 5
# Snapshot chunks: 1 MiB each, published one at a time (each acknowledged by a quorum before the next),
# read from the file one at a time: an upload holds about one chunk in memory.
SNAPSHOT_CHUNK_BYTES = 1 << 20
# JetStream's error code for a publish whose Nats-Expected-Last-Subject-Sequence does not hold.
_WRONG_LAST_SEQUENCE = 10071
# A read of the catalog or of an object's meta (a JetStream API or KV request) that has no answer after
# this long, or whose connection moved to another server meanwhile, is sent again (``answered``): a hung
# server then costs what noticing it costs (its pings, ~4-6 s) and a hung stream leader what electing
# another costs (NATS: 4-9 s), not the whole ``timeout_s`` per request.
REQUEST_ATTEMPT_S = 2.0
# The failures after which a read is sent again: no answer, nobody listening (no stream leader for a
# moment), the connection moving, JetStream's 503 (no leader).
_RETRIED = (
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.ServiceUnavailableError,
)
T = TypeVar("T")


def unavailable(what: str, exc: BaseException) -> BusyError:
    """The error a NATS failure becomes: the log is unavailable for now (a 503), try again."""
    return BusyError(f"the replicated log is unavailable ({what}: {type(exc).__name__}: {exc}); try again")


class SnapshotObjects:
    """Snapshots and load checkpoints in the Object Store (see the module's docstring)."""

    # Set by ``JetStreamLog``.
    prefix: str
    client_name: str | None
    timeout_s: float
    lease_ttl_s: float
    faults: Faults  # testing only: snapshot_chunk_delay_s
    _leases: KeyValue | None
    _reconnected: asyncio.Event  # set (and replaced) at every reconnect

    async def answered(self, what: str, read: Callable[[], Awaitable[T]]) -> T:
        """``read()``'s answer (a request that may be sent twice: one that changes nothing, or a write
        made idempotent, e.g. by a message id within the stream's duplicate window), sent again after
        ``REQUEST_ATTEMPT_S`` without an answer, at once when the connection moves to another server (the
        answer cannot come back on it), and after the failures of a stream without a leader; ``BusyError``
        (``unavailable``) once ``timeout_s`` has passed. Other errors (not found, say) are ``read``'s."""
        deadline = time.monotonic() + self.timeout_s
        failure: BaseException = TimeoutError(f"no answer within {self.timeout_s} s")
        while (remaining := deadline - time.monotonic()) > 0:
            moved = self._reconnected
            call = asyncio.ensure_future(asyncio.wait_for(read(), min(remaining, REQUEST_ATTEMPT_S)))
            reconnect = asyncio.ensure_future(moved.wait())
            try:
                await asyncio.wait({call, reconnect}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                reconnect.cancel()
                if not call.done():
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await call
            if call.cancelled():
                failure = nats.errors.ConnectionReconnectingError()
                continue  # moved: ask the new server at once
            try:
                return call.result()
            except _RETRIED as exc:
                failure = exc
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        raise unavailable(what, failure)

    @property
    def js(self) -> JetStreamContext:
        raise NotImplementedError  # the connection's (JetStreamLog.js)

    @property
    def obs(self) -> ObjectStore:
        raise NotImplementedError  # the connection's (JetStreamLog.obs)

    # -- snapshots ----------------------------------------------------------------------------------

    @property
    def _bucket(self) -> str:
        return f"{self.prefix}_snapshots"

    @property
    def _obj_stream(self) -> str:
        return OBJ_STREAM_TEMPLATE.format(bucket=self._bucket)

    def _snapshot_object(self, entry: CatalogEntry) -> str:
        return f"{entry.name}.{entry.incarnation}"

    def _chunk_prefix(self, entry: CatalogEntry) -> str:
        return OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self._bucket, obj=self._snapshot_object(entry))

    def _meta_subject(self, name: str) -> str:
        return OBJ_META_PRE_TEMPLATE.format(
            bucket=self._bucket, obj=base64.urlsafe_b64encode(name.encode()).decode()
        )

    async def _purge_chunks(self, subject: str, below: int | None = None) -> None:
        """Purge the chunks on ``subject`` (a wildcard: the incarnation's prefix), those stored before
        sequence ``below`` only if given. Failures are logged: the next commit's purge catches up."""
        try:
            await self.js.purge_stream(self._obj_stream, subject=subject, seq=below)
        except (TimeoutError, nats.errors.Error, BusyError) as exc:
            logger.warning("could not purge snapshot chunks %s: %s", subject, exc)

    async def lease_snapshot(self, entry: CatalogEntry, holder: str) -> SnapshotUpload | None:
        """The right to upload the table's snapshot (see the module doc), or None while another replica
        holds it. The lease renews itself until ``release``; ``stored_position`` is the stored snapshot's
        position when it was taken."""
        key = f"snapshot.{entry.name}.{entry.incarnation}"
        value = json.dumps({"holder": holder, "since": time.time()}).encode()
        if self._leases is None:
            raise BusyError("not connected to NATS")
        try:
            revision = await self._leases.create(key, value)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            # Held by another replica (or this one's previous, unexpired lease). KeyNotFoundError: nats-py's
            # create found the key taken, then gone when it looked again (released meanwhile): next time.
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("snapshot lease", exc) from exc
        upload = SnapshotUpload(self, entry, self._leases, key, value, int(revision))
        try:
            upload.stored_position = await self.snapshot_position(entry)
        except BaseException:
            await upload.release()
            raise
        upload.start()
        return upload

    async def put_snapshot(self, entry: CatalogEntry, snapshot: Snapshot, holder: str = "") -> bool:
        """Lease, upload and release in one: True if stored, False if a snapshot at least as new is stored
        already; ``BusyError`` while another replica holds the lease."""
        upload = await self.lease_snapshot(entry, holder or self.client_name or "")
        if upload is None:
            raise BusyError(f"another replica is uploading the snapshot of {entry.name!r}; try again")
        try:
            return await upload.put(snapshot)
        finally:
            await upload.release()

    async def _stored_meta(self, name: str) -> tuple[ObjectInfo | None, int]:
        """The object's meta as stored now (None if there is none, or it was deleted) and the stream
        sequence of that meta message (0: never written): what a replacing meta must expect."""
        try:
            msg = await self.answered(
                "snapshot info", lambda: self.js.get_last_msg(self._obj_stream, self._meta_subject(name))
            )
        except nats.js.errors.NotFoundError:
            return None, 0
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("snapshot info", exc) from exc
        try:
            info = ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptionError(f"snapshot {name}: unreadable meta: {exc}") from exc
        return (None if info.deleted else info), int(msg.seq or 0)

    async def _upload(self, upload: SnapshotUpload, snapshot: Snapshot) -> bool:
        entry = upload.entry
        name = self._snapshot_object(entry)
        previous, previous_seq = await self._stored_meta(name)
        if previous is not None and _position(previous) >= snapshot.position:
            return False
        nuid = f"{name}.{secrets.token_hex(8)}"
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self._bucket, obj=nuid)
        digest = hashlib.sha256()
        size = chunks = first_seq = 0
        delay = self.faults.snapshot_chunk_delay_s
        try:
            buffer = bytearray(SNAPSHOT_CHUNK_BYTES)
            with open(snapshot.path, "rb", buffering=0) as handle:
                while True:
                    got = await asyncio.to_thread(handle.readinto, buffer)
                    if not got:
                        break
                    payload = bytes(memoryview(buffer)[:got])
                    digest.update(payload)
                    upload.check()
                    ack = await self.js.publish(
                        subject, payload, timeout=self.timeout_s, stream=self._obj_stream
                    )
                    first_seq = first_seq or int(ack.seq)
                    size += got
                    chunks += 1
                    if delay:
                        await asyncio.sleep(delay)  # testing only: a slow upload (service/faults.py)
            await upload.renew()  # the lease holds for a TTL more: long enough to commit
            info = ObjectInfo(
                name=name,
                bucket=self._bucket,
                nuid=nuid,
                size=size,
                chunks=chunks,
                digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest.digest()).decode()),
                mtime=datetime.now(UTC).isoformat(),
                description=json.dumps({"position": snapshot.position}),
                options=ObjectMetaOptions(max_chunk_size=SNAPSHOT_CHUNK_BYTES),
            )
            try:
                await self.js.publish(
                    self._meta_subject(name),
                    json.dumps(info.as_dict()).encode(),
                    timeout=self.timeout_s,
                    stream=self._obj_stream,
                    headers={
                        Header.ROLLUP: MSG_ROLLUP_SUBJECT,
                        Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(previous_seq),
                    },
                )
            except nats.js.errors.APIError as exc:
                if exc.err_code != _WRONG_LAST_SEQUENCE:
                    raise
                # Replaced or deleted since this upload read it: this copy is not needed.
                logger.info("snapshot %s changed during this upload; its chunks are purged", name)
                await self._purge_chunks(subject)
                return False
        except BaseException as exc:
            await asyncio.shield(self._purge_chunks(subject))  # no chunk outlives an aborted upload
            if isinstance(exc, TimeoutError | nats.errors.Error):
                raise unavailable("upload snapshot", exc) from exc
            raise
        if previous is not None and previous.nuid and not previous.nuid.startswith(f"{name}."):
            await self._purge_chunks(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self._bucket, obj=previous.nuid))
        if first_seq:
            await self._purge_chunks(f"{self._chunk_prefix(entry)}.>", below=first_seq)
        return True

    async def get_snapshot(self, entry: CatalogEntry, directory: Path) -> Snapshot | None:
        """The stored snapshot downloaded into a new file in ``directory`` (the caller removes it), or
        None if there is none. Streamed: each chunk is written to the file as it arrives, its size and
        SHA-256 checked on the way. Another replica may replace the object while it is read (its upload
        publishes the new chunks and meta, then purges the old chunks): a read that finds them gone starts
        again from the new meta (nats-py's ``ObjectStore.get`` would wait forever)."""
        name = self._snapshot_object(entry)
        for _ in range(_SNAPSHOT_READ_ATTEMPTS):
            info = await self._snapshot_info(name)
            if info is None:
                return None
            position = _position(info)
            if position < 0:
                return None
            path = directory / f".{SCRATCH_PREFIX}{os.getpid()}-{entry.name}-{secrets.token_hex(4)}.download"
            try:
                complete = await self._read_chunks(name, info, path)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            if complete:
                return Snapshot(position, path)
            path.unlink(missing_ok=True)
            logger.info("snapshot %s was replaced while it was read; reading the new one", name)
        raise BusyError(f"snapshot {name} was replaced {_SNAPSHOT_READ_ATTEMPTS} times while read; try again")

    async def _snapshot_info(self, name: str) -> ObjectInfo | None:
        """The object's meta as stored now; None if there is none (never uploaded, or deleted)."""
        try:
            info = await self.answered("snapshot info", lambda: self.obs.get_info(name))
        except nats.js.errors.NotFoundError:  # ObjectNotFoundError too: never uploaded, or deleted
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("snapshot info", exc) from exc
        return None if info.deleted else info

    async def _read_chunks(self, name: str, info: ObjectInfo, path: Path) -> bool:
        """Write the object's bytes as the meta ``info`` describes them to ``path``, checked against its
        size and SHA-256; False if the object was replaced or deleted meanwhile (its chunks may be gone)."""
        digest = hashlib.sha256()
        size = 0
        with open(path, "wb", buffering=0) as handle:
            if info.size:
                try:
                    sub = await self.js.subscribe(
                        OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self._bucket, obj=info.nuid),
                        stream=self._obj_stream,
                        ordered_consumer=True,
                    )
                except (TimeoutError, nats.errors.Error) as exc:
                    raise unavailable("download snapshot", exc) from exc
                received = 0
                idle = 0.0
                try:
                    while received < (info.chunks or 0):
                        try:
                            msg = await sub.next_msg(timeout=_SNAPSHOT_CHUNK_IDLE_S)
                        except nats.errors.TimeoutError:
                            current = await self._snapshot_info(name)
                            if current is None or current.nuid != info.nuid:
                                return False
                            idle += _SNAPSHOT_CHUNK_IDLE_S
                            if idle >= self.timeout_s:
                                raise BusyError(
                                    f"snapshot {name}: no chunk for {idle:.0f} s; try again"
                                ) from None
                            continue
                        except nats.errors.Error as exc:
                            raise unavailable("download snapshot", exc) from exc
                        idle = 0.0
                        received += 1
                        digest.update(msg.data)
                        size += len(msg.data)
                        view = memoryview(msg.data)
                        while view:
                            view = view[handle.write(view) :]
                finally:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
        encoded = base64.urlsafe_b64encode(digest.digest()).decode()
        if size != info.size or (info.digest or "").split("=", 1)[-1].rstrip("=") != encoded.rstrip("="):
            current = await self._snapshot_info(name)
            if current is None or current.nuid != info.nuid:
                return False
            raise CorruptionError(f"snapshot {name}: its chunks do not match its size and SHA-256")
        return True

    async def snapshot_position(self, entry: CatalogEntry) -> int:
        """Position of the stored snapshot without downloading it; 0 if there is none."""
        info = await self._snapshot_info(self._snapshot_object(entry))
        if info is None:
            return 0
        return max(0, _position(info))

    # -- loads ----------------------------------------------------------------------------------------

    def _load_prefix(self, entry: CatalogEntry) -> str:
        return f"load.{entry.name}.{entry.incarnation}."

    async def put_load(self, entry: CatalogEntry, data: io.BufferedIOBase) -> str:
        # A new name per load: an object is never replaced, so a replica reading it never sees it change.
        name = f"{self._load_prefix(entry)}{secrets.token_hex(8)}"
        try:
            await self.obs.put(
                name, data, meta=ObjectMeta(name=name, description=json.dumps({"position": 0}))
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("upload checkpoint", exc) from exc
        return name

    async def _load_info(self, name: str) -> ObjectInfo | None:
        try:
            info = await self.answered("checkpoint info", lambda: self.obs.get_info(name))
        except nats.js.errors.NotFoundError:  # ObjectNotFoundError too
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("checkpoint info", exc) from exc
        return None if info.deleted else info

    async def get_load(self, entry: CatalogEntry, name: str, into: BinaryIO) -> bool:
        if not name.startswith(self._load_prefix(entry)):
            return False  # not a checkpoint of this table: a forged entry
        info = await self._load_info(name)
        if info is None:
            return False
        if not info.size:
            return True
        bucket = f"{self.prefix}_snapshots"
        try:
            sub = await self.js.subscribe(
                OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid),
                stream=OBJ_STREAM_TEMPLATE.format(bucket=bucket),
                ordered_consumer=True,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("download checkpoint", exc) from exc
        received, idle = 0, 0.0
        try:
            while received < (info.chunks or 0):
                try:
                    msg = await sub.next_msg(timeout=_SNAPSHOT_CHUNK_IDLE_S)
                except nats.errors.TimeoutError:
                    if await self._load_info(name) is None:
                        return False  # deleted meanwhile
                    idle += _SNAPSHOT_CHUNK_IDLE_S
                    if idle >= self.timeout_s:
                        raise BusyError(f"checkpoint {name}: no chunk for {idle:.0f} s; try again") from None
                    continue
                except nats.errors.Error as exc:
                    raise unavailable("download checkpoint", exc) from exc
                idle = 0.0
                received += 1
                into.write(msg.data)  # a chunk (128 KiB) to the page cache: no need to leave the loop
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return True

    async def set_load_position(self, entry: CatalogEntry, name: str, position: int) -> None:
        if not name.startswith(self._load_prefix(entry)):
            return  # not a checkpoint of this table: a forged entry, which must not touch another's
        info = await self._load_info(name)
        if info is None or _described_position(info) >= position:
            return
        try:
            await self.obs.update_meta(
                name, ObjectMeta(name=name, description=json.dumps({"position": position}))
            )
        except nats.js.errors.NotFoundError:  # deleted meanwhile: nothing to record
            return
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("record checkpoint position", exc) from exc

    async def loads(self, entry: CatalogEntry) -> list[StoredLoad]:
        prefix = self._load_prefix(entry)
        try:
            # Not ``answered``: a listing reads every object's meta, which may take longer than an attempt.
            listed = await self.obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:  # an empty bucket
            return []
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("list checkpoints", exc) from exc
        now = time.time()
        return [
            StoredLoad(info.name, _described_position(info), max(0.0, now - _mtime(info)))
            for info in listed
            if info.name and info.name.startswith(prefix) and not info.deleted
        ]

    async def delete_load(self, entry: CatalogEntry, name: str) -> None:
        # The object store's delete keeps a meta message per name (a tombstone): purged too, so that
        # nothing of a load outlives it.
        bucket = f"{self.prefix}_snapshots"
        meta_subject = OBJ_META_PRE_TEMPLATE.format(
            bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode()
        )
        try:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.obs.delete(name)
            await self.js.purge_stream(OBJ_STREAM_TEMPLATE.format(bucket=bucket), subject=meta_subject)
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("delete checkpoint", exc) from exc


def _described_position(info: ObjectInfo) -> int:
    try:
        return int(json.loads(info.description or "{}").get("position", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


def _mtime(info: ObjectInfo) -> float:
    try:
        return datetime.fromisoformat(info.mtime or "").timestamp()
    except ValueError:
        return time.time()  # unknown: counted as new


def _position(info: ObjectInfo) -> int:
    try:
        return int(json.loads(info.description or "{}").get("position", -1))
    except (ValueError, TypeError, AttributeError):
        return -1


class SnapshotUpload:
    """A held snapshot upload lease (``JetStreamLog.lease_snapshot``): renewed in the background every
    third of the TTL until ``release``; ``put`` uploads under it."""

    def __init__(
        self, log: SnapshotObjects, entry: CatalogEntry, kv: KeyValue, key: str, value: bytes, revision: int
    ) -> None:
        self.log = log
        self.entry = entry
        self.stored_position = 0
        self._kv = kv
        self._key = key
        self._value = value
        self._revision = revision
        self._lost: str | None = None
        self._keeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._keeper = asyncio.create_task(self._keep(), name=f"robez-lease-{self.entry.name}")

    async def _keep(self) -> None:
        while self._lost is None:
            await asyncio.sleep(self.log.lease_ttl_s / 3)
            # BusyError: retried next period (lost once the TTL passes); ConflictError: lost, and ``put``
            # finds it so.
            with contextlib.suppress(BusyError, ConflictError):
                await self.renew()

    async def renew(self) -> None:
        """Extend the lease by a TTL from now; ``ConflictError`` if it was lost (expired and taken)."""
        self.check()
        try:
            self._revision = int(await self._kv.update(self._key, self._value, last=self._revision))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            self._lost = "expired and taken by another replica"
            raise ConflictError(f"the snapshot lease of {self.entry.name!r} was lost") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise unavailable("renew snapshot lease", exc) from exc

    def check(self) -> None:
        if self._lost is not None:
            raise ConflictError(f"the snapshot lease of {self.entry.name!r} was lost ({self._lost})")

    async def put(self, snapshot: Snapshot) -> bool:
        """Upload ``snapshot`` (its file, streamed chunk by chunk) as the table's snapshot; then purge the
        previous object's chunks and any older ones. False (nothing kept) if a snapshot at least as new is
        stored, or one was stored or the table dropped during the upload. On any error or cancellation
        the chunks sent are purged."""
        return await self.log._upload(self, snapshot)

    async def release(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._keeper
        if self._lost is None:
            self._lost = "released"
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await self._kv.delete(self._key, last=self._revision)
