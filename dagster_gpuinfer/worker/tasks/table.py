"""The task table, worker half: one `WorkerTask` per task (embed, generate, chat, score,
classify), looked up by name with `worker_task(spec.task)`.

A task's control-plane facts (vLLM runner, OpenAI endpoints, whether rows stream through
the engine, whether prefix grouping applies) are its `facts`, a `task_table.TaskFacts`
entry. What a task does in the worker is its methods; the modules that read, validate,
build requests, call the engine and write call them instead of asking which task runs:

- Reading (`readers.ShardReader`): `payload_settings` names the `InputSpec` fields whose
  columns carry the input (`("text_column",)`; score: the text and its pair, which the
  reader zips into `(query, document)` tuples); `openai_request(reader, ...)` turns an
  OpenAI Batch line's body into `(row, id, payload, params)` or a `RowError`.
- Validating (`validate.RowValidator`): `checks_empty_text` (null/empty text quarantined
  before parsing), `candidate(validator, ...)` (the row's prompts, or why its input has the
  wrong shape), `prepare(validator, ...)` (chat: the chat template), `prompt_chars(...)` (the
  characters bounded by `limits.max_prompt_chars`), `admit(validator, ...)` (tokenize and
  bound by the engine's length), `add_special_tokens`.
- Request parameters (`request_params.RequestBuilder`): `request_keys` (the per-row keys
  honoured) and `request(builder, params)` (the row's `RowRequest`).
- The engine (`engine.InferenceEngine`): `default_params(engine)` (the `SamplingParams` or
  `PoolingParams` a row without its own gets, for tasks that stream), and `run_chunk(engine,
  valid)` for tasks that run a whole chunk in one offline call (`facts.streams` False).
- Output (`writers`): `output_table(spec, valid, result)` (the Parquet rows, explicit
  schema) and `response_body(model, rid, created, row, valid, position)` (the OpenAI body of
  one output row).

Adding a task: a `TaskFacts` entry in `task_table.TASKS` and a `WorkerTask` subclass (or an
instance of an existing one with other attributes) in `WORKER_TASKS`. An image-embedding
task, for example, is an `EmbedTask` whose `candidate` accepts an image payload and whose
prompts carry `multi_modal_data`; a vision-language chat is a `ChatTask` whose `prepare`
keeps the images beside the rendered template.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa

from dagster_gpuinfer.spec import InferenceSpec, InputSpec
from dagster_gpuinfer.task_table import TaskFacts, task_facts
from dagster_gpuinfer.worker.errors import RowError, SpecError, cap_message
from dagster_gpuinfer.worker.tasks import openai_batch as oa
from dagster_gpuinfer.worker.tasks.completions import CHOICE_TYPE, completion_logprobs
from dagster_gpuinfer.worker.tasks.image import (
    admit_image_rows,
    chat_payload,
    embed_payload,
    image_candidate,
    vision_payload,
)
from dagster_gpuinfer.worker.tasks.params import (
    EMBEDDING_KEYS,
    GENERATION_KEYS,
    SCORE_KEYS,
    EmbeddingParams,
    ParameterError,
    RowRequest,
    ScoreParams,
    typed_params,
)
from dagster_gpuinfer.worker.tasks.pooling import (
    PoolingResult,
    model_labels,
    parse_score_payload,
    run_classify,
    run_score,
)
from dagster_gpuinfer.worker.tasks.stages import (
    CandidateOrProblem,
    OpenAIRequest,
    RequestBuilding,
    RequestReader,
    RowValidation,
    TaskEngine,
)
from dagster_gpuinfer.worker.tasks.structured import check_output

if TYPE_CHECKING:  # the rooms above: types only (`stages`)
    from dagster_gpuinfer.worker.rows.validate import ValidChunk
    from dagster_gpuinfer.worker.rows.validate import _Candidate as Candidate
    from dagster_gpuinfer.worker.stage_messages import ChunkResult

GENERATION_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("generated_tokens", pa.int32()),
        pa.field("choices", pa.list_(CHOICE_TYPE)),
        pa.field("output_valid", pa.bool_()),
        pa.field("output_error", pa.string()),
    ]
)

SCORE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("score", pa.float64()),
        pa.field("scores", pa.list_(pa.float64())),
        pa.field("endpoint", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
    ]
)

CLASSIFY_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("label", pa.string()),
        pa.field("probs", pa.list_(pa.float32())),
        pa.field("prompt_tokens", pa.int32()),
    ]
)


def embedding_schema(dim: int, *, several_inputs: bool = False) -> pa.Schema:
    """Embeddings as fixed-size float32 lists; `several_inputs` adds `embeddings`, every
    vector of a row whose input was a list (OpenAI `input: [...]`), `embedding` its first."""
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32(), dim)),
        pa.field("prompt_tokens", pa.int32()),
    ]
    if several_inputs:
        fields.append(pa.field("embeddings", pa.list_(pa.list_(pa.float32(), dim))))
    return pa.schema(fields)


class WorkerTask:
    """One task's behaviour in the worker; the defaults are a text task whose rows stream.

    Subclasses set `name` (the key of its `task_table.TASKS` entry) and override what
    differs. Methods that take the `reader`, `validator`, `builder` or `engine` call back the
    generic steps those objects hold (their surfaces: `stages.py`), so each module keeps its
    mechanics and the task chooses.
    """

    name: ClassVar[str]
    payload_settings: ClassVar[tuple[str, ...]] = ("text_column",)
    # Payload columns a shard may lack (their values read as null).
    optional_payload_settings: ClassVar[tuple[str, ...]] = ()
    checks_empty_text: ClassVar[bool] = True
    add_special_tokens: ClassVar[bool] = True
    accepts_token_ids: ClassVar[bool] = False
    accepts_lists: ClassVar[bool] = False
    expected_input: ClassVar[str] = "a string"
    request_keys: ClassVar[frozenset[str]] = frozenset()

    @property
    def facts(self) -> TaskFacts:
        return task_facts(self.name)

    # ------------------------------------------------------------------ reading

    def payload_columns(self, input_spec: InputSpec) -> list[str]:
        """The input's columns that carry this task's payload, in order."""
        return [getattr(input_spec, setting) for setting in self.payload_settings]

    def openai_request(
        self, reader: RequestReader, row: int, row_id: str, url: str, body: Any
    ) -> OpenAIRequest:
        """An OpenAI Batch line's `(row, id, payload, params)`, or the `RowError` saying why
        its body cannot serve this task."""
        return reader.body_field_request(row, row_id, body, self.facts.endpoints[url])

    # ------------------------------------------------------------------ validating

    def candidate(
        self, validator: RowValidation, row: int, row_id: str, payload: Any, request: RowRequest
    ) -> CandidateOrProblem:
        """The row's prompts (`validate._Candidate`), or (error type, message)."""
        return validator.text_candidate(
            row,
            row_id,
            payload,
            request,
            token_ids=self.accepts_token_ids,
            lists=self.accepts_lists,
            expected=self.expected_input,
        )

    def prepare(
        self,
        validator: RowValidation,
        source: str,
        candidates: list[Candidate],
        errors: list[RowError],
    ) -> list[Candidate]:
        """The candidates ready to tokenize (a chat renders its template here)."""
        return candidates

    def prompt_chars(self, validator: RowValidation, candidate: Candidate) -> list[int]:
        """Characters of each prompt of the row, bounded before any tokenizing."""
        return validator.text_chars(candidate)

    def admit(
        self, validator: RowValidation, source: str, candidates: list[Candidate], out: ValidChunk
    ) -> None:
        """Tokenize the candidates and admit into `out` the ones the engine can take."""
        validator.tokenize_candidates(source, candidates, out)

    # ------------------------------------------------------------------ requests

    def request(self, builder: RequestBuilding, params: dict[str, Any]) -> RowRequest:
        """The row's request from its (checked) parameters."""
        return RowRequest()

    # ------------------------------------------------------------------ the engine

    def default_params(self, engine: TaskEngine) -> Any:
        """What a streamed row without its own parameters is submitted with."""
        return None

    def run_chunk(self, engine: TaskEngine, valid: ValidChunk) -> PoolingResult:
        """A whole validated chunk in one offline call (tasks that do not stream)."""
        raise NotImplementedError(f"task {self.name!r} streams its rows through submit/step")

    # ------------------------------------------------------------------ output

    def output_table(
        self, spec: InferenceSpec, valid: ValidChunk, result: ChunkResult | PoolingResult
    ) -> pa.Table:
        """The output rows of one validated chunk (`validate.ValidChunk`) and its results."""
        raise NotImplementedError

    def response_body(
        self,
        model: str,
        rid: str,
        created: int,
        row: dict[str, Any],
        valid: ValidChunk | None,
        position: int,
    ) -> dict[str, Any]:
        """The OpenAI response body of one output row."""
        raise NotImplementedError


class EmbedTask(WorkerTask):
    """`LLM.embed` one request at a time: a string, token ids, or a list of either (one
    vector each)."""

    name = "embed"
    accepts_token_ids = True
    accepts_lists = True
    expected_input = "a string, a list of strings, token ids or a list of token id lists"
    request_keys = EMBEDDING_KEYS

    def request(self, builder: RequestBuilding, params: dict[str, Any]) -> RowRequest:
        typed_params(EmbeddingParams, params)
        return RowRequest()

    def default_params(self, engine: TaskEngine) -> Any:
        from vllm import PoolingParams

        return PoolingParams(task="embed")

    def output_table(self, spec: InferenceSpec, valid: ValidChunk, result: Any) -> pa.Table:
        several = spec.input.resolved_format() == "openai_batch"
        ids, spans = valid.ids, valid.spans
        embeddings = np.ascontiguousarray(result.embeddings, dtype=np.float32)
        dim = embeddings.shape[1] if embeddings.ndim == 2 and embeddings.size else 0
        spans = spans or [1] * len(ids)
        starts = np.cumsum([0, *spans[:-1]]).astype(np.int64)
        firsts = embeddings[starts] if len(ids) else embeddings.reshape(0, dim)
        tokens = np.add.reduceat(np.asarray(result.prompt_tokens, np.int64), starts) if ids else []
        arrays = [
            pa.array(ids, pa.string()),
            pa.FixedSizeListArray.from_arrays(pa.array(firsts.reshape(-1), pa.float32()), dim),
            pa.array(np.asarray(tokens, np.int32), pa.int32()),
        ]
        if several:
            vectors = pa.FixedSizeListArray.from_arrays(
                pa.array(embeddings.reshape(-1), pa.float32()), dim
            )
            offsets = pa.array(np.cumsum([0, *spans]).astype(np.int32), pa.int32())
            arrays.append(pa.ListArray.from_arrays(offsets, vectors))
        return pa.Table.from_arrays(arrays, schema=embedding_schema(dim, several_inputs=several))

    def response_body(self, model, rid, created, row, valid, position) -> dict[str, Any]:
        prompt_tokens = row["prompt_tokens"]
        vectors = row.get("embeddings") or [row["embedding"]]
        return oa.EmbeddingList(
            model=model,
            data=[oa.EmbeddingData(index=i, embedding=v) for i, v in enumerate(vectors)],
            usage=oa.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        ).model_dump(exclude_none=True)


class GenerateTask(WorkerTask):
    """Text completion: a string or token ids, sampled with the row's `SamplingParams`."""

    name = "generate"
    accepts_token_ids = True
    expected_input = "a string or token ids"
    request_keys = GENERATION_KEYS

    def request(self, builder: RequestBuilding, params: dict[str, Any]) -> RowRequest:
        return builder.generation_request(params)

    def default_params(self, engine: TaskEngine) -> Any:
        from vllm.sampling_params import RequestOutputKind

        try:
            params = engine.requests.build(None).sampling
        except ParameterError as exc:  # a new engine shuts itself down; a pool's stays bound
            raise SpecError(f"the pipeline's sampling parameters: {exc}") from None
        # Only the finished output of each request comes back (as in `LLM.generate`).
        params.output_kind = RequestOutputKind.FINAL_ONLY
        return params

    def output_table(self, spec: InferenceSpec, valid: ValidChunk, result: Any) -> pa.Table:
        ids = valid.ids
        choices = result.choices or [[] for _ in ids]
        valid_flags: list[bool | None] = []
        problems: list[str | None] = []
        no_requests: list[RowRequest | None] = [None] * len(ids)
        requests = valid.requests or no_requests
        for row_choices, request in zip(choices, requests, strict=True):
            constraint = getattr(request, "constraint", None)
            if constraint is None:
                valid_flags.append(None)
                problems.append(None)
                continue
            for choice in row_choices:
                try:
                    problem = check_output(constraint, choice["text"])
                except Exception as exc:  # the row boundary: a check never fails the chunk
                    problem = f"the output could not be checked ({type(exc).__name__}: {exc})"
                problem = None if problem is None else cap_message(problem, 1000)
                choice["output_valid"], choice["output_error"] = problem is None, problem
            row_problems = [c["output_error"] for c in row_choices if c["output_error"]]
            valid_flags.append(not row_problems)
            problems.append(row_problems[0] if row_problems else None)
        return pa.Table.from_pydict(
            {
                "id": ids,
                "text": result.texts,
                "finish_reason": result.finish_reasons,
                "prompt_tokens": result.prompt_tokens,
                "generated_tokens": result.generated_tokens,
                "choices": choices,
                "output_valid": valid_flags,
                "output_error": problems,
            },
            schema=GENERATION_SCHEMA,
        )

    def response_body(self, model, rid, created, row, valid, position) -> dict[str, Any]:
        usage, choices = _usage_and_choices(row)
        return oa.TextCompletion(
            id=f"cmpl-{rid}",
            created=created,
            model=model,
            usage=usage,
            choices=[
                oa.CompletionChoice(
                    index=c["index"],
                    text=c["text"],
                    finish_reason=c["finish_reason"],
                    logprobs=None
                    if c["logprobs"] is None
                    else oa.CompletionLogprobs(**completion_logprobs(c["logprobs"])),
                )
                for c in choices
            ],
        ).model_dump(exclude_none=True)


class ChatTask(GenerateTask):
    """Chat completion: OpenAI messages through the model's chat template, then generated
    like `generate` (the template holds the special tokens, so none are added)."""

    name = "chat"
    payload_settings = ("messages_column",)
    checks_empty_text = False  # checked while rendering the chat template
    add_special_tokens = False

    def candidate(self, validator, row, row_id, payload, request) -> CandidateOrProblem:
        return validator.whole_candidate(row, row_id, payload, request), ("", "")

    def prepare(
        self,
        validator: RowValidation,
        source: str,
        candidates: list[Candidate],
        errors: list[RowError],
    ) -> list[Candidate]:
        return validator.render_chats(source, candidates, errors)

    def prompt_chars(self, validator: RowValidation, candidate: Candidate) -> list[int]:
        return validator.chat_chars(candidate)

    def response_body(self, model, rid, created, row, valid, position) -> dict[str, Any]:
        usage, choices = _usage_and_choices(row)
        return oa.ChatCompletion(
            id=f"chatcmpl-{rid}",
            created=created,
            model=model,
            usage=usage,
            choices=[
                oa.ChatChoice(
                    index=c["index"],
                    message=oa.ChatMessage(content=c["text"]),
                    finish_reason=c["finish_reason"],
                    logprobs=None
                    if c["logprobs"] is None
                    else oa.ChatLogprobs(content=c["logprobs"]),
                )
                for c in choices
            ],
        ).model_dump(exclude_none=True)


def _usage_and_choices(row: dict[str, Any]) -> tuple[oa.Usage, list[dict[str, Any]]]:
    """A generation row's token usage and every choice of it."""
    prompt_tokens = row["prompt_tokens"]
    generated = row.get("generated_tokens", 0)
    usage = oa.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=generated,
        total_tokens=prompt_tokens + generated,
    )
    choices = row.get("choices") or [
        {"index": 0, "text": row["text"], "finish_reason": row["finish_reason"], "logprobs": None}
    ]
    return usage, choices


class ScoreTask(WorkerTask):
    """Cross-encoder scores of (query, document) pairs, a whole chunk per `LLM.score` call;
    rerank rows answer with their documents ordered by score."""

    name = "score"
    payload_settings = ("text_column", "text_pair_column")
    checks_empty_text = False  # checked while parsing the pairs
    request_keys = SCORE_KEYS

    def openai_request(
        self, reader: RequestReader, row: int, row_id: str, url: str, body: Any
    ) -> OpenAIRequest:
        return reader.score_request(row, row_id, url, body)

    def candidate(self, validator, row, row_id, payload, request) -> CandidateOrProblem:
        pairs, problem = parse_score_payload(payload)
        if pairs is None:
            return None, ("wrong_type", problem or "not a score request")
        return validator.pairs_candidate(row, row_id, request, pairs), ("", "")

    def admit(
        self, validator: RowValidation, source: str, candidates: list[Candidate], out: ValidChunk
    ) -> None:
        validator.tokenize_pairs_rowwise(source, candidates, out)

    def request(self, builder: RequestBuilding, params: dict[str, Any]) -> RowRequest:
        typed = typed_params(ScoreParams, params)
        return RowRequest(
            top_n=typed.top_n or None,
            return_documents=True if typed.return_documents is None else typed.return_documents,
        )

    def run_chunk(self, engine: TaskEngine, valid: ValidChunk) -> PoolingResult:
        return run_score(engine.llm, valid.pairs, valid.pair_tokens)

    def output_table(self, spec: InferenceSpec, valid: ValidChunk, result: Any) -> pa.Table:
        return pa.Table.from_pydict(
            {
                "id": valid.ids,
                "score": [s[0] if len(s) == 1 else None for s in result.scores],
                "scores": result.scores,
                "endpoint": ["rerank" if p.rerank else "score" for p in valid.pairs],
                "prompt_tokens": result.prompt_tokens,
            },
            schema=SCORE_SCHEMA,
        )

    def response_body(self, model, rid, created, row, valid, position) -> dict[str, Any]:
        prompt_tokens = row["prompt_tokens"]
        usage = oa.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        if row["endpoint"] == "rerank":
            pairs = valid.pairs[position] if valid is not None else None
            request = valid.requests[position] if valid is not None else None
            ranked = sorted(enumerate(row["scores"]), key=lambda item: -item[1])
            if request is not None and request.top_n:
                ranked = ranked[: request.top_n]
            results = [
                oa.RerankResult(
                    index=i,
                    document=oa.RerankDocument(text=pairs.documents[i] if pairs else ""),
                    relevance_score=score,
                )
                for i, score in ranked
            ]
            return oa.Rerank(
                id=f"rerank-{rid}", model=model, results=results, usage=usage
            ).model_dump(exclude_none=True)
        return oa.ScoreList(
            id=f"score-{rid}",
            created=created,
            model=model,
            data=[oa.ScoreData(index=i, score=s) for i, s in enumerate(row["scores"])],
            usage=usage,
        ).model_dump(exclude_none=True)


class ClassifyTask(WorkerTask):
    """Label probabilities of each row's text, a whole chunk per `LLM.classify` call, with
    the most likely label's name from the model's `id2label`."""

    name = "classify"

    def run_chunk(self, engine: TaskEngine, valid: ValidChunk) -> PoolingResult:
        return run_classify(engine.llm, valid.token_ids, model_labels(engine.llm))

    def output_table(self, spec: InferenceSpec, valid: ValidChunk, result: Any) -> pa.Table:
        return pa.Table.from_pydict(
            {
                "id": valid.ids,
                "label": result.labels,
                "probs": result.probs,
                "prompt_tokens": result.prompt_tokens,
            },
            schema=CLASSIFY_SCHEMA,
        )

    def response_body(self, model, rid, created, row, valid, position) -> dict[str, Any]:
        prompt_tokens = row["prompt_tokens"]
        probs = row["probs"]
        return {
            "id": f"classify-{rid}",
            "object": "list",
            "created": created,
            "model": model,
            "data": [
                {"index": 0, "label": row["label"], "probs": probs, "num_classes": len(probs)}
            ],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }


class _ImageRows:
    """What the image tasks share: a row's image references (and its text), read and
    decoded for the whole chunk in the validator's pool before tokenizing
    (`image_tasks.admit_image_rows`); each prompt carries its images to the engine."""

    name: ClassVar[str]
    payload_settings: ClassVar[tuple[str, ...]] = ("image_column", "text_column")
    checks_empty_text: ClassVar[bool] = False  # a null text is an image row

    renders_chat: ClassVar[bool] = False

    @staticmethod
    def read_payload(payload: Any) -> tuple[str | None, list[Any], tuple[str, str]]:
        return vision_payload(payload)

    def candidate(self, validator, row, row_id, payload, request) -> CandidateOrProblem:
        return image_candidate(validator, self.read_payload, row, row_id, payload, request)

    def prepare(
        self,
        validator: RowValidation,
        source: str,
        candidates: list[Candidate],
        errors: list[RowError],
    ) -> list[Candidate]:
        return candidates  # images are read in `admit`, where the chunk's counts go

    def admit(
        self, validator: RowValidation, source: str, candidates: list[Candidate], out: ValidChunk
    ) -> None:
        admit_image_rows(validator, source, candidates, out, render=self.renders_chat)


class ImageEmbedTask(_ImageRows, EmbedTask):
    """Image embeddings (CLIP/SigLIP-style dual encoders): a row's image, or its text where
    the image is null, into the model's one space; output as `embed`."""

    name = "image_embed"
    optional_payload_settings = ("text_column",)  # an image-only shard needs no text column

    @staticmethod
    def read_payload(payload: Any) -> tuple[str | None, list[Any], tuple[str, str]]:
        return embed_payload(payload)


class VisionGenerateTask(_ImageRows, GenerateTask):
    """Vision-language generation: a row's image (or images) and its prompt text."""

    name = "vision_generate"


class VisionChatTask(_ImageRows, ChatTask):
    """Vision-language chat: OpenAI messages whose content parts carry `image_url`s (the
    parts become the template's image placeholders); answered as `chat`."""

    name = "vision_chat"
    payload_settings = ("messages_column",)
    add_special_tokens = False
    renders_chat = True

    @staticmethod
    def read_payload(payload: Any) -> tuple[str | None, list[Any], tuple[str, str]]:
        return chat_payload(payload)

    def prompt_chars(self, validator: RowValidation, candidate: Candidate) -> list[int]:
        return validator.text_chars(candidate)  # the messages' JSON, bounded before parsing


_ENTRIES: tuple[WorkerTask, ...] = (
    EmbedTask(),
    GenerateTask(),
    ChatTask(),
    ScoreTask(),
    ClassifyTask(),
    ImageEmbedTask(),
    VisionGenerateTask(),
    VisionChatTask(),
)
WORKER_TASKS: Mapping[str, WorkerTask] = MappingProxyType({e.name: e for e in _ENTRIES})


def worker_task(name: str) -> WorkerTask:
    """The worker's task `name` (its facts: `worker_task(name).facts`).

    Raises:
        ValueError: `name` is not a task of the table.
    """
    task_facts(name)  # an unknown name says which tasks there are
    return WORKER_TASKS[name]
