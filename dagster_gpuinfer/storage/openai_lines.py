"""OpenAI Batch output and error lines: the shape of a partition's `errors.jsonl`.

The storage layout writes the quarantined rows of an `openai_batch` partition as these lines
at commit (`commit.commit_partition`'s `openai_errors`), and the readers of partitions not yet
committed build the same lines from the chunks' error files
(`reading.read_openai_batch_files`). The worker's output lines (`worker/rows/openai_batch.py`)
use the same models; response bodies live there.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel


class BatchError(BaseModel):
    """The `error` of an error line: OpenAI's `{code, message}`."""

    code: str
    message: str


class BatchResponse(BaseModel):
    status_code: int = 200
    request_id: str
    body: dict[str, Any]


class BatchOutputLine(BaseModel):
    """One line of the output file (`response` set) or of `errors.jsonl` (`error` set)."""

    id: str
    custom_id: str | None
    response: BatchResponse | None = None
    error: BatchError | None = None


def request_id(spec_hash: str, custom_id: str | None, row: int | None = None) -> str:
    """A stable request id: the same line of the same spec always gets the same one."""
    key = custom_id if custom_id is not None else f"row:{row}"
    return hashlib.sha256(f"{spec_hash}:{key}".encode()).hexdigest()[:24]


def error_line(spec_hash: str, custom_id: str | None, row: int, code: str, message: str) -> str:
    """An `errors.jsonl` line for a quarantined request."""
    rid = request_id(spec_hash, custom_id, row)
    line = BatchOutputLine(
        id=f"batch_req_{rid}",
        custom_id=custom_id,
        response=None,
        error=BatchError(code=code, message=message),
    )
    return line.model_dump_json()


def openai_error_lines(spec_hash: str, error_tables: list[Any]) -> bytes:
    """`errors.jsonl`: every quarantined row of a partition (from its errors tables, with
    columns id, row, error_type, message) as an OpenAI Batch error line."""
    lines = [
        error_line(spec_hash, record["id"], record["row"], record["error_type"], record["message"])
        for table in error_tables
        for record in table.select(["id", "row", "error_type", "message"]).to_pylist()
    ]
    return ("\n".join(lines) + "\n").encode() if lines else b""
