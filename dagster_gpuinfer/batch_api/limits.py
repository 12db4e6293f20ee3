"""Per-tenant rate limits and quotas, answered with 429 and `Retry-After`.

Four limits, each per tenant (the rate one per key of the tenant):

- `requests_per_second` / `burst`: a token bucket per API key over every `/v1` request.
  The bucket lives in the store (`BatchStore.take_token`: one upsert per request, a
  compare-and-set on the bucket's row), so two API replicas behind one store share it: a
  key gets its rate from the service, not from each replica. Per-replica buckets would
  give a key N times its rate behind N replicas, and a load balancer's spread decides
  which requests pass.
- `max_files`: files the tenant holds (uploads and batch outputs).
- `max_stored_bytes`: bytes of those files. Output files count too (what the tenant
  stores is what it costs); the batch API never refuses to write a batch's output, so a
  tenant over its quota is told to delete files before it uploads more.
- `max_batches_in_flight`: batches not yet final (validating, in progress, finalizing,
  cancelling).

Where they are checked: the rate and a first look at the quotas in the `AuthenticateFirst`
middleware, before a byte of the body is read (an upload's announced Content-Length is
weighed against the byte quota there); then again, race-free, when the row is written
(`BatchStore.add_file` and `add_batch` hold a per-tenant lock while they count), and an
upload stops with a 429 as soon as its bytes pass the room its tenant had left.

Settings: a YAML (or JSON) file named by `GPUINFER_BATCH_LIMITS` or `serve --limits`::

    default:                 # every tenant (these are the built-in defaults)
      requests_per_second: 20
      burst: 40
      max_files: 1000
      max_stored_bytes: 10737418240   # 10 GiB
      max_batches_in_flight: 100
    tenants:                 # per tenant: only what differs from `default`
      acme: {max_batches_in_flight: 500}
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dagster_gpuinfer.batch_api.settings import load_settings_file

LIMITS_ENV = "GPUINFER_BATCH_LIMITS"
# What a quota's 429 tells the client to wait before it tries again: freeing a quota takes
# a batch finishing or the tenant deleting files, nothing a client's fast retry can do.
QUOTA_RETRY_SECONDS = 30


class TenantLimits(BaseModel):
    """What one tenant may do."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_second: float = Field(
        20.0, gt=0, description="Requests per second each of the tenant's keys may send."
    )
    burst: int = Field(
        40, ge=1, description="Requests a key may send at once before the rate applies."
    )
    max_files: int = Field(1000, ge=0, description="Files the tenant may hold.")
    max_stored_bytes: int = Field(
        10 * 1024**3, ge=0, description="Bytes the tenant's files may take."
    )
    max_batches_in_flight: int = Field(
        100,
        ge=0,
        description="Batches of the tenant not yet completed, failed, expired or cancelled.",
    )


class LimitSettings(BaseModel):
    """The limits of every tenant: `default`, and each tenant's differences from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: TenantLimits = Field(default_factory=TenantLimits)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _overrides_over_default(cls, data: Any) -> Any:
        """A tenant's entry names only what differs: the rest comes from `default`."""
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict):
            return data
        default = data.get("default") or {}
        if isinstance(default, TenantLimits):
            default = default.model_dump()
        tenants = {
            name: {**default, **(given.model_dump() if isinstance(given, TenantLimits) else given)}
            for name, given in data["tenants"].items()
        }
        return {**data, "tenants": tenants}

    def for_tenant(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)


def load_limit_settings(source: str | None = None) -> LimitSettings:
    """The limits in the YAML file `source` (default `$GPUINFER_BATCH_LIMITS`); the
    built-in defaults without one.

    Raises:
        ValueError: the file is not valid limit settings (the message names the field).
    """
    return load_settings_file(LimitSettings, source, LIMITS_ENV, "limit settings")


def retry_seconds(seconds: float) -> int:
    """A `Retry-After` value: whole seconds, at least 1 (HTTP's delay-seconds)."""
    return max(1, math.ceil(seconds))


def rate_message(limits: TenantLimits, wait: float) -> str:
    return (
        f"Rate limit reached for this API key: {limits.requests_per_second:g} requests per "
        f"second (burst {limits.burst}). Try again in {retry_seconds(wait)} s (the "
        "Retry-After header); spread polling out, or ask the operator for a higher rate."
    )


def files_message(limits: TenantLimits, held: int) -> str:
    return (
        f"File limit reached: this tenant holds {held} files, the limit is "
        f"{limits.max_files}. Delete files you no longer need (DELETE /v1/files/{{id}}; "
        "batch output files count too), then upload again."
    )


def bytes_message(limits: TenantLimits, stored: int, adding: int) -> str:
    return (
        f"Storage limit reached: this tenant stores {stored} bytes and the upload adds "
        f"{adding}, over the limit of {limits.max_stored_bytes}. Delete files you no "
        "longer need (batch output files count too), then upload again."
    )


def batches_message(limits: TenantLimits, in_flight: int) -> str:
    return (
        f"Batch limit reached: this tenant has {in_flight} batches in flight, the limit is "
        f"{limits.max_batches_in_flight}. Wait for some to finish (or cancel some), then "
        "create the batch again."
    )
