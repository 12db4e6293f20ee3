"""Output encoders: a chunk's results as Parquet (explicit schemas) or OpenAI batch JSONL.
Each task's rows, schema and response body are its own (`worker.tasks`); this module
holds what every task shares.

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
from typing import TYPE_CHECKING

import pyarrow as pa

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import ERRORS_SCHEMA
from dagster_gpuinfer.worker.errors import RowError, cap_message
from dagster_gpuinfer.worker.tasks import openai_batch as oa
from dagster_gpuinfer.worker.tasks.pooling import PoolingResult
from dagster_gpuinfer.worker.tasks.table import worker_task

if TYPE_CHECKING:
    from dagster_gpuinfer.worker.rows.validate import ValidChunk
    from dagster_gpuinfer.worker.stage_messages import ChunkResult  # the room above: a type


def output_table(
    spec: InferenceSpec, valid: ValidChunk, result: ChunkResult | PoolingResult
) -> pa.Table:
    """The output rows of one validated chunk (`validate.ValidChunk`) and its results, in
    the task's schema (`tasks.WorkerTask.output_table`), with an `adapter` column (each
    row's LoRA adapter, null for the base model) when the pipeline lists adapters."""
    table = worker_task(spec.task).output_table(spec, valid, result)
    if spec.lora_adapters:
        adapters = [request.adapter for request in valid.requests]
        table = table.append_column(
            pa.field("adapter", pa.string()), pa.array(adapters, pa.string())
        )
    return table


def rows_invalid_output(table: pa.Table) -> int:
    """Rows whose output fails its structured-output constraint."""
    if "output_valid" not in table.column_names:
        return 0
    return sum(1 for flag in table.column("output_valid").to_pylist() if flag is False)


def errors_table(errors: list[RowError]) -> pa.Table:
    return pa.Table.from_pylist([e.as_record() for e in errors], schema=ERRORS_SCHEMA)


def encode_openai_batch(
    task: str, model: str, spec_hash: str, table: pa.Table, valid: ValidChunk | None = None
) -> bytes:
    """OpenAI Batch API output lines (`id`, `custom_id`, `response`, `error`), one per row.

    `valid` (the chunk's `ValidChunk`) gives rerank rows their documents and `top_n`.
    """
    created = int(time.time())
    answering = worker_task(task)
    lines = []
    for position, row in enumerate(table.to_pylist()):
        custom_id = row["id"]
        rid = oa.request_id(spec_hash, custom_id)
        # The model the line named: its LoRA adapter's name, else the base model's.
        adapter = row.get("adapter")
        try:
            body = answering.response_body(adapter or model, rid, created, row, valid, position)
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
