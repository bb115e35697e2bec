"""Table management: list, describe, create (optionally sharing an array), delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, status
from starlette.responses import Response

from ..auth import ReadAccess, WriteAccess
from ..codec import TableInfoResponse, TableListResponse, decode_create_json, table_info_json
from ..store import TableInfo
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
async def create_table(request: Request, store: StoreDep, _: WriteAccess) -> dict[str, Any]:
    body = await request.body()
    replica = request.app.state.replica
    if replica is not None:  # through the log, so every replica creates it
        parsed = decode_create_json(body)
        info = await replica.create_table(parsed.name, parsed.spec())
        request.state.table = info.name
        return table_info_json(info)

    def work() -> TableInfo:
        # Read by hand like every other body, so any malformed body is one 422 shape; initialising a
        # large array takes a while, hence off the event loop.
        parsed = decode_create_json(body)
        return store.create(parsed.name, parsed.spec())

    info = await compute(request, work)
    request.state.table = info.name
    return table_info_json(info)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a table")
async def delete_table(name: TableNameParam, request: Request, store: StoreDep, _: WriteAccess) -> Response:
    replica = request.app.state.replica
    if replica is not None:  # through the log, so every replica drops it
        await replica.drop_table(name)
    else:
        await compute(request, lambda: store.delete(name))
    return Response(status_code=status.HTTP_204_NO_CONTENT)
