"""`/v1/files`: upload batch input, list, retrieve, read and delete files."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response

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

router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERROR_RESPONSES)

_JSONL_CONTENT = {
    "description": "The file's bytes: OpenAI Batch JSONL lines.",
    "content": {"application/jsonl": {"schema": {"type": "string", "format": "binary"}}},
}


@router.post(
    "",
    response_model=FileObject,
    responses={413: {"model": ErrorResponse, "description": "The file is over the limit."}},
)
def upload_file(
    service: ServiceDep,
    tenant: TenantDep,
    file: Annotated[UploadFile, File(description="OpenAI Batch JSONL lines.")],
    purpose: Annotated[str, Form(description="Only 'batch' is accepted.")],
) -> FileObject:
    """Upload a batch input file."""
    data = file.file.read(service.max_bytes + 1)
    record = service.upload(
        tenant, filename=file.filename or "upload.jsonl", purpose=purpose, data=data
    )
    return FileObject.from_record(record)


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


@router.get("/{file_id}/content", response_class=Response, responses={200: _JSONL_CONTENT})
def file_content(service: ServiceDep, tenant: TenantDep, file_id: str) -> Response:
    """A file's bytes."""
    return Response(service.file_content(tenant, file_id), media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(service: ServiceDep, tenant: TenantDep, file_id: str) -> FileDeleted:
    """Delete a file (a batch already created from it keeps its own copy)."""
    service.delete_file(tenant, file_id)
    return FileDeleted(id=file_id, deleted=True)
