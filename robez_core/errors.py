"""One exception hierarchy for the whole project.

The service maps these to HTTP status codes in a single table (``service/errors.py``); the core never
knows about HTTP. Subclasses of ``ValueError`` / ``KeyError`` keep plain-Python callers working.
"""

from __future__ import annotations


class RobezError(Exception):
    """Base class of every error robez raises on purpose."""


class ConfigError(RobezError, ValueError):
    """A table, optimizer or server configuration is invalid (bad dims, sizes, hash name, ...)."""


class InvalidInputError(RobezError, ValueError):
    """A request's data is malformed: wrong shapes or dtypes, ids outside int64, NaN/Inf gradients."""


class LimitExceededError(RobezError, ValueError):
    """A request or configuration is over a configured limit (body size, ids, tables, memory)."""


class NotFoundError(RobezError, KeyError):
    """A named table (or other resource) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "not found"


class ConflictError(RobezError):
    """The resource already exists or is in a state that forbids the operation."""


class BusyError(RobezError):
    """The server is saturated; the caller should retry later."""


class CorruptionError(RobezError):
    """Persisted data failed a checksum or structural check and must not be served."""
