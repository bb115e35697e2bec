"""The names of the log seam the store uses, where callers of the store have always imported them
(the seam itself is ``service/log/``)."""

from ..log.entry import EntryGroup, SkippedRecord, UpdatePart, UpdateRecord
from ..log.journal import Journal, LogMark, NullJournal, is_storage_full

__all__ = [
    "EntryGroup",
    "Journal",
    "LogMark",
    "NullJournal",
    "SkippedRecord",
    "UpdatePart",
    "UpdateRecord",
    "is_storage_full",
]
