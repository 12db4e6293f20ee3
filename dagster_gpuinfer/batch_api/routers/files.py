"""`/v1/files`: upload batch input, list, retrieve, read and delete files."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from dagster_gpuinfer.batch_api.dependencies import ServiceDep, TenantDep
from dagster_gpuinfer.batch_api.routers import ERROR_RESPONSES
from dagster_gpuinfer.batch_api.schemas import (
    FILE_PAGE_DEFAULT,
    FILE_PAGE_MAX,
    ErrorResponse,
    FileDeleted,
    FileList,
    FileObject,
    page_ids,
)
from dagster_gpuinfer.batch_api.uploads import receive_upload

# The form the route reads itself (uploads.py streams it), documented as FastAPI would.
_UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {
                        "type": "string",
                        "format": "binary",
                        "description": "OpenAI Batch JSONL lines.",
                    },
                    "purpose": {"type": "string", "description": "Only 'batch' is accepted."},
                },
            }
        }
    },
}

router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERROR_RESPONSES)

_JSONL_CONTENT = {
    "description": "The file's bytes: OpenAI Batch JSONL lines.",
    "content": {"application/jsonl": {"schema": {"type": "string", "format": "binary"}}},
}


@router.post(
    "",
    response_model=FileObject,
    responses={413: {"model": ErrorResponse, "description": "The file is over the limit."}},
    openapi_extra={"requestBody": _UPLOAD_BODY},
)
async def upload_file(request: Request, service: ServiceDep, tenant: TenantDep) -> FileObject:
    """Upload a batch input file (streamed into storage under the size limit)."""
    return FileObject.from_record(await receive_upload(request, service, tenant))


@router.get("", response_model=FileList)
def list_files(
    service: ServiceDep,
    tenant: TenantDep,
    purpose: str | None = None,
    after: Annotated[
        str | None, Query(description="A file id: the page starts after this file.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=FILE_PAGE_MAX)] = FILE_PAGE_DEFAULT,
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """List the tenant's files by creation time, a page at a time."""
    records, has_more = service.list_files(
        tenant, purpose=purpose, after=after, limit=limit, order=order
    )
    data = [FileObject.from_record(record) for record in records]
    return FileList(data=data, has_more=has_more, **page_ids(data))


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(service: ServiceDep, tenant: TenantDep, file_id: str) -> FileObject:
    """A file's metadata."""
    return FileObject.from_record(service.file(tenant, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse, responses={200: _JSONL_CONTENT})
def file_content(service: ServiceDep, tenant: TenantDep, file_id: str) -> StreamingResponse:
    """A file's bytes, streamed from the storage (never held whole: an output file of
    embeddings can outgrow the service's memory)."""
    size, chunks = service.file_content(tenant, file_id)
    headers = {"Content-Length": str(size)}
    return StreamingResponse(chunks, media_type="application/jsonl", headers=headers)


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(service: ServiceDep, tenant: TenantDep, file_id: str) -> FileDeleted:
    """Delete a file (a batch already created from it keeps its own copy)."""
    service.delete_file(tenant, file_id)
    return FileDeleted(id=file_id, deleted=True)
