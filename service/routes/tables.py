"""Table management: list, describe, create (optionally sharing an array), delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, status
from starlette.responses import Response

from ..auth import ReadAccess, WriteAccess
from ..codec import CreateTableRequest, TableInfoResponse, TableListResponse, table_info_json
from .deps import StoreDep, compute

router = APIRouter(prefix="/v1/tables", tags=["tables"])


@router.get("", response_model=TableListResponse, summary="Every table with its config and version")
async def list_tables(store: StoreDep, _: ReadAccess) -> dict[str, Any]:
    return {"tables": [table_info_json(store.info(name)) for name in store.names()]}


@router.get("/{name}", response_model=TableInfoResponse, summary="One table's config, version, compression")
async def get_table(name: str, store: StoreDep, _: ReadAccess) -> dict[str, Any]:
    return table_info_json(store.info(name))


@router.post(
    "",
    response_model=TableInfoResponse,
    status_code=status.HTTP_201_CREATED,
    summary="Create a table (its own new array, or share_array_with another table's)",
)
async def create_table(
    body: CreateTableRequest, request: Request, store: StoreDep, _: WriteAccess
) -> dict[str, Any]:
    # Initialising a large array takes a while: off the event loop.
    info = await compute(request, lambda: store.create(body.name, body.spec()))
    request.state.table = body.name
    return table_info_json(info)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a table")
async def delete_table(name: str, request: Request, store: StoreDep, _: WriteAccess) -> Response:
    await compute(request, lambda: store.delete(name))
    return Response(status_code=status.HTTP_204_NO_CONTENT)
