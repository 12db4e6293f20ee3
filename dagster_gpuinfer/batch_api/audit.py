"""The audit log: one JSON line per thing a caller did or was refused, on the logger
`dagster_gpuinfer.batch_api.audit` (route it to its own sink with logging's configuration).

Every line has `ts`, `action`, `tenant`, `key_id` and `id` (the object acted on); a refusal
adds `outcome: "refused"`, the HTTP `status` and the error `code`. A request with a missing,
unknown or revoked key is `auth.refused` with the key id it named (never its secret), the
method, the path and the client address, so a key being guessed or a revoked key still in
use shows in the log, not only in the access log.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from dagster_gpuinfer.batch_api.keys import split_token
from dagster_gpuinfer.batch_api.store import Tenant, now

AUDIT = logging.getLogger(__name__)
# A key id is 12 hex characters; whatever a caller sends in its place is cut to this.
_KEY_ID_CHARS = 32


def audit(tenant: Tenant, action: str, object_id: str | None, **details: Any) -> None:
    """One audit line for an action of `tenant`'s key."""
    record = {"action": action, "tenant": tenant.name, "key_id": tenant.key_id, "id": object_id}
    AUDIT.info(json.dumps({"ts": now(), **record, **details}, sort_keys=True))


def audit_refusal(tenant: Tenant, action: str, object_id: str | None, error: Any) -> None:
    """The audit line of an action refused with an `ApiError` (status, code, param)."""
    audit(
        tenant,
        action,
        object_id,
        outcome="refused",
        status=error.status,
        code=error.code,
        param=error.param,
    )


def audit_refused_key(token: str | None, *, method: str, path: str, client: str | None) -> None:
    """The audit line of a request answered 401: no key, or one that is not valid."""
    parts = split_token(token) if token else None
    record = {
        "action": "auth.refused",
        "tenant": None,
        "key_id": parts[0][:_KEY_ID_CHARS] if parts else None,
        "id": None,
        "outcome": "refused",
        "status": 401,
        "code": "invalid_api_key",
        "reason": "no key" if not token else "invalid key",
        "method": method,
        "path": path[:256],
        "client": client,
    }
    AUDIT.info(json.dumps({"ts": now(), **record}, sort_keys=True))
