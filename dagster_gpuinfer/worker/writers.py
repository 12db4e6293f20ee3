"""Output encoders: a chunk's results as Parquet (explicit schemas) or OpenAI batch JSONL."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pyarrow as pa

from dagster_gpuinfer.storage import ERRORS_SCHEMA
from dagster_gpuinfer.worker.engine import ChunkResult
from dagster_gpuinfer.worker.errors import RowError

GENERATION_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("generated_tokens", pa.int32()),
    ]
)


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("embedding", pa.list_(pa.float32(), dim)),
            pa.field("prompt_tokens", pa.int32()),
        ]
    )


def output_table(task: str, ids: list[str], result: ChunkResult) -> pa.Table:
    if task == "embed":
        assert result.embeddings is not None
        embeddings = np.ascontiguousarray(result.embeddings, dtype=np.float32)
        dim = embeddings.shape[1] if embeddings.ndim == 2 and embeddings.size else 0
        values = pa.array(embeddings.reshape(-1), type=pa.float32())
        return pa.Table.from_arrays(
            [
                pa.array(ids, pa.string()),
                pa.FixedSizeListArray.from_arrays(values, dim),
                pa.array(result.prompt_tokens, pa.int32()),
            ],
            schema=embedding_schema(dim),
        )
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.string()),
            pa.array(result.texts, pa.string()),
            pa.array(result.finish_reasons, pa.string()),
            pa.array(result.prompt_tokens, pa.int32()),
            pa.array(result.generated_tokens, pa.int32()),
        ],
        schema=GENERATION_SCHEMA,
    )


def errors_table(errors: list[RowError]) -> pa.Table:
    return pa.Table.from_pylist([e.as_record() for e in errors], schema=ERRORS_SCHEMA)


def encode_openai_batch(task: str, model: str, spec_hash: str, table: pa.Table) -> bytes:
    """OpenAI Batch API output lines (`id`, `custom_id`, `response`, `error`), one per row."""
    created = int(time.time())
    lines = []
    for row in table.to_pylist():
        custom_id = row["id"]
        request_id = hashlib.sha256(f"{spec_hash}:{custom_id}".encode()).hexdigest()[:24]
        usage = {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row.get("generated_tokens", 0),
            "total_tokens": row["prompt_tokens"] + row.get("generated_tokens", 0),
        }
        if task == "embed":
            body = {
                "object": "list",
                "model": model,
                "data": [{"object": "embedding", "index": 0, "embedding": row["embedding"]}],
                "usage": {
                    "prompt_tokens": usage["prompt_tokens"],
                    "total_tokens": usage["prompt_tokens"],
                },
            }
        elif task == "chat":
            body = {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": row["text"]},
                        "finish_reason": row["finish_reason"],
                    }
                ],
                "usage": usage,
            }
        else:
            body = {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "text": row["text"], "finish_reason": row["finish_reason"]}
                ],
                "usage": usage,
            }
        lines.append(
            json.dumps(
                {
                    "id": f"batch_req_{request_id}",
                    "custom_id": custom_id,
                    "response": {"status_code": 200, "request_id": request_id, "body": body},
                    "error": None,
                },
                separators=(",", ":"),
            )
        )
    return ("\n".join(lines) + "\n").encode() if lines else b""
