"""Batch webhooks: OpenAI's `batch.*` events, signed as Standard Webhooks, sent from an outbox.

```
  reconcile loop / cancel / create ──► one transaction: batch row → terminal status
                                                     + event row + a delivery row per endpoint
  sender loop (app.py) ──► due deliveries ──► POST url (webhook-id, -timestamp, -signature)
                               ▲  non-2xx or no answer: attempts+1, next try after backoff
```

- **The event shape is OpenAI's** (`openai.types.webhooks.Batch*WebhookEvent`):
  `{"id": "evt_...", "object": "event", "type": "batch.completed", "created_at": <the
  batch's completed_at>, "data": {"id": "batch_..."}}`; also `batch.failed`,
  `batch.expired`, `batch.cancelled`. The receiver reads the batch with the API for the rest.
- **Signatures are Standard Webhooks'**, as OpenAI sends and as the openai SDK's
  `client.webhooks.unwrap(body, headers, secret=...)` verifies them: `webhook-id` (one per
  event and endpoint, the same on every retry: the receiver deduplicates by it),
  `webhook-timestamp` (Unix seconds of this attempt) and `webhook-signature`
  (`v1,` + base64 of HMAC-SHA256 over `f"{id}.{timestamp}.{body}"`, keyed by the endpoint's
  `whsec_` secret decoded from base64).
- **The outbox is the store**: the event and its delivery rows are written in the same
  transaction as the compare-and-set that finishes the batch (store.py `update_batch`), so a
  batch finishes with its events or not at all, and a state change is one event however
  often the loop repeats (only one compare-and-set wins). The sender loop posts due
  deliveries: at least once (a delivery is done only when the endpoint answered 2xx), with
  exponential backoff between tries, claimed row by row so two API replicas do not both
  send one try.
- **Secrets are references**: the settings file names an environment variable per endpoint
  (`secret_env`), never the secret; the store keeps the endpoint's name, never its secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dagster_gpuinfer.batch_api.settings import load_settings_file

log = logging.getLogger(__name__)

EventType = Literal["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
EVENT_TYPES: tuple[str, ...] = EventType.__args__  # type: ignore[attr-defined]
WEBHOOKS_ENV = "GPUINFER_BATCH_WEBHOOKS"
SECRET_PREFIX = "whsec_"
# Standard Webhooks: a secret of 24 to 64 random bytes.
SECRET_BYTES = (24, 64)
# What a failed try keeps of the endpoint's answer or the error.
ERROR_CHARS = 500


class WebhookEndpoint(BaseModel):
    """One URL a tenant's batch events are posted to, and where its secret comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="http(s) URL the events are POSTed to.")
    secret_env: str = Field(
        description="Environment variable holding the endpoint's `whsec_...` signing secret "
        "(the settings never hold the secret itself)."
    )
    name: str | None = Field(
        None, description="Name kept with each delivery; default: the URL.", max_length=128
    )
    events: tuple[EventType, ...] = Field(
        EVENT_TYPES, description="Event types sent here; default all four."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")) or len(url) > 2048:
            raise ValueError(f"{url[:80]!r} is not an http(s) URL of at most 2048 characters")
        return url

    @property
    def key(self) -> str:
        """How deliveries name this endpoint (its secret is looked up by it at send time)."""
        return self.name or self.url

    def secret(self) -> str:
        """The signing secret from `secret_env`.

        Raises:
            ValueError: the variable is unset or does not hold a `whsec_` secret.
        """
        value = os.environ.get(self.secret_env, "")
        check_secret(value, where=f"${self.secret_env} (webhook {self.key})")
        return value


class WebhookSettings(BaseModel):
    """The batch API's webhook endpoints per tenant, and how deliveries are retried.

    Examples:
        >>> hooks = WebhookSettings.model_validate({"tenants": {"acme": [
        ...     {"url": "https://hooks.acme.example/batches", "secret_env": "ACME_WHSEC"}]}})
        >>> [e.url for e in hooks.endpoints_for("acme", "batch.completed")]
        ['https://hooks.acme.example/batches']
    """

    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, list[WebhookEndpoint]] = Field(default_factory=dict)
    first_retry_seconds: float = Field(
        5.0, gt=0, description="Wait after the first failed try; doubled after each."
    )
    max_retry_seconds: float = Field(3600.0, gt=0, description="Longest wait between tries.")
    max_attempts: int = Field(
        12, ge=1, description="Tries before a delivery is given up (about 5 h at the defaults)."
    )
    timeout_seconds: float = Field(10.0, gt=0, description="How long one try waits.")
    send_interval_seconds: float = Field(
        1.0, gt=0, description="How often the sender loop looks for due deliveries."
    )

    @model_validator(mode="after")
    def _unique_endpoint_names(self) -> WebhookSettings:
        for tenant, endpoints in self.tenants.items():
            keys = [endpoint.key for endpoint in endpoints]
            if len(set(keys)) != len(keys):
                raise ValueError(f"tenant {tenant!r} lists one webhook endpoint name twice")
        return self

    def check_secrets(self) -> None:
        """Resolve every endpoint's secret once (serve calls this at start), so a missing
        variable stops the service instead of failing every delivery later."""
        for endpoints in self.tenants.values():
            for endpoint in endpoints:
                endpoint.secret()

    def endpoints_for(self, tenant: str, event_type: str) -> list[WebhookEndpoint]:
        """The tenant's endpoints that take `event_type`."""
        return [e for e in self.tenants.get(tenant, []) if event_type in e.events]

    def endpoint(self, tenant: str, key: str) -> WebhookEndpoint | None:
        return next((e for e in self.tenants.get(tenant, []) if e.key == key), None)

    def retry_delay(self, attempts: int) -> float:
        """Seconds before the next try after `attempts` failed ones: doubling from
        `first_retry_seconds`, at most `max_retry_seconds`."""
        return min(self.first_retry_seconds * 2.0 ** (attempts - 1), self.max_retry_seconds)

    @property
    def enabled(self) -> bool:
        return any(self.tenants.values())


def load_webhook_settings(path: str | os.PathLike | None = None) -> WebhookSettings:
    """The settings from a YAML file (`path`, else `$GPUINFER_BATCH_WEBHOOKS`); none: empty.

    Raises:
        ValueError: the file is not valid settings (a plain `secret:` key among them: the
            settings name variables, never secrets).
    """
    return load_settings_file(WebhookSettings, path, WEBHOOKS_ENV, "webhook settings")


def check_secret(secret: str, *, where: str) -> None:
    """Refuse anything but `whsec_` + base64 of 24-64 bytes, naming `where` it came from."""
    problem = None
    if not secret:
        problem = "is not set"
    elif not secret.startswith(SECRET_PREFIX):
        problem = f"does not start with {SECRET_PREFIX!r}"
    else:
        try:
            size = len(base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True))
        except ValueError:
            size = -1
        low, high = SECRET_BYTES
        if not low <= size <= high:
            problem = f"is not {SECRET_PREFIX} + base64 of {low}-{high} bytes"
    if problem:
        raise ValueError(
            f"{where} {problem}; make one with `python -m dagster_gpuinfer.batch_api webhooks "
            "secret` and give it to the receiver too"
        )


def new_secret() -> str:
    """A fresh signing secret: `whsec_` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def signature(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: `v1,` + base64(HMAC-SHA256(key, id.timestamp.body))."""
    key = base64.b64decode(secret[len(SECRET_PREFIX) :])
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, webhook_id: str, body: bytes, timestamp: int) -> dict[str, str]:
    """The headers of one try: Standard Webhooks' three and the content type."""
    return {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, webhook_id, timestamp, body),
    }


def batch_event(batch_id: str, status: str, created_at: int) -> tuple[str, bytes]:
    """A new event for a batch that reached `status` at `created_at`: its id and body (the
    exact bytes every try sends and signs)."""
    event_id = f"evt_{uuid.uuid4().hex}"
    event = {
        "id": event_id,
        "object": "event",
        "type": f"batch.{status}",
        "created_at": created_at,
        "data": {"id": batch_id},
    }
    return event_id, json.dumps(event, separators=(",", ":")).encode()


def new_webhook_id() -> str:
    return f"wh_{uuid.uuid4().hex}"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a delivery: the event is never re-posted elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def post_event(
    url: str, headers: Mapping[str, str], body: bytes, timeout: float
) -> tuple[bool, str | None]:
    """One try: POST `body`; whether the endpoint took it (2xx), and why not.

    The standard library's client: one request per try needs no pool, and the API adds no
    HTTP client dependency for it."""
    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            status = answer.status
    except urllib.error.HTTPError as exc:
        text = exc.read(200).decode("utf-8", "replace")
        return False, f"HTTP {exc.code}: {text}"[:ERROR_CHARS]
    except (OSError, ValueError) as exc:  # refused, reset, timed out, unknown host
        return False, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    if 200 <= status < 300:
        return True, None
    return False, f"HTTP {status}"


def now_seconds() -> float:
    return time.time()


def deliver_due(store: Any, settings: WebhookSettings) -> int:
    """One pass of the sender: try every due delivery once; returns how many were delivered.

    A try that is not answered 2xx (or not answered) is due again after
    `settings.retry_delay(attempts)`; after `settings.max_attempts` tries it is given up and
    logged. `store` is the `BatchStore` (the outbox)."""
    delivered = 0
    for delivery in store.due_deliveries(now_seconds()):
        # Held for longer than one try can take, so no other sender tries it meanwhile.
        if not store.claim_delivery(delivery, until=now_seconds() + 3 * settings.timeout_seconds):
            continue
        ok = _try_delivery(store, settings, delivery)
        delivered += ok
    return delivered


def _try_delivery(store: Any, settings: WebhookSettings, delivery: dict) -> bool:
    """Sign and post one delivery, and record what came of it."""
    attempts = delivery["attempts"] + 1
    endpoint = settings.endpoint(delivery["tenant"], delivery["endpoint"])
    if endpoint is None:
        error = "the endpoint is no longer in the webhook settings"
        store.record_try(
            delivery["id"], attempts=attempts, delivered=False, next_attempt_at=None, error=error
        )
        log.error("webhook %s (%s) given up: %s", delivery["id"], delivery["type"], error)
        return False
    body = delivery["body"].encode()
    try:
        headers = signed_headers(endpoint.secret(), delivery["id"], body, int(now_seconds()))
    except ValueError as exc:
        ok, error = False, str(exc)[:ERROR_CHARS]
    else:
        ok, error = post_event(endpoint.url, headers, body, settings.timeout_seconds)
    retry_at = None
    if not ok and attempts < settings.max_attempts:
        retry_at = now_seconds() + settings.retry_delay(attempts)
    store.record_try(
        delivery["id"], attempts=attempts, delivered=ok, next_attempt_at=retry_at, error=error
    )
    if not ok:
        what = "given up" if retry_at is None else "will be retried"
        log.warning(
            "webhook %s (%s of %s) to %s, try %d: %s; %s",
            delivery["id"],
            delivery["type"],
            delivery["tenant"],
            endpoint.key,
            attempts,
            error,
            what,
        )
    return ok
