"""503 while the store is unreachable, not a bare 500.

The service keeps nothing of its own: every request reads or writes the store (the key, the
tenant's limits, the rows). While the store's database server restarts or fails over,
SQLAlchemy raises `OperationalError` (connection refused, server closed the connection)
wherever that happens: in the key check (authentication.py, a middleware), in a route, in
the health probe. Unhandled, Starlette answered each with a bare `500 Internal Server
Error` in plain text: a client could not tell an outage to wait out from a bug (seen in
the chaos run, bench/chaos/store_faults.py). `StoreUnavailable`, the outermost middleware,
answers those with 503 in OpenAI's error shape (`code` store_unavailable) and `Retry-After`,
which the openai SDK waits out before its retry.
"""

from __future__ import annotations

import logging

from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dagster_gpuinfer.batch_api.schemas import error_response

log = logging.getLogger(__name__)
# The store's connection failing, not a statement the store refused.
UNREACHABLE = (OperationalError, InterfaceError, DisconnectionError, PoolTimeout)
RETRY_AFTER_SECONDS = 5
MESSAGE = (
    "The batch API's store is unreachable for now (its database did not answer): "
    f"retry in {RETRY_AFTER_SECONDS} s."
)


class StoreUnavailable:
    """ASGI middleware: an unreachable store is a 503 with `Retry-After`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except UNREACHABLE as exc:
            if started:  # an answer is on its way: nothing else can be sent
                raise
            log.warning("%s %s: the store is unreachable: %s", scope["method"], scope["path"], exc)
            answer = error_response(503, MESSAGE, "store_unavailable", None, RETRY_AFTER_SECONDS)
            await answer(scope, receive, send)
