"""OpenAI Batch API lines as pydantic models: the request line we read, the output and error
lines we write.

vLLM has its own (`vllm.entrypoints.launchers.run_batch.BatchRequestInput` /
`BatchRequestOutput`), but importing them pulls in FastAPI, aiohttp, the audio endpoints and
torch, and its request union has no `/v1/completions`. These models mirror the OpenAI shapes
(https://platform.openai.com/docs/api-reference/batch) with pydantic only, so a reader can
parse lines before any engine exists and a test can check every written line against them.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dagster_gpuinfer.task_table import ENDPOINTS as TASK_ENDPOINTS

# Which endpoint serves which task, and which body field carries the input (from the task
# table: each task lists its endpoints).
ENDPOINTS = TASK_ENDPOINTS


class BatchRequestLine(BaseModel):
    """One line of an OpenAI Batch input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1)
    method: Literal["POST"] = "POST"
    url: str
    body: dict[str, Any]


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


# ---------------------------------------------------------------- response bodies


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int | None = None
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float]


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: Usage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreList(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class Rerank(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: Usage


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
