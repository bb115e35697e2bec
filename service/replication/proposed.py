"""``ProposedSteps``: the steps this worker prepared for the pushes it published, until its applier
applies them (one validation per push: ``ReplicatedWrites`` prepares a push to validate it; the applier,
when it is this same worker, applies that step instead of hashing and coalescing the entry again).

A step is matched to an entry by the entry's exact bytes (table, shape and lr headers, payload), never
by a key alone: an entry another replica (or anyone) wrote with the same Idempotency-Key but other bytes
gets no step and goes through every check. The checks that read the array (``check_step``) are made at
apply time either way, so the outcome is the same bits on every replica. Memory is bounded: a step not
taken within ``max_age_s``, or beyond the ``max_entries`` newest or ``max_bytes`` of payloads, is
dropped (its entry then is prepared again, as from any other replica).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import NamedTuple

from ..log.entry import Proposed
from .records import LR, SHAPE

# A push waits at most ``apply_wait_s`` (seconds) for its entry to be applied here; a step older than
# this is of an entry that was not published or is far behind: dropped.
MAX_AGE_S = 10.0
# Pushes in flight on one worker at once are a few (one per writer); this bounds a burst.
MAX_ENTRIES = 128
# And in bytes of payload kept (a step is at most about as large as its payload): 128 pushes of 256 x 64
# are 8.6 MB; a few pushes at NATS's 8 MiB entry limit fit.
MAX_BYTES = 64 << 20


class _Kept(NamedTuple):
    table: str
    shape: str
    lr: str
    payload: bytes
    proposed: Proposed
    deadline: float


class ProposedSteps:
    """Prepared steps of this worker's published pushes, keyed by the entry's bytes (thread-safe: put
    on the event loop, taken on the applier's thread)."""

    def __init__(
        self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S, max_bytes: int = MAX_BYTES
    ) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._bytes = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, table: str, payload: bytes, headers: dict[str, str], proposed: Proposed) -> int:
        """Keep ``proposed`` for the entry (``payload``, ``headers``) about to be appended to ``table``'s
        log; returns a token for ``discard``."""
        kept = _Kept(table, headers[SHAPE], headers[LR], payload, proposed, time.monotonic() + self.max_age_s)
        with self._lock:
            self._next += 1
            token = self._next
            self._kept[token] = kept
            self._bytes += len(payload)
            self._prune(time.monotonic())
        return token

    def discard(self, token: int) -> None:
        """Forget a step whose entry was not appended."""
        with self._lock:
            kept = self._kept.pop(token, None)
            if kept is not None:
                self._bytes -= len(kept.payload)

    def take(self, table: str, payload: bytes, headers: dict[str, str]) -> Proposed | None:
        """The step kept for an entry with exactly these bytes (removed), or None."""
        shape, lr = headers.get(SHAPE), headers.get(LR)
        with self._lock:
            if not self._kept:
                return None
            self._prune(time.monotonic())
            for token, kept in self._kept.items():
                if (
                    kept.table == table
                    and kept.shape == shape
                    and kept.lr == lr
                    and len(kept.payload) == len(payload)
                    and kept.payload == payload
                ):
                    del self._kept[token]
                    self._bytes -= len(kept.payload)
                    return kept.proposed
        return None

    def _prune(self, now: float) -> None:
        while self._kept and (
            len(self._kept) > self.max_entries
            or self._bytes > self.max_bytes
            or next(iter(self._kept.values())).deadline < now
        ):
            _, kept = self._kept.popitem(last=False)
            self._bytes -= len(kept.payload)
