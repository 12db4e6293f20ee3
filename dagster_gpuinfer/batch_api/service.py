"""What the endpoints do, without HTTP: upload, create, reconcile, cancel, list.

A batch's status is not pushed by anyone; the service's reconcile loop (`reconcile_all`, on
a timer in app.py) derives it from three sources of truth that survive restarts of this
process: the store row (what the tenant asked for, and terminal outcomes), the Dagster run
tagged with the batch id (queued, running, failed, cancelled), and the partition's chunk
markers and manifest in the output storage (rows done so far, and completion), and writes
it to the store row. Reads (`file`, `batch`, `list_files`, `list_batches`) return the rows
as they are and write nothing; only creates, cancels, deletes and the loop write.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dagster_gpuinfer.batch_api.audit import audit, audit_refusal
from dagster_gpuinfer.batch_api.files import FileBytes
from dagster_gpuinfer.batch_api.limits import (
    QUOTA_RETRY_SECONDS,
    LimitSettings,
    TenantLimits,
    batches_message,
    bytes_message,
    files_message,
    rate_message,
    retry_seconds,
)
from dagster_gpuinfer.batch_api.routing import Route, RoutingTable
from dagster_gpuinfer.batch_api.store import FILES, BatchStore, QuotaExceeded, Tenant, now
from dagster_gpuinfer.batch_api.tags import BATCH_ID_TAG
from dagster_gpuinfer.batch_api.validation import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_REQUESTS,
    ValidatedInput,
    validate_batch_input,
)
from dagster_gpuinfer.batch_api.webhooks import WebhookSettings, deliver_due
from dagster_gpuinfer.sinks.batch_output import write_batch
from dagster_gpuinfer.sinks.pgvector_write import SinkError
from dagster_gpuinfer.storage import RowCounts, partition_progress

ACTIVE = ("in_progress", "cancelling", "finalizing")
log = logging.getLogger(__name__)
_WINDOW = re.compile(r"(\d{1,5})([smh])")
# OpenAI's one window; shorter ones are accepted (tests, small jobs), longer ones are not.
MAX_WINDOW_SECONDS = 24 * 3600
# A cancelled run that has not stopped after this long is finalized anyway.
CANCEL_GRACE_SECONDS = 120
# A batch validating this long was left by a service that died inside the create request.
VALIDATION_TIMEOUT_SECONDS = 600
# An upload still unfinished this long after it began was left by a request that died.
UPLOAD_TIMEOUT_SECONDS = 3600
# The codes of a sink's failure on a batch: the server or the storage failed (retried), or
# the sink refused the rows or its settings are wrong (not retried: the batch fails).
SINK_UNAVAILABLE, SINK_REFUSED = "sink_unavailable", "sink_refused"
# A completed batch whose route's sink fails retryably is retried this long, then failed.
SINK_RETRY_SECONDS = 3600
# OpenAI's bounds on `output_expires_after.seconds`: 1 hour to 30 days.
OUTPUT_EXPIRY_SECONDS = (3600, 30 * 24 * 3600)


class ApiError(Exception):
    """An error the API answers with OpenAI's error shape; `retry_after` (seconds) becomes
    the answer's `Retry-After` header (429s)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after


def quota_error(limits: TenantLimits, refused: QuotaExceeded, adding: int = 0) -> ApiError:
    """The 429 of a write refused at a quota: what the tenant holds, the limit, what to do."""
    if refused.what == "files":
        message, code = files_message(limits, refused.held), "file_limit_exceeded"
    elif refused.what == "bytes":
        message = bytes_message(limits, refused.held, adding)
        code = "storage_limit_exceeded"
    else:
        message, code = batches_message(limits, refused.held), "batch_limit_exceeded"
    return ApiError(429, message, code=code, retry_after=QUOTA_RETRY_SECONDS)


def not_found(what: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {what} found with id {object_id!r}.", code="not_found")


def check_filename(filename: str) -> None:
    """Refuse a filename the store cannot hold (PostgreSQL: too long, or a NUL) or that
    would corrupt a log line or a header (control characters)."""
    limit = FILES.c.filename.type.length
    problem = None
    if not filename:
        problem = "is empty"
    elif len(filename) > limit:
        problem = f"has {len(filename)} characters, more than {limit}"
    elif any(ord(c) < 32 or ord(c) == 127 for c in filename):
        problem = "holds control characters"
    if problem:
        raise ApiError(
            400,
            f"the file name {filename[:40]!r} {problem}; rename the file and upload it again",
            code="invalid_request",
            param="file",
        )


def check_purpose(purpose: str) -> None:
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose {purpose[:40]!r} is not supported here; upload batch input with "
            "purpose='batch'",
            code="invalid_request",
            param="purpose",
        )


class Upload:
    """A file being written: its row (status `uploaded`) is in the store, its bytes go to
    `writer` as they come; `abandon()` deletes both."""

    def __init__(
        self,
        service: BatchService,
        tenant: Tenant,
        record: dict,
        writer: Any,
        room: int | None = None,
    ):
        self.service, self.tenant, self.record, self.writer = service, tenant, record, writer
        self.size = 0
        self.room = room  # bytes the tenant's storage quota had left when the upload began

    def write(self, data: bytes) -> None:
        """Write the next bytes.

        Raises:
            ApiError: 429 when they take the upload past the room its tenant had left.
        """
        if self.room is not None and self.size + len(data) > self.room:
            limits = self.service.limits.for_tenant(self.tenant.name)
            stored = limits.max_stored_bytes - self.room
            raise quota_error(limits, QuotaExceeded("bytes", stored), self.size + len(data))
        self.writer.write(data)
        self.size += len(data)

    def abandon(self) -> None:
        try:
            self.writer.close()
        finally:
            self.service.files.delete(self.record["path"])
            self.service.store.delete_file(self.record["id"], self.tenant.name)


def window_seconds(window: str) -> int:
    """The seconds of a `completion_window` ('24h', '30m', '90s'), at most 24 hours.

    Bounded before it reaches the store: a 17-character window overflowed its column on
    PostgreSQL, and a huge number overflowed SQLite's integer, both as 500s."""
    match = _WINDOW.fullmatch(window)
    seconds = int(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]] if match else None
    if seconds is None or not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise ApiError(
            400,
            f"completion_window {window[:40]!r} is not supported; use '24h' (or a shorter "
            "window such as '30m' or '90s'; at most 24h)",
            code="invalid_request",
            param="completion_window",
        )
    return seconds


@dataclass
class BatchService:
    """The batch API's behaviour over its store, file bytes, routes and Dagster instance.

    Args:
        store: Tenants, keys, files, batches.
        files: File bytes in the output storage.
        routes: The routing table (also read by the code location's batch pipelines).
        instance: The Dagster instance whose runs do the work (`DagsterInstance.get()`).
        max_requests, max_bytes: Limits of one batch input file.
        webhooks: Each tenant's webhook endpoints (webhooks.py); none: no events are kept.
        output_expiry_seconds: Bounds on `output_expires_after.seconds` (OpenAI's: an hour
            to 30 days).
        sink_retry_seconds: How long a completed batch whose route's sink fails retryably
            stays `finalizing` (the sink tried again on each reconcile pass) before it fails.
    """

    store: BatchStore
    files: FileBytes
    routes: RoutingTable
    instance: Any
    max_requests: int = DEFAULT_MAX_REQUESTS
    max_bytes: int = DEFAULT_MAX_BYTES
    webhooks: WebhookSettings = field(default_factory=WebhookSettings)
    output_expiry_seconds: tuple[int, int] = OUTPUT_EXPIRY_SECONDS
    limits: LimitSettings = field(default_factory=LimitSettings)
    sink_retry_seconds: float = SINK_RETRY_SECONDS

    # ---------------------------------------------------------------- limits

    def admit(self, tenant: Tenant, *, method: str, path: str, announced: int | None) -> None:
        """The limits a request meets before its body is read (limits.py): its key's rate;
        for an upload the file quota and, with the length it `announced`, the byte quota;
        for a create the batches in flight. The writes check the quotas again, race-free.

        Raises:
            ApiError: 429 naming the limit, with `retry_after`.
        """
        limits = self.limits.for_tenant(tenant.name)
        wait = self.store.take_token(
            tenant.key_id, rate=limits.requests_per_second, burst=limits.burst, at=time.time()
        )
        if wait > 0:
            raise ApiError(
                429,
                rate_message(limits, wait),
                code="rate_limit_exceeded",
                retry_after=retry_seconds(wait),
            )
        route = (method, path.rstrip("/"))
        if route not in (("POST", "/v1/files"), ("POST", "/v1/batches")):
            return
        held = self.store.usage(tenant.name)
        if route == ("POST", "/v1/batches"):
            if held.batches_in_flight >= limits.max_batches_in_flight:
                raise quota_error(limits, QuotaExceeded("batches", held.batches_in_flight))
        elif held.files >= limits.max_files:
            raise quota_error(limits, QuotaExceeded("files", held.files))
        elif held.stored_bytes + (announced or 0) > limits.max_stored_bytes:
            raise quota_error(limits, QuotaExceeded("bytes", held.stored_bytes), announced or 0)

    # ---------------------------------------------------------------- files

    def upload(self, tenant: Tenant, *, filename: str, purpose: str, data: bytes) -> dict:
        """A new file holding `data` (the HTTP route streams instead: uploads.py)."""
        if len(data) > self.max_bytes:
            raise self.refuse_upload(
                tenant,
                ApiError(
                    413,
                    f"{filename}: {len(data)} bytes is more than the limit of {self.max_bytes}",
                    code="file_too_large",
                    param="file",
                ),
            )
        try:
            upload = self.begin_upload(
                tenant, filename=filename, purpose=purpose, reserve=len(data)
            )
            upload.write(data)
        except ApiError as exc:
            raise self.refuse_upload(tenant, exc) from None
        return self.finish_upload(upload, purpose)

    def begin_upload(
        self, tenant: Tenant, *, filename: str, purpose: str | None, reserve: int = 0
    ) -> Upload:
        """Check what a file's row needs, write the row (status `uploaded`), open the bytes.

        `purpose` may be None when the form sends it after the file part: `finish_upload`
        checks it then. The row comes first so that bytes never exist without one. It is
        written within the tenant's file and byte quotas, holding `reserve` bytes (the
        request's announced length) until the upload finishes, so concurrent uploads on any
        replica cannot together pass the byte quota.

        Raises:
            ApiError: 400 for a filename the store cannot hold or a purpose other than batch;
                429 when the tenant is at its file or byte quota.
        """
        check_filename(filename)
        if purpose is not None:
            check_purpose(purpose)
        file_id = f"file-{uuid.uuid4().hex}"
        record = {
            "id": file_id,
            "tenant": tenant.name,
            "purpose": "batch",
            "filename": filename,
            "bytes": reserve,
            "created_at": now(),
            "status": "uploaded",
            "path": self.files.file_uri(file_id),
        }
        limits = self.limits.for_tenant(tenant.name)
        try:
            held = self.store.add_file(
                record, max_files=limits.max_files, max_bytes=limits.max_stored_bytes
            )
        except QuotaExceeded as refused:
            raise quota_error(limits, refused, reserve) from None
        try:
            writer = self.files.open_writer(record["path"])
        except BaseException:
            self.store.delete_file(file_id, tenant.name)
            raise
        room = None if held is None else limits.max_stored_bytes - held.stored_bytes
        return Upload(self, tenant, record, writer, room)

    def finish_upload(self, upload: Upload, purpose: str | None) -> dict:
        """Close the bytes and mark the row `processed`; an upload refused here is deleted.

        Raises:
            ApiError: 400 when the form had no purpose, or not 'batch'.
        """
        if purpose is None:
            raise ApiError(
                400,
                f"{upload.record['filename']}: the form has no 'purpose' field; send "
                "purpose='batch'",
                code="missing_required_parameter",
                param="purpose",
            )
        check_purpose(purpose)
        upload.writer.close()
        record = {**upload.record, "bytes": upload.size, "status": "processed"}
        self.store.put_file(record)
        audit(
            upload.tenant,
            "file.create",
            record["id"],
            outcome="created",
            status=200,
            bytes=upload.size,
            filename=record["filename"],
        )
        return record

    def refuse_upload(self, tenant: Tenant, error: ApiError) -> ApiError:
        """Audit a refused upload; returns the error to raise."""
        audit_refusal(tenant, "file.create", None, error)
        return error

    def sweep_abandoned_uploads(self) -> None:
        """Delete uploads still `uploaded` long after they began: their request died with
        the service (the row was written first, so the bytes are found by it)."""
        for record in self.store.files_uploading_since(now() - UPLOAD_TIMEOUT_SECONDS):
            self.files.delete(record["path"])
            self.store.delete_file(record["id"], record["tenant"])
            log.warning("deleted upload %s left unfinished by a dead request", record["id"])

    def file(self, tenant: Tenant, file_id: str) -> dict:
        record = self.store.get_file(file_id, tenant.name)
        if record is None:
            raise not_found("file", file_id)
        return record

    def file_content(self, tenant: Tenant, file_id: str) -> tuple[int, Iterator[bytes]]:
        """The file's size and its bytes as a stream (`FileBytes.stream`)."""
        return self.files.stream(self.file(tenant, file_id)["path"])

    def list_files(
        self,
        tenant: Tenant,
        *,
        purpose: str | None,
        after: str | None,
        limit: int,
        order: str = "desc",
    ) -> tuple[list[dict], bool]:
        """One page of the tenant's files, and whether more follow (read only)."""
        return self.store.list_files(
            tenant.name, purpose=purpose, after=after, limit=limit, order=order
        )

    def delete_file(self, tenant: Tenant, file_id: str) -> None:
        record = self.file(tenant, file_id)
        if self.store.delete_file(file_id, tenant.name):
            self.files.delete(record["path"])
            audit(tenant, "file.delete", file_id)

    # ---------------------------------------------------------------- batches

    def create_batch(
        self,
        tenant: Tenant,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        output_expires_after: int | None = None,
    ) -> dict:
        """Validate the input file, then queue it (status in_progress) or fail it.

        `output_expires_after`: seconds its output and error files are kept after they are
        written (OpenAI's `output_expires_after.seconds`, anchor `created_at`); None: kept.

        The file is read as a stream, line by line, and copied to the batch's shard inside
        the storage, never held whole (a 198 MB file took 609 MiB). Every status change is
        compare-and-set from `validating`: a cancel that lands during validation wins, and
        the batch is never queued after it.
        """
        try:
            record, source = self._new_batch(
                tenant,
                input_file_id,
                endpoint,
                completion_window,
                metadata,
                self.output_lifetime(output_expires_after),
            )
        except ApiError as exc:
            audit_refusal(tenant, "batch.create", None, exc)
            raise
        checked = self._validate(record, source)
        batch_id = record["id"]
        if checked.errors or checked.route is None:
            self.store.update_batch(
                batch_id,
                when_status=("validating",),
                notify=self.notify(tenant.name, "failed"),
                status="failed",
                failed_at=now(),
                total=checked.total,
                errors={"object": "list", "data": checked.errors},
            )
        else:
            # The shard first, the status second: the sensor queues only in_progress batches.
            shard = self.files.copy_batch_input(source["path"], batch_id)
            queued = self.store.update_batch(
                batch_id,
                when_status=("validating",),
                status="in_progress",
                in_progress_at=now(),
                total=checked.total,
                model=checked.model,
                pipeline=checked.route.pipeline,
                input_tokens=0,
                output_tokens=0,
            )
            if not queued:  # cancelled while it was validated: nothing may run it
                self.files.delete(shard)
        created = self.batch(tenant, batch_id)
        audit(
            tenant,
            "batch.create",
            batch_id,
            outcome=created["status"],
            status=200,
            input_file_id=input_file_id,
            endpoint=endpoint,
        )
        return created

    def _new_batch(
        self,
        tenant: Tenant,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        output_expires_after: int | None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Check the request, then write the batch's row (status validating); returns the
        row and its input file's row.

        Raises:
            ApiError: 400 for a window or endpoint not served, 404 for an unknown file,
                409 for a file still being uploaded, 429 when the tenant has its limit of
                batches in flight.
        """
        window = window_seconds(completion_window)
        if not self.routes.models_on(endpoint):
            served = sorted({route.endpoint for route in self.routes.routes})
            raise ApiError(
                400,
                f"endpoint {endpoint[:80]!r} is not served here; use one of {served}",
                code="invalid_request",
                param="endpoint",
            )
        source = self.store.get_file(input_file_id, tenant.name)
        if source is None or source["purpose"] != "batch":
            raise not_found("file", input_file_id[:80])
        if source["status"] != "processed":
            raise ApiError(
                409,
                f"file {input_file_id} is still being uploaded; create the batch once its "
                "upload has finished",
                code="file_not_ready",
                param="input_file_id",
            )
        created = now()
        record: dict[str, Any] = {
            "id": f"batch_{uuid.uuid4().hex}",
            "tenant": tenant.name,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "metadata": metadata,
            "status": "validating",
            "created_at": created,
            "expires_at": created + window,
            "output_expires_after": output_expires_after,
        }
        limits = self.limits.for_tenant(tenant.name)
        try:
            self.store.add_batch(record, max_in_flight=limits.max_batches_in_flight)
        except QuotaExceeded as refused:
            raise quota_error(limits, refused) from None
        return record, source

    def output_lifetime(self, seconds: int | None) -> int | None:
        """`output_expires_after.seconds` checked against `output_expiry_seconds`.

        Raises:
            ApiError: 400 naming `output_expires_after.seconds` when out of bounds.
        """
        low, high = self.output_expiry_seconds
        if seconds is not None and not low <= seconds <= high:
            raise ApiError(
                400,
                f"output_expires_after.seconds is {seconds}; give between {low} and {high} "
                "seconds, or leave output_expires_after out to keep the output files",
                code="invalid_request",
                param="output_expires_after.seconds",
            )
        return seconds

    def _validate(self, record: dict[str, Any], source: dict[str, Any]) -> ValidatedInput:
        """The input file checked line by line; whatever breaks the check itself fails the
        batch with a reason, so it never sits in `validating` until the timeout."""
        try:
            return validate_batch_input(
                self.files.lines(source["path"]),
                size=source["bytes"],
                endpoint=record["endpoint"],
                routes=self.routes,
                max_requests=self.max_requests,
                max_bytes=self.max_bytes,
            )
        except Exception as exc:
            log.exception("validating batch %s (file %s) failed", record["id"], source["id"])
            checked = ValidatedInput()
            checked.error(
                "validation_error",
                f"the input file {source['id']} could not be validated ({type(exc).__name__}: "
                f"{str(exc)[:200]}); create the batch again, and report it if this repeats",
            )
            return checked

    def batch(self, tenant: Tenant, batch_id: str) -> dict:
        """The tenant's batch as the store holds it (read only: the loop keeps it current)."""
        record = self.store.get_batch(batch_id, tenant.name)
        if record is None:
            raise not_found("batch", batch_id)
        return record

    def list_batches(self, tenant: Tenant, *, after: str | None, limit: int) -> tuple[list, bool]:
        """One page of the tenant's batches, and whether more follow (read only)."""
        return self.store.list_batches(tenant.name, after=after, limit=limit)

    def cancel(self, tenant: Tenant, batch_id: str) -> dict:
        """Cancel a batch. One still validating is cancelled at once (compare-and-set: the
        create that validates it then neither queues nor fails it). One in progress is
        marked cancelling and reconciled at once: its run is stopped, or, with none running,
        what it committed is published and it finishes as cancelled.

        Raises:
            ApiError: 404 for another tenant's or an unknown batch, 409 for a finished one.
        """
        record = self.batch(tenant, batch_id)
        if record["status"] == "validating":
            stamp = now()
            if self.store.update_batch(
                batch_id,
                when_status=("validating",),
                notify=self.notify(tenant.name, "cancelled"),
                status="cancelled",
                cancelling_at=stamp,
                cancelled_at=stamp,
            ):
                audit(tenant, "batch.cancel", batch_id)
                return self.batch(tenant, batch_id)
            record = self.batch(tenant, batch_id)  # validation finished first
        if record["status"] == "in_progress":
            if self.store.update_batch(
                batch_id, when_status=("in_progress",), status="cancelling", cancelling_at=now()
            ):
                audit(tenant, "batch.cancel", batch_id)
        elif record["status"] != "cancelling":
            raise ApiError(
                409,
                f"batch {batch_id} is {record['status']} and cannot be cancelled",
                code="invalid_request",
            )
        return self.reconcile(self.batch(tenant, batch_id))

    # ---------------------------------------------------------------- reconcile

    def latest_run(self, batch_id: str) -> Any:
        from dagster import RunsFilter

        runs = self.instance.get_runs(filters=RunsFilter(tags={BATCH_ID_TAG: batch_id}), limit=1)
        return runs[0] if runs else None

    def reconcile(self, record: dict) -> dict:
        """Bring a batch's row up to date with its run and its partition; returns the row."""
        if record["status"] == "validating":
            return self._reconcile_validating(record)
        if record["status"] not in ACTIVE:
            return record
        batch_id = record["id"]
        if record["status"] == "finalizing":
            return self._finalize(record, record["finalizing_to"] or "completed")
        run = self.latest_run(batch_id)
        output = self.files.output_spec(record["pipeline"])
        committed, counts = partition_progress(output, batch_id, self.files.storage)
        if committed:
            return self._finalize(record, "completed")
        if record["status"] == "cancelling":
            return self._reconcile_cancelling(record, run)
        if now() >= record["expires_at"]:
            self._stop(run)
            return self._finalize(record, "expired")
        if run is not None and run.is_finished and not _will_retry(run):
            return self._finalize_stopped_run(record, run)
        values: dict[str, Any] = {
            "completed": counts.rows_out,
            "failed": counts.rows_errored,
            **_usage_columns(counts),
        }
        if run is not None and run.run_id != record["run_id"]:
            values["run_id"] = run.run_id
        if any(values[name] != record.get(name) for name in values):
            self.store.update_batch(batch_id, when_status=("in_progress",), **values)
        return {**record, **values}

    def _reconcile_validating(self, record: dict) -> dict:
        """Validation runs inside the create request; a batch still validating long after
        was left by a service that died mid-request: fail it, so it does not hang."""
        if now() - record["created_at"] < VALIDATION_TIMEOUT_SECONDS:
            return record
        message = (
            "validation was interrupted (the service restarted while creating the batch); "
            "create the batch again"
        )
        error = {"code": "validation_interrupted", "line": None, "message": message, "param": None}
        self.store.update_batch(
            record["id"],
            when_status=("validating",),
            notify=self.notify(record["tenant"], "failed"),
            status="failed",
            failed_at=now(),
            errors={"object": "list", "data": [error]},
        )
        return self.store.get_batch(record["id"]) or record

    def _reconcile_cancelling(self, record: dict, run: Any) -> dict:
        if run is not None and not run.is_finished:
            if now() - (record["cancelling_at"] or 0) < CANCEL_GRACE_SECONDS:
                self._stop(run)
                return record
        return self._finalize(record, "cancelled")

    def _finalize_stopped_run(self, record: dict, run: Any) -> dict:
        from dagster import DagsterRunStatus

        if run.status == DagsterRunStatus.CANCELED:
            return self._finalize(record, "cancelled")
        errors = {
            "object": "list",
            "data": [
                {
                    "code": "run_failed",
                    "line": None,
                    "message": f"Dagster run {run.run_id} ended {run.status.value}; the "
                    "committed requests are in the output file, see the run in the Dagster UI",
                    "param": None,
                }
            ],
        }
        return self._finalize(record, "failed", errors=errors)

    def _stop(self, run: Any) -> None:
        from dagster import DagsterRunStatus

        if run is not None and not run.is_finished and run.status != DagsterRunStatus.CANCELING:
            self.instance.run_coordinator.cancel_run(run.run_id)

    def _finalize(self, record: dict, target: str, *, errors: dict | None = None) -> dict:
        """Publish what the partition holds as the batch's output and error files, then set
        the terminal status. Safe to repeat: file ids are the batch's, rewritten in place."""
        batch_id = record["id"]
        self.store.update_batch(
            batch_id,
            when_status=("in_progress", "cancelling"),
            status="finalizing",
            finalizing_to=target,
            finalizing_at=now(),
        )
        results = self.files.batch_results(record["pipeline"], batch_id)
        output = self.files.output_spec(record["pipeline"])
        _, counts = partition_progress(output, batch_id, self.files.storage)
        outcome = {
            "completed": results.rows_out,
            "failed": results.rows_errored,
            **_usage_columns(counts),
            "output_file_id": self._publish(record, "output", results.output),
            "error_file_id": self._publish(record, "error", results.errors),
        }
        if target == "completed":
            failure = self._write_sink(record, results.output)
            if failure is not None and failure["code"] == SINK_UNAVAILABLE:
                if now() < (record["finalizing_at"] or now()) + self.sink_retry_seconds:
                    # Stays finalizing, the error on show; the next pass tries again.
                    self.store.update_batch(
                        batch_id,
                        when_status=("finalizing",),
                        errors=_error_list(failure),
                        **outcome,
                    )
                    return self.store.get_batch(batch_id) or record
            if failure is not None:
                target, errors = "failed", _error_list(failure)
        # A sink's error shown while it was retried goes (this replica's or another's).
        sink_retried = target == "completed" and self._sink_route(record) is not None
        values: dict[str, Any] = {"status": target, f"{target}_at": now(), **outcome}
        if errors is not None or sink_retried:
            values["errors"] = errors
        self.store.update_batch(
            batch_id,
            when_status=("finalizing",),
            notify=self.notify(record["tenant"], target),
            **values,
        )
        return self.store.get_batch(batch_id) or record

    def _sink_route(self, record: dict) -> Route | None:
        """The batch's route if it names a sink."""
        route = self.routes.by_pipeline(record["pipeline"] or "")
        return route if route is not None and route.sink is not None else None

    def _write_sink(self, record: dict, output: bytes) -> dict | None:
        """Replace the batch's rows in its route's sink with its output file's (nothing
        without a sink); None when the sink holds them, else the error to show."""
        route = self._sink_route(record)
        if route is None or route.sink is None:
            return None
        try:
            manifest = self.files.batch_manifest(record["pipeline"], record["id"])
            if manifest is None:  # replaced under us: read it again on the next pass
                raise SinkError("its partition's manifest is gone for now", retryable=True)
            written = write_batch(
                route.sink,
                route.task,
                tenant=record["tenant"],
                manifest=manifest,
                output=output,
                storage=self.files.storage,
            )
        except SinkError as exc:
            log.warning("batch %s: the sink failed: %s", record["id"], exc)
            code = SINK_UNAVAILABLE if exc.retryable else SINK_REFUSED
            then = (
                "the service tries again on each pass"
                if exc.retryable
                else "fix the sink's settings or table; this batch will not be written to it"
            )
            why = str(exc).rstrip(".")
            message = f"{route.sink.describe()}: {why}. The output file is complete; {then}."
            return {"code": code, "line": None, "message": message, "param": "sink"}
        log.info(
            "batch %s: %s holds its %d rows", record["id"], route.sink.describe(), written.rows
        )
        return None

    def _publish(self, record: dict, kind: str, data: bytes) -> str | None:
        if not data:
            return None
        file_id = f"file-{record['id'].removeprefix('batch_')}-{kind}"
        uri = self.files.file_uri(file_id)
        self.files.write(uri, data)
        created = now()
        lifetime = record.get("output_expires_after")
        self.store.put_file(
            {
                "id": file_id,
                "tenant": record["tenant"],
                "purpose": "batch_output",
                "filename": f"{record['id']}_{kind}.jsonl",
                "bytes": len(data),
                "created_at": created,
                "status": "processed",
                "path": uri,
                "expires_at": created + lifetime if lifetime else None,
            }
        )
        return file_id

    def notify(self, tenant: str, status: str) -> list[tuple[str, str]]:
        """The (name, url) of each of the tenant's endpoints that takes `batch.<status>`:
        where the event of a batch reaching `status` is delivered (store.update_batch)."""
        return [(e.key, e.url) for e in self.webhooks.endpoints_for(tenant, f"batch.{status}")]

    def deliver_webhooks(self) -> int:
        """One pass of the webhook sender (app.py runs it on a timer); returns how many
        deliveries the endpoints took."""
        return deliver_due(self.store, self.webhooks)

    def sweep_expired_files(self) -> None:
        """Delete the output and error files whose `output_expires_after` has passed: bytes
        first, then the row, so a file id answers 404 only once its bytes are gone."""
        for record in self.store.files_expired_by(now()):
            self.files.delete(record["path"])
            self.store.delete_file(record["id"], record["tenant"])
            log.info("deleted expired file %s of tenant %s", record["id"], record["tenant"])

    def reconcile_all(self) -> None:
        """One pass over every unfinished batch (the service runs this on a timer), then over
        the batch jobs' unfinished runs."""
        for record in self.store.batches_in(("validating", *ACTIVE)):
            self.reconcile(record)
        self.sweep_abandoned_uploads()
        self.sweep_expired_files()
        self.stop_runs_of_stopped_batches()

    def stop_runs_of_stopped_batches(self) -> None:
        """Stop every unfinished run of a batch job whose batch is cancelled or expired.

        The sensor reads the `in_progress` batches and then requests their runs; a batch
        cancelled (or expired) in between is finalized with no run to stop, and the run the
        daemon launches afterwards belongs to a finished batch, which no reconcile looks at
        again. Such a run is found here, by the batch jobs' names, however late it appears.
        """
        from dagster import DagsterRunStatus, RunsFilter

        unfinished = [
            DagsterRunStatus.QUEUED,
            DagsterRunStatus.NOT_STARTED,
            DagsterRunStatus.STARTING,
            DagsterRunStatus.STARTED,
        ]
        for route in self.routes.routes:
            runs = self.instance.get_runs(
                filters=RunsFilter(job_name=route.job_name, statuses=unfinished)
            )
            for run in runs:
                record = self.store.get_batch(run.tags.get(BATCH_ID_TAG, ""))
                if record is not None and record["status"] in ("cancelled", "expired"):
                    log.warning(
                        "run %s of batch %s is still going though the batch is %s; stopping it",
                        run.run_id,
                        record["id"],
                        record["status"],
                    )
                    self._stop(run)


def _error_list(error: dict) -> dict:
    return {"object": "list", "data": [error]}


def _will_retry(run: Any) -> bool:
    return run.tags.get("dagster/will_retry") == "true"


def _usage_columns(counts: RowCounts) -> dict[str, int]:
    """The batch's token usage columns from its partition's counts (rows done so far)."""
    return {"input_tokens": counts.prompt_tokens, "output_tokens": counts.generated_tokens}
