"""Table management: list, describe, create (optionally sharing an array), delete."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request, status
from starlette.responses import Response

from ..auth import ReadAccess, WriteAccess
from ..codec import TableInfoResponse, TableListResponse, decode_create_json, table_info_json
from ..store import TableStore
from ..store.writes import WritePath
from ..warmup import warm_kind
from .deps import StoreDep, TableNameParam, body_doc, compute

router = APIRouter(prefix="/v1/tables", tags=["tables"])


@router.get("", response_model=TableListResponse, summary="Every table with its config and version")
async def list_tables(store: StoreDep, _: ReadAccess) -> dict[str, Any]:
    return {"tables": [table_info_json(store.info(name)) for name in store.names()]}


@router.get("/{name}", response_model=TableInfoResponse, summary="One table's config, version, compression")
async def get_table(name: TableNameParam, store: StoreDep, _: ReadAccess) -> dict[str, Any]:
    return table_info_json(store.info(name))


@router.post(
    "",
    response_model=TableInfoResponse,
    status_code=status.HTTP_201_CREATED,
    openapi_extra=body_doc("CreateTableRequest"),
    summary="Create a table (its own new array, or share_array_with another table's)",
)
async def create_table(request: Request, _: WriteAccess) -> dict[str, Any]:
    # Read by hand like every other body, so any malformed body is one 422 shape.
    parsed = decode_create_json(await request.body())
    writes: WritePath = request.app.state.writes
    info = await writes.create_table(parsed.name, parsed.spec(), partial(compute, request))
    request.state.table = info.name
    # A new kind of table: its kernels compiled (or loaded) now, not by its first push or lookup.
    store: TableStore = request.app.state.store
    await compute(request, lambda: warm_kind(store.table(info.name)))
    return table_info_json(info)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a table")
async def delete_table(name: TableNameParam, request: Request, _: WriteAccess) -> Response:
    writes: WritePath = request.app.state.writes
    await writes.drop_table(name, partial(compute, request))
    return Response(status_code=status.HTTP_204_NO_CONTENT)
