"""The HTTP surface: OpenAI's `/v1/files` and `/v1/batches`, as the `openai` SDK calls them.

FastAPI (as vLLM's own OpenAI server), one process, no torch or vllm imported. Errors come
back in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) so the SDK raises
its usual `AuthenticationError` (401), `NotFoundError` (404) and `BadRequestError` (400).
"""

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from dagster_gpuinfer.batch_api.service import ApiError, BatchService
from dagster_gpuinfer.batch_api.store import BATCH_TIMESTAMPS, Tenant

log = logging.getLogger(__name__)

_BATCH_FIELDS = (
    "id",
    "endpoint",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "model",
    *(f"{name}_at" for name in BATCH_TIMESTAMPS),
)


def batch_object(record: dict[str, Any]) -> dict[str, Any]:
    """A store row as OpenAI's Batch object."""
    body = {name: record.get(name) for name in _BATCH_FIELDS}
    body.update(
        object="batch",
        metadata=record.get("metadata"),
        errors=record.get("errors"),
        request_counts={
            "total": record.get("total") or 0,
            "completed": record.get("completed") or 0,
            "failed": record.get("failed") or 0,
        },
        usage=_usage(record),
    )
    return body


def _usage(record: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's `usage` of the rows done so far (null until the batch is first reconciled). The
    engine's prefix-cache hits are not counted per partition, so `input_tokens_details`
    (cached tokens) is left out rather than reported as 0; the models served have no
    separate reasoning tokens."""
    if record.get("input_tokens") is None:
        return None
    prompt, generated = record["input_tokens"], record.get("output_tokens") or 0
    return {
        "input_tokens": prompt,
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def file_object(record: dict[str, Any]) -> dict[str, Any]:
    """A store row as OpenAI's File object."""
    names = ("id", "bytes", "created_at", "filename", "purpose", "status")
    return {"object": "file", **{name: record[name] for name in names}}


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(service: BatchService, *, reconcile_interval: float | None = 5.0) -> FastAPI:
    """The ASGI app over `service`; with `reconcile_interval`, a thread reconciles every
    unfinished batch that often (cancels reach runs, expiries happen, without a poll)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        thread = None
        if reconcile_interval:
            thread = threading.Thread(
                target=_reconcile_loop, args=(service, stop, reconcile_interval), daemon=True
            )
            thread.start()
        yield
        stop.set()
        if thread is not None:
            thread.join(timeout=10)

    app = FastAPI(title="dagster-gpuinfer batch API", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = f"invalid request: {param or 'body'}: {first.get('msg', 'not valid')}"
        return _error(400, message, "invalid_request", param)

    def tenant(request: Request) -> Tenant:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        found = service.store.authenticate(token.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise ApiError(
                401,
                "Incorrect API key provided. Create one with `python -m "
                "dagster_gpuinfer.batch_api keys create --tenant NAME`.",
                code="invalid_api_key",
            )
        return found

    @app.get("/health")
    def health():
        """Unauthenticated liveness/readiness probe: the store answers."""
        service.store.engine.connect().close()
        return {"status": "ok"}

    Caller = Annotated[Tenant, Depends(tenant)]
    _file_routes(app, service, Caller)
    _batch_routes(app, service, Caller)
    return app


def _file_routes(app: FastAPI, service: BatchService, Caller: Any) -> None:
    @app.post("/v1/files")
    def upload(who: Caller, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]):
        data = file.file.read(service.max_bytes + 1)
        record = service.upload(
            who, filename=file.filename or "upload.jsonl", purpose=purpose, data=data
        )
        return file_object(record)

    @app.get("/v1/files")
    def list_files(who: Caller, purpose: str | None = None):
        data = [file_object(r) for r in service.store.list_files(who.name, purpose=purpose)]
        return {"object": "list", "data": data, "has_more": False}

    @app.get("/v1/files/{file_id}")
    def retrieve_file(who: Caller, file_id: str):
        return file_object(service.file(who, file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(who: Caller, file_id: str):
        return Response(service.file_content(who, file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(who: Caller, file_id: str):
        service.delete_file(who, file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def _batch_routes(app: FastAPI, service: BatchService, Caller: Any) -> None:
    @app.post("/v1/batches")
    def create_batch(who: Caller, body: CreateBatch):
        record = service.create_batch(
            who,
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
        )
        return batch_object(record)

    @app.get("/v1/batches")
    def list_batches(who: Caller, after: str | None = None, limit: int = 20):
        records, has_more = service.list_batches(who, after=after, limit=limit)
        data = [batch_object(record) for record in records]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(who: Caller, batch_id: str):
        return batch_object(service.batch(who, batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(who: Caller, batch_id: str):
        return batch_object(service.cancel(who, batch_id))


def _reconcile_loop(service: BatchService, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        try:
            service.reconcile_all()
        except Exception:  # a database or storage hiccup: the next pass tries again
            log.exception("batch reconcile pass failed; retrying in %.0f s", interval)
