"""Output encoders: a chunk's results as Parquet (explicit schemas) or OpenAI batch JSONL.

Generation rows keep every choice (`n > 1`) in a `choices` list column, with logprobs in
OpenAI's chat shape when asked for; `text`/`finish_reason` repeat choice 0 for readers that
want one string. Rows generated under a structured-output constraint are checked here
(`structured.check_output`): `output_valid` and `output_error` say whether each row's output
satisfies it (null when the row had none).

On an OpenAI batch output line, a row whose output fails its constraint keeps its
`response` (status 200: the model did answer, and the text may still be useful) and gets an
`error` object beside it (`{"code": "invalid_output", "message": why}`), so whoever holds
only the output file can tell which lines failed. A row whose response body cannot be built
gets an `error` line (`response_failed`) instead of failing its chunk.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from dagster_gpuinfer.spec import EMBEDDING_TASKS, InferenceSpec
from dagster_gpuinfer.storage import ERRORS_SCHEMA
from dagster_gpuinfer.worker import openai_batch as oa
from dagster_gpuinfer.worker.completions import CHOICE_TYPE, completion_logprobs
from dagster_gpuinfer.worker.errors import RowError, cap_message
from dagster_gpuinfer.worker.structured import check_output

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


def output_table(spec: InferenceSpec, valid: Any, result: Any) -> pa.Table:
    """The output rows of one validated chunk (`validate.ValidChunk`) and its results."""
    task, ids = spec.task, valid.ids
    if task in EMBEDDING_TASKS:
        return _embedding_table(
            ids, valid.spans, result, several=spec.input.resolved_format() == "openai_batch"
        )
    if task == "score":
        return pa.Table.from_pydict(
            {
                "id": ids,
                "score": [s[0] if len(s) == 1 else None for s in result.scores],
                "scores": result.scores,
                "endpoint": ["rerank" if p.rerank else "score" for p in valid.pairs],
                "prompt_tokens": result.prompt_tokens,
            },
            schema=SCORE_SCHEMA,
        )
    if task == "classify":
        return pa.Table.from_pydict(
            {
                "id": ids,
                "label": result.labels,
                "probs": result.probs,
                "prompt_tokens": result.prompt_tokens,
            },
            schema=CLASSIFY_SCHEMA,
        )
    choices = result.choices or [[] for _ in ids]
    valid_flags, problems = [], []
    for row_choices, request in zip(choices, valid.requests or [None] * len(ids), strict=True):
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


def rows_invalid_output(table: pa.Table) -> int:
    """Rows whose output fails its structured-output constraint."""
    if "output_valid" not in table.column_names:
        return 0
    return sum(1 for flag in table.column("output_valid").to_pylist() if flag is False)


def _embedding_table(ids: list[str], spans: list[int], result: Any, *, several: bool) -> pa.Table:
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


def errors_table(errors: list[RowError]) -> pa.Table:
    return pa.Table.from_pylist([e.as_record() for e in errors], schema=ERRORS_SCHEMA)


def encode_openai_batch(
    task: str, model: str, spec_hash: str, table: pa.Table, valid: Any = None
) -> bytes:
    """OpenAI Batch API output lines (`id`, `custom_id`, `response`, `error`), one per row.

    `valid` (the chunk's `ValidChunk`) gives rerank rows their documents and `top_n`.
    """
    created = int(time.time())
    lines = []
    for position, row in enumerate(table.to_pylist()):
        custom_id = row["id"]
        rid = oa.request_id(spec_hash, custom_id)
        try:
            body = _response_body(task, model, rid, created, row, valid, position)
            response = oa.BatchResponse(status_code=200, request_id=rid, body=body)
        except Exception as exc:  # the row boundary: one row's body never fails the chunk
            response, error = (
                None,
                oa.BatchError(
                    code="response_failed",
                    message=cap_message(f"the response could not be built ({exc})", 1000),
                ),
            )
        else:
            error = None
            if row.get("output_valid") is False:
                error = oa.BatchError(code="invalid_output", message=row["output_error"] or "")
        line = oa.BatchOutputLine(
            id=f"batch_req_{rid}", custom_id=custom_id, response=response, error=error
        )
        lines.append(line.model_dump_json(exclude_none=False))
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _response_body(
    task: str, model: str, rid: str, created: int, row: dict[str, Any], valid: Any, position: int
) -> dict[str, Any]:
    prompt_tokens = row["prompt_tokens"]
    if task in EMBEDDING_TASKS:
        vectors = row.get("embeddings") or [row["embedding"]]
        return oa.EmbeddingList(
            model=model,
            data=[oa.EmbeddingData(index=i, embedding=v) for i, v in enumerate(vectors)],
            usage=oa.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        ).model_dump(exclude_none=True)
    if task == "score":
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
    if task == "classify":
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
    return _generation_body(task, model, rid, created, row)


def _generation_body(
    task: str, model: str, rid: str, created: int, row: dict[str, Any]
) -> dict[str, Any]:
    """A chat completion or a text completion, with every choice of the row."""
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
    if task in ("chat", "vision_chat"):
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
