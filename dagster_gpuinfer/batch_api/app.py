"""The HTTP surface: OpenAI's `/v1/files` and `/v1/batches`, as the `openai` SDK calls them.

FastAPI laid out as its own docs lay out a bigger application: one `APIRouter` per resource
(routers/), the service and the caller's tenant as dependencies (dependencies.py: the service
lives on `app.state`), a pydantic response model on every route (schemas.py), so
`/openapi.json` is the whole contract. One process, no torch or vllm imported. Errors come
back in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) so the SDK raises
its usual `AuthenticationError` (401), `NotFoundError` (404) and `BadRequestError` (400).

GET requests read the store (their one write is the key's rate-limit token, limits.py).
What a batch's run and partition say reaches its row through the reconcile loop started
here (`reconcile_interval`), never through a GET. With webhook endpoints configured, a
second loop here sends the events that loop leaves in the outbox (webhooks.py).
"""

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from dagster_gpuinfer.batch_api.authentication import AuthenticateFirst
from dagster_gpuinfer.batch_api.dependencies import ServiceDep
from dagster_gpuinfer.batch_api.routers import batches, files
from dagster_gpuinfer.batch_api.schemas import Health, error_response
from dagster_gpuinfer.batch_api.service import ApiError, BatchService
from dagster_gpuinfer.batch_api.unavailable import StoreUnavailable

log = logging.getLogger(__name__)


def create_app(service: BatchService, *, reconcile_interval: float | None = 5.0) -> FastAPI:
    """The ASGI app serving `service`.

    Args:
        service: What the routes call; kept on `app.state.service`.
        reconcile_interval: Seconds between the reconcile loop's passes over unfinished
            batches (runs' progress reaches the rows, cancels reach runs, expiries happen).
            None starts no loop: batches then change only when a test calls
            `service.reconcile_all()`.

    Returns:
        The app; serve it with uvicorn.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        loops = []
        if reconcile_interval:
            loops.append((_reconcile_loop, reconcile_interval, "batch-reconcile"))
        if service.webhooks.enabled:
            loops.append((_webhook_loop, service.webhooks.send_interval_seconds, "batch-webhooks"))
        threads = [
            threading.Thread(
                target=loop, args=(app.state.service, stop, interval), name=name, daemon=True
            )
            for loop, interval, name in loops
        ]
        for thread in threads:
            thread.start()
        yield
        stop.set()
        for thread in threads:
            thread.join(timeout=10)

    app = FastAPI(title="dagster-gpuinfer batch API", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(AuthenticateFirst)
    app.add_middleware(StoreUnavailable)  # added last: outermost, around the key check too
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.add_api_route("/health", health, methods=["GET"], response_model=Health, tags=["health"])
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document less the 422 answers it adds to every route with parameters:
    this app answers a request that fails validation with OpenAI's 400 (`_invalid_request`),
    documented on every router, so a 422 in the contract would be one no client ever gets.
    FastAPI has no switch for this; its docs' way is to post-process the document once."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)  # builds and caches it on app.openapi_schema
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
    return app.openapi_schema


def health(service: ServiceDep) -> Health:
    """Unauthenticated liveness/readiness probe: the store answers."""
    service.store.engine.connect().close()
    return Health()


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, exc.code, exc.param, exc.retry_after)


async def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the first parameter at fault."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    message = f"invalid request: {param or 'body'}: {first.get('msg', 'not valid')}"
    return error_response(400, message, "invalid_request", param)


def _reconcile_loop(service: BatchService, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        try:
            service.reconcile_all()
        except Exception:  # a database or storage hiccup: the next pass tries again
            log.exception("batch reconcile pass failed; retrying in %.0f s", interval)


def _webhook_loop(service: BatchService, stop: threading.Event, interval: float) -> None:
    """Send due webhook deliveries every `interval` seconds until `stop`."""
    while not stop.wait(interval):
        try:
            service.deliver_webhooks()
        except Exception:  # the store hiccuped: the deliveries stay due
            log.exception("webhook pass failed; retrying in %.0f s", interval)
