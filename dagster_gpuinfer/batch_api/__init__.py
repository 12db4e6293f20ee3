"""The OpenAI Batch API (`/v1/files`, `/v1/batches`) served over Dagster.

```
  openai SDK ──► batch API (FastAPI; this package, control plane: no torch/vllm)
                   │ validate lines ─► store row (SQLite | PostgreSQL) + input shard (files root)
                   ▼
  Dagster daemon: batch_api_sensor ──► dynamic partition <batch id> of the routed pipeline
                   ──► run (tags: batch id, tenant, Kueue queue) ──► worker writes chunks
                   ▲                                                  │
  reconcile loop: run status (Dagster instance) + chunk markers / manifest (storage) ─► row
  GET /v1/batches/{id}: the row, read only
```

Design decisions, and why:

- **The API never runs inference and never imports torch or vllm.** It is control plane: it
  validates, records and reports; a Dagster run does the work, so retries, lineage, the UI,
  concurrency pools and the k8s launcher apply to API batches exactly as to any backfill.
- **A batch is a partition.** The routing table (routing.py) maps the lines' `model` and the
  batch's `endpoint` to one batch pipeline (an `inference_assets` pipeline over dynamic
  partitions); the batch id is the partition key. The input is copied to that partition's
  shard when the batch is created, so deleting the uploaded file cannot break a run.
- **The daemon launches the run, not the API** (pipelines.py: a sensor reads the store for
  `in_progress` batches and requests a run keyed by the batch id). Nothing the API process
  holds in memory matters: the store, the Dagster run storage and the output storage hold all
  state, so an API restart mid-batch loses nothing, and a run is requested once (run key).
  The alternative, the webserver's GraphQL, would make the API depend on the webserver being
  up and would put the tenant-to-run mapping in the API's memory between calls.
- **Status is derived, not pushed** (service.py): the reconcile loop (app.py, every few
  seconds) reads the store row, the latest run tagged with the batch id, and the partition's
  chunk markers (rows done so far: counts rise while the run goes) and manifest
  (completion), and writes the row with compare-and-set updates. GETs only read the row, so
  polling costs a SELECT and two pollers cannot race to finalize.
- **The HTTP layer is FastAPI's own layout** (app.py): a router per resource (routers/),
  the service and the tenant as dependencies (dependencies.py), a pydantic model for every
  answer (schemas.py), so `/openapi.json` is the complete contract.
- **Cancel terminates the run** through the instance's run coordinator and publishes the
  committed chunks as partial output; **expiry** after `completion_window` does the same.
  Output and error files are read through `dagster_gpuinfer.storage.read_openai_batch_files`,
  the one function that knows the worker's layout.
- **Tenants**: API keys (bearer, salted SHA-256 of 256 random bits; keys.py) belong to a
  tenant; another tenant's ids answer 404, a bad key 401. The tenant and its Kueue
  LocalQueue travel as run tags; the k8s launcher puts the queue on the worker pod's
  `kueue.x-k8s.io/queue-name` label, so quotas and fair sharing come from Kueue. Every
  create, cancel and delete, every refused create or upload and every 401 is an audit line
  (audit.py; logger `dagster_gpuinfer.batch_api.audit`).
- **Events go out through an outbox** (webhooks.py): the compare-and-set that finishes a
  batch writes its OpenAI-shaped `batch.*` event and a delivery per tenant endpoint in the
  same transaction; a sender loop posts them signed as Standard Webhooks (what the openai
  SDK's `webhooks.unwrap` verifies), retrying with backoff until a 2xx: at least once, one
  event per state change, deduplicable by `webhook-id`. Endpoints come from a settings file
  that names each secret's environment variable, never the secret.
- **The key is checked before the body is read** (authentication.py: FastAPI reads a body
  before it resolves dependencies), uploads stream into storage under their bound
  (uploads.py), and a create streams its file line by line: no request makes the server
  hold a whole file, and none from an unknown caller makes it hold anything.
- **Limits per tenant, shared by the replicas** (limits.py): a token bucket per key in the
  store (one upsert per request), quotas on files, stored bytes and batches in flight
  counted under a per-tenant lock where the row is written; 429 with `Retry-After` and an
  OpenAI-shaped body naming the limit, before the body is read.
"""

from dagster_gpuinfer.batch_api.tags import BATCH_ID_TAG, QUEUE_TAG, TENANT_TAG

__all__ = ["BATCH_ID_TAG", "QUEUE_TAG", "TENANT_TAG"]
