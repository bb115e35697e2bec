"""The seam between the table store (the state machine) and a log (what decides order and durability).

Proposals go one way, commits the other: the store validates a push and proposes its records to a log
(``Journal.append``); what the log holds is applied to a table by ``entry.apply_record`` alone, for
live, replayed and replicated entries alike. Nothing here imports the store (``service/store/``) or a
log implementation (``service/wal/``, ``service/replication/``); both import this.

- ``entry.py``: ``UpdatePart`` (what a caller pushes), ``UpdateRecord`` (one table's part, versioned,
  with the ``EntryGroup`` of a multi-table entry), ``SkippedRecord``, and ``apply_record``.
- ``journal.py``: the ``Journal`` protocol the store drives, ``NullJournal`` (keeps nothing), ``LogMark``.
- ``memory.py``: ``MemoryLog``, a ``Journal`` in memory for tests (snapshots and records, replay).
- ``live_copy.py``: ``consistent_copy``, the state at one version copied while updates go on.
- ``state_digest.py``: a table's checksum with no copy of its state (granule hashes, ``StateDigest``).
"""
