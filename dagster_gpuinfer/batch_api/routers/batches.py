"""`/v1/batches`: create, list, retrieve and cancel batches.

The GETs return the store rows as they are: the service's reconcile loop keeps them up to
date with the runs and partitions, so reading a batch never writes anything.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from dagster_gpuinfer.batch_api.dependencies import ServiceDep, TenantDep
from dagster_gpuinfer.batch_api.routers import ERROR_RESPONSES
from dagster_gpuinfer.batch_api.schemas import (
    BATCH_PAGE_DEFAULT,
    BATCH_PAGE_MAX,
    Batch,
    BatchList,
    CreateBatch,
    ErrorResponse,
    page_ids,
)

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=ERROR_RESPONSES)


@router.post("", response_model=Batch)
def create_batch(service: ServiceDep, tenant: TenantDep, body: CreateBatch) -> Batch:
    """Validate an uploaded file and queue it as a batch (or fail it, naming each bad line)."""
    record = service.create_batch(
        tenant,
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,
        output_expires_after=body.output_expires_after.seconds
        if body.output_expires_after
        else None,
    )
    return Batch.from_record(record)


@router.get("", response_model=BatchList)
def list_batches(
    service: ServiceDep,
    tenant: TenantDep,
    after: Annotated[
        str | None, Query(description="A batch id: the page starts after this batch.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=BATCH_PAGE_MAX)] = BATCH_PAGE_DEFAULT,
) -> BatchList:
    """List the tenant's batches, newest first, a page at a time."""
    records, has_more = service.list_batches(tenant, after=after, limit=limit)
    data = [Batch.from_record(record) for record in records]
    return BatchList(data=data, has_more=has_more, **page_ids(data))


@router.get("/{batch_id}", response_model=Batch)
def retrieve_batch(service: ServiceDep, tenant: TenantDep, batch_id: str) -> Batch:
    """A batch as last reconciled: status, request counts, usage and output files."""
    return Batch.from_record(service.batch(tenant, batch_id))


@router.post(
    "/{batch_id}/cancel",
    response_model=Batch,
    responses={409: {"model": ErrorResponse, "description": "The batch has finished."}},
)
def cancel_batch(service: ServiceDep, tenant: TenantDep, batch_id: str) -> Batch:
    """Cancel a batch: its run is stopped and its committed requests kept as partial output."""
    return Batch.from_record(service.cancel(tenant, batch_id))
