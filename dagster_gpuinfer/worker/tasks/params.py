"""A row's own request parameters as typed models: the keys each task honours, the models
its values are checked against (`GenerationParams`, `EmbeddingParams`, `ScoreParams`), and
the `RowRequest` a row becomes. The rules that map them onto vLLM's `SamplingParams` are the
request builder's (`worker/rows/request_params.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dagster_gpuinfer.spec import StructuredOutputs
from dagster_gpuinfer.worker.errors import cap_message, lone_surrogate_in

# Keys accepted on every request and without effect on the result: OpenAI lines name the
# model (the pipeline's model serves every line) and may carry an end-user id.
NEUTRAL_KEYS = frozenset({"model", "user"})


# Sampling keys a generate/chat row may set, under OpenAI's or vLLM's name.
GENERATION_KEYS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "response_format",
        "structured_outputs",
        "logit_bias",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "stream",
    }
)


EMBEDDING_KEYS = frozenset({"encoding_format"})


SCORE_KEYS = frozenset({"top_n", "return_documents"})


class ParameterError(Exception):
    """A row's parameter the platform does not honour, or a value vLLM rejects."""

    def __init__(self, error_type: str, key: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.key = key


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationParams(BaseModel):
    """The types of the generation keys; ranges are vLLM's to judge."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: Literal[False] | None = None


class EmbeddingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    encoding_format: Literal["float"] | None = None


class ScoreParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_n: int | None = Field(None, ge=0)
    return_documents: bool | None = None


@dataclass
class RowRequest:
    """What one row asks of the engine, beyond its prompt.

    `sampling` is the row's `vllm.SamplingParams` (generate/chat). `top_logprobs`: how many
    alternatives each token's logprobs list (None: no logprobs). `constraint`: the structured
    output its text must satisfy, checked after generation. `adapter`: the name of the LoRA
    adapter (`InferenceSpec.lora_adapters`) the row runs on; None: the base model.
    """

    sampling: Any = None
    top_logprobs: int | None = None
    constraint: StructuredOutputs | None = None
    top_n: int | None = None
    return_documents: bool = True
    adapter: str | None = None
    # The row's parameters as they shape its output, canonical JSON (part of its reuse key,
    # `worker/loop/reuse.py`); None: the pipeline's defaults, which the spec's scope covers.
    reuse_params: str | None = None
    # Whether the output is a function of the prompt and `reuse_params`: pooling, greedy or
    # seeded sampling. An unseeded sample is a new draw each time (reused only when asked).
    deterministic: bool = True


def parse_params_value(value: Any) -> dict[str, Any]:
    """A params column value (an object or its JSON text; null: none) as a dict.

    Raises:
        ParameterError: not an object.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ParameterError(
                "invalid_parameter", "params", f"the params value is not valid JSON ({exc})"
            ) from None
        if lone_surrogate_in(value):
            raise ParameterError(
                "invalid_unicode",
                "params",
                "the params JSON escapes half of a UTF-16 surrogate pair (a \\uD800-\\uDFFF "
                "escape without its partner), which is not Unicode text; escape both halves",
            )
    if not isinstance(value, dict):
        raise ParameterError(
            "invalid_parameter",
            "params",
            f"the params value must be an object of parameters, got {type(value).__name__}",
        )
    return value


def typed_params(model: type[BaseModel], params: dict[str, Any]) -> Any:
    """`params` validated as `model`; a wrong value is the row's `invalid_parameter`."""
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = str(error["loc"][0]) if error["loc"] else "params"
        shown = cap_message(repr(error.get("input")), 100)
        raise ParameterError(
            "invalid_parameter",
            key,
            f"parameter {key!r} has an invalid value {shown}: {cap_message(error['msg'], 300)}",
        ) from None


# A seeded request that vLLM's CPU build cannot sample (`loop.cpu_seeds.seeds_unsafe`): why
# the row or the spec is refused.
SEED_REFUSED = (
    "vLLM's CPU build cannot sample a seeded request with chunked prefill on (its CPU random "
    "generator has no offset to rewind when a step splits the prompt, and the engine dies); "
    "drop the seed, set engine extra enable_chunked_prefill=False (max_num_batched_tokens, "
    "if set, at least max_model_len), or run on a GPU"
)
