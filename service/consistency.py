"""Read-your-writes: ``X-Robez-Min-Version`` on lookups (both modes).

A client that pushed an update and got version V back may send ``X-Robez-Min-Version: V`` with its next
lookup (to any replica). The server waits, at most ``min_version_wait_ms``, until its copy of the table
is at V or later, then answers; past that it answers 503 with ``Retry-After`` (``BusyError``). The
multi-table lookup takes ``name=V,name=V`` (tables not named are not waited for). A waiting lookup holds
no in-flight slot but one of ``max_version_waiters`` (service/http/admission.py); none free: 503 at once.
"""

from __future__ import annotations

import time

from fastapi import Request

from robez_core.errors import BusyError, InvalidInputError

from .store import TableStore
from .store.writes import WritePath

MIN_VERSION_HEADER = "X-Robez-Min-Version"


def parse_min_versions(header: str | None, default_table: str | None = None) -> dict[str, int]:
    """``"V"`` (for ``default_table``) or ``"name=V,name=V"`` -> {name: V}; 422 on anything else."""
    if header is None or not header.strip():
        return {}
    wanted: dict[str, int] = {}
    try:
        for part in header.split(","):
            name, sep, value = part.strip().rpartition("=")
            if not sep:
                if default_table is None:
                    raise ValueError("a table name is needed: name=V")
                name = default_table
            version = int(value)
            if version < 0:
                raise ValueError("negative version")
            wanted[name.strip()] = max(version, wanted.get(name.strip(), 0))
    except ValueError as exc:
        raise InvalidInputError(
            f"{MIN_VERSION_HEADER} must be a version or name=version,... ({exc}); got {header!r}"
        ) from exc
    return wanted


async def wait_min_versions(request: Request, store: TableStore, wanted: dict[str, int]) -> None:
    """Return once every table in ``wanted`` is at its version here; ``BusyError`` after the wait."""
    if not wanted:
        return
    if all(store.version(name) >= version for name, version in wanted.items()):
        return  # the common case: nothing to wait for, no waiter's place taken
    admission = request.app.state.admission
    if not admission.wait_begins():
        raise BusyError(
            f"{admission.waiting} lookups are waiting for a table version on this worker "
            f"(max_version_waiters={admission.max_waiting}); retry"
        )
    try:
        await _wait(request, store, wanted)
    finally:
        admission.wait_ends()


async def _wait(request: Request, store: TableStore, wanted: dict[str, int]) -> None:
    settings = request.app.state.settings
    timeout_s = settings.min_version_wait_ms / 1000.0
    writes: WritePath = request.app.state.writes
    deadline = time.monotonic() + timeout_s
    for name, version in wanted.items():
        reached = await writes.wait_version(name, version, max(0.0, deadline - time.monotonic()))
        if not reached:
            raise BusyError(
                f"table {name!r} is at version {store.version(name)} here, behind the requested {version}; "
                "retry (this replica is catching up)"
            )
