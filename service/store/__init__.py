"""The tables of one server in shared memory, and what its workers do with them.

- ``tables.py``: ``TableStore``, the one entry point: lookups, updates, the replicated apply.
- ``registry.py``: ``TableRegistry``, the registry view of one worker (entries, the registry lock,
  publish) and the table's update lock every change of a table takes; what admin and repair use.
- ``journal.py``: the ``Journal`` seam the store makes tables durable through (``service/wal/``
  implements it; ``NullJournal`` keeps nothing).
- ``live_copy.py``: ``consistent_copy``, the state at one version copied while updates go on (a lock-free
  copy, then under the lock the rows the log says changed meanwhile): snapshots and checksums.
- ``admin.py``: ``TableAdmin``, behind ``TableStore.create`` / ``create_from`` / ``delete`` / ``restore`` /
  ``snapshot``: the changes of the registry, arrays and counters.
- ``repair.py``: what the next holder of a table's lock does when a worker died holding it (an update, a
  load or a delete cut short), and each kill point it covers.
- ``api.py``: table names, request and capacity limits, the results the routes encode.

Lock order, everywhere: a table's update lock, then the registry lock (``registry.py``).
"""

from .api import (
    POOLINGS,
    TABLE_NAME_PATTERN,
    Limits,
    LookupRequestItem,
    LookupResult,
    Pooling,
    TableInfo,
    UpdateResult,
    validate_table_name,
)
from .tables import TableStore, apply_record

__all__ = [
    "POOLINGS",
    "TABLE_NAME_PATTERN",
    "Limits",
    "LookupRequestItem",
    "LookupResult",
    "Pooling",
    "TableInfo",
    "TableStore",
    "UpdateResult",
    "apply_record",
    "validate_table_name",
]
