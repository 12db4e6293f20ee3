"""The wire format: OpenAI's File, Batch, list and error objects as pydantic models.

Every route declares one of these as its response model, so `/openapi.json` is the
contract the `openai` SDK reads against, and a field the SDK expects cannot go missing
without the schema (and its test) saying so. Named `schemas` rather than `models`: in this
project a model is what vLLM loads.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from dagster_gpuinfer.batch_api.store import BATCH_TIMESTAMPS

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]

# OpenAI's bounds on `limit`: 1-100 batches a page (default 20), 1-10,000 files (default
# 10,000, so an SDK that never pages still sees every file of a small tenant).
BATCH_PAGE_MAX = 100
BATCH_PAGE_DEFAULT = 20
FILE_PAGE_MAX = 10_000
FILE_PAGE_DEFAULT = 10_000
# OpenAI's bounds on a batch's `metadata`.
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


class FileObject(BaseModel):
    """An uploaded input file, or a batch's output or error file."""

    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size of the file in bytes.")
    created_at: int = Field(description="Unix seconds when the file was created.")
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None = Field(
        None, description="Unix seconds when the file is deleted (`output_expires_after`)."
    )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> FileObject:
        """The File object of a store row (`BatchStore.get_file`)."""
        return cls.model_validate(
            {name: record[name] for name in cls.model_fields if name in record}
        )


class FileList(BaseModel):
    """One page of a tenant's files; pass `last_id` as `after` for the next page."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    """The answer to deleting a file."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchError(BaseModel):
    """Why a batch failed: a line of its input (`line`, 1-based) or its run (`line` null)."""

    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    """Requests in the batch, and those done so far (in the output or the error file)."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """Tokens of the requests done so far. No `input_tokens_details`: the engine's
    prefix-cache hits are not counted per partition, so cached tokens are left out rather
    than reported as 0; the models served have no separate reasoning tokens."""

    input_tokens: int
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BatchUsage | None:
        """The usage of a store row; None until its rows were first counted."""
        if record.get("input_tokens") is None:
            return None
        prompt, generated = record["input_tokens"], record.get("output_tokens") or 0
        return cls(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)


class Batch(BaseModel):
    """OpenAI's Batch object: what was asked, where it stands, and its output files."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = Field(None, description="The model the batch's lines name.")
    usage: BatchUsage | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Batch:
        """The Batch object of a store row (`BatchStore.get_batch`)."""
        names = (
            "id",
            "endpoint",
            "errors",
            "input_file_id",
            "completion_window",
            "status",
            "output_file_id",
            "error_file_id",
            "metadata",
            "model",
            *(f"{name}_at" for name in BATCH_TIMESTAMPS),
        )
        counts = {name: record.get(name) or 0 for name in ("total", "completed", "failed")}
        return cls.model_validate(
            {
                **{name: record.get(name) for name in names},
                "request_counts": counts,
                "usage": BatchUsage.from_record(record),
            }
        )


class BatchList(BaseModel):
    """One page of a tenant's batches, newest first; pass `last_id` as `after` for the next."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class OutputExpiresAfter(BaseModel):
    """When a batch's output and error files are deleted (OpenAI's shape)."""

    anchor: Literal["created_at"] = Field(
        description="Counted from the file's creation (the only anchor OpenAI has)."
    )
    seconds: int = Field(description="Seconds after the anchor: 3600 (an hour) to 2592000.")


class CreateBatch(BaseModel):
    """The body of `POST /v1/batches`."""

    input_file_id: str = Field(description="An uploaded file with purpose 'batch'.")
    endpoint: str = Field(description="The endpoint every line's `url` names.")
    completion_window: str = Field(
        "24h", description="How long the batch may take: '24h', or e.g. '30m', '90s'."
    )
    metadata: dict[str, str] | None = Field(
        None,
        description=f"At most {METADATA_MAX_PAIRS} pairs; keys up to {METADATA_MAX_KEY_CHARS} "
        f"and values up to {METADATA_MAX_VALUE_CHARS} characters (OpenAI's bounds).",
    )
    output_expires_after: OutputExpiresAfter | None = Field(
        None, description="Delete the output and error files this long after they are written."
    )

    @field_validator("metadata")
    @classmethod
    def _openai_metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds, so a batch row stays small: the probe stored 16 values of 4 MiB,
        and nine such batches took the idle service to 1,318 MiB on every restart."""
        if metadata is None:
            return None
        if len(metadata) > METADATA_MAX_PAIRS:
            raise ValueError(
                f"{len(metadata)} pairs, more than {METADATA_MAX_PAIRS}; keep the rest elsewhere"
            )
        for key, value in metadata.items():
            if len(key) > METADATA_MAX_KEY_CHARS:
                raise ValueError(
                    f"key {key[:20]!r}... has {len(key)} characters, more than "
                    f"{METADATA_MAX_KEY_CHARS}; shorten it"
                )
            if len(value) > METADATA_MAX_VALUE_CHARS:
                raise ValueError(
                    f"the value of {key[:20]!r} has {len(value)} characters, more than "
                    f"{METADATA_MAX_VALUE_CHARS}; shorten it"
                )
        return metadata


class ErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "api_error", "requests", "insufficient_quota"]
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape; the SDK raises its status error class from it."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"


def page_ids(data: list[Any]) -> dict[str, str | None]:
    """The `first_id` and `last_id` of a page of files or batches."""
    return {
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }


def error_response(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    retry_after: int | None = None,
) -> JSONResponse:
    """An OpenAI-shaped error answer. A 429 has OpenAI's types: `requests` for a rate limit
    (`code` rate_limit_exceeded), `insufficient_quota` for a quota; `retry_after` seconds
    go in the `Retry-After` header (the openai SDK waits that long before its retry)."""
    kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
    if status == 429:
        kind = "requests" if code == "rate_limit_exceeded" else "insufficient_quota"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)
