"""OpenAI Batch API lines as pydantic models: the request line we read, the output and error
lines we write.

vLLM has its own (`vllm.entrypoints.launchers.run_batch.BatchRequestInput` /
`BatchRequestOutput`), but importing them pulls in FastAPI, aiohttp, the audio endpoints and
torch, and its request union has no `/v1/completions`. These models mirror the OpenAI shapes
(https://platform.openai.com/docs/api-reference/batch) with pydantic only, so a reader can
parse lines before any engine exists and a test can check every written line against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dagster_gpuinfer.storage.openai_lines import (
    BatchError as BatchError,
)
from dagster_gpuinfer.storage.openai_lines import (
    BatchOutputLine as BatchOutputLine,
)
from dagster_gpuinfer.storage.openai_lines import (
    BatchResponse as BatchResponse,
)
from dagster_gpuinfer.storage.openai_lines import (
    error_line as error_line,
)
from dagster_gpuinfer.storage.openai_lines import (
    openai_error_lines as openai_error_lines,
)
from dagster_gpuinfer.storage.openai_lines import (
    request_id as request_id,
)
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
