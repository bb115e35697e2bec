"""The tables of one server in shared memory, and what its workers do with them.

- ``tables.py``: ``TableStore``, the one entry point: lookups, updates, the replicated apply.
- ``registry.py``: ``TableRegistry``, the registry view of one worker (entries, the registry lock,
  publish) and the table's update lock every change of a table takes; what admin and repair use.
- ``journal.py``: the names of the log seam (``service/log/``: ``Journal``, ``UpdatePart``,
  ``UpdateRecord``...) where callers have always imported them.
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
from .journal import UpdatePart
from .tables import TableStore

__all__ = [
    "POOLINGS",
    "TABLE_NAME_PATTERN",
    "Limits",
    "LookupRequestItem",
    "LookupResult",
    "Pooling",
    "TableInfo",
    "TableStore",
    "UpdatePart",
    "UpdateResult",
    "validate_table_name",
]
