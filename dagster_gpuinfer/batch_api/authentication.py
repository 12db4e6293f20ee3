"""The caller's key, checked before a byte of its request body is read.

FastAPI reads a request's body (parses JSON, or spools a multipart form to disk) before it
resolves any dependency, so a key checked only in a dependency is checked after an anonymous
caller has made the server hold what it sent: in issue 40's probe, 990 parts of 1 MiB with no
key took the server from 204 to 1,185 MiB, and a 1 GiB part was spooled to /tmp before the
401. `AuthenticateFirst` is a pure ASGI middleware (Starlette's documented way to act before
the application) that runs ahead of all that: for every `/v1` request it checks the bearer
key, answers 401 (and writes the audit line) without reading the body, and hands the tenant
to the route through `request.state.tenant` (dependencies.py reads it there).

Then it applies the tenant's limits that need no body (limits.py, `BatchService.admit`): the
key's request rate, and for an upload or a create the file, byte and batch quotas, answered
429 with `Retry-After` before the body is read.

It also bounds what a route may be sent: a JSON body is read here, up to
`MAX_JSON_BODY_BYTES` (413 beyond), and replayed to the route; the one upload route
(`POST /v1/files`) streams its body itself, under its own bound (uploads.py).
"""

from __future__ import annotations

import functools

import anyio.to_thread
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dagster_gpuinfer.batch_api.audit import audit_refusal, audit_refused_key
from dagster_gpuinfer.batch_api.schemas import error_response
from dagster_gpuinfer.batch_api.service import ApiError, BatchService
from dagster_gpuinfer.batch_api.store import Tenant

# The largest JSON body a route takes: a create with 16 metadata pairs of 64 and 512
# characters is under 40 KB; 1 MiB leaves room and bounds what a caller can make us hold.
MAX_JSON_BODY_BYTES = 1024 * 1024
UPLOAD_ROUTE = ("POST", "/v1/files")
KEY_REFUSED_MESSAGE = (
    "Incorrect API key provided: send `Authorization: Bearer sk-gpi-...`; create a key "
    "with `python -m dagster_gpuinfer.batch_api keys create --tenant NAME`."
)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class AuthenticateFirst:
    """ASGI middleware: authenticate every `/v1` request before its body is read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == "/v1" or path.startswith("/v1/")):
            await self.app(scope, receive, send)
            return
        service = scope["app"].state.service
        token = bearer_token(Headers(scope=scope).get("authorization"))
        tenant = (
            await anyio.to_thread.run_sync(service.store.authenticate, token) if token else None
        )
        if tenant is None:
            client = scope.get("client")
            audit_refused_key(
                token, method=scope["method"], path=path, client=client[0] if client else None
            )
            response = error_response(401, KEY_REFUSED_MESSAGE, "invalid_api_key")
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        refusal = await _over_a_limit(service, tenant, scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if (scope["method"], path.rstrip("/")) == UPLOAD_ROUTE:
            await self.app(scope, receive, send)
            return
        body = await _bounded_body(scope, receive, MAX_JSON_BODY_BYTES)
        if body is None:
            message = (
                f"{scope['method']} {path}: the request body is over the limit of "
                f"{MAX_JSON_BODY_BYTES} bytes; send a smaller request (upload files with "
                "POST /v1/files)"
            )
            await error_response(413, message, "request_too_large")(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


# The creates whose quota refusals are audit lines (a rate limit's 429s are not: a client
# over its rate sends many, and they change nothing).
_CREATES = {("POST", "/v1/files"): "file.create", ("POST", "/v1/batches"): "batch.create"}


async def _over_a_limit(service: BatchService, tenant: Tenant, scope: Scope) -> Response | None:
    """The 429 answer of a request over one of its tenant's limits, else None."""
    announced = Headers(scope=scope).get("content-length", "")
    admit = functools.partial(
        service.admit,
        tenant,
        method=scope["method"],
        path=scope["path"],
        announced=int(announced) if announced.isdigit() else None,
    )
    try:
        await anyio.to_thread.run_sync(admit)
    except ApiError as exc:
        action = _CREATES.get((scope["method"], scope["path"].rstrip("/")))
        if action is not None and exc.code != "rate_limit_exceeded":
            audit_refusal(tenant, action, None, exc)
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.retry_after)
    return None


async def _bounded_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request's whole body, or None as soon as it is known to be over `limit` bytes
    (from its Content-Length, before reading, or while reading a chunked one)."""
    announced = Headers(scope=scope).get("content-length", "")
    if announced.isdigit() and int(announced) > limit:
        return None
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: the route sees it
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the route the body read here, then the connection's own
    messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
