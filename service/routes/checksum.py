"""A table's checksum at one version: operators and tests compare replicas with it (both modes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..auth import ReadAccess
from .deps import StoreDep, TableNameParam, compute

router = APIRouter(prefix="/v1/tables", tags=["tables"])


@router.get(
    "/{name}/checksum",
    summary="sha256 over the table's array and optimizer state, taken at one version",
)
async def checksum(name: TableNameParam, request: Request, store: StoreDep, _: ReadAccess) -> dict[str, Any]:
    version, digest = await compute(request, lambda: store.checksum(name))
    request.state.table = name
    return {"name": name, "version": version, "sha256": digest}
