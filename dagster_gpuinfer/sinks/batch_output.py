"""A batch API route's sink: a completed batch's output file, as rows of the route's sink,
replaced whole under the batch id.

The batch API service calls `write_batch` when it finalizes a completed batch, with the
output file it publishes: the sink holds what the file holds, row for row. A row of an
OpenAI Batch output line (`response.status_code` 200)::

    partition_key  the batch id (`batch_...`)
    id             the line's custom_id; a line with several results (an embeddings input
                   given as a list, chat or completions with n > 1) gives one row per
                   result, `<custom_id>#<index>` (the result's `index`)
    embedding      /v1/embeddings: `data[i].embedding` (vector(d) in pgvector, list<float>
                   in Delta)
    text           /v1/chat/completions: `choices[i].message.content`; /v1/completions:
                   `choices[i].text`
    spec_hash      the partition's, from its manifest
    tenant         the tenant whose batch it is

Quarantined lines (the batch's error file, `request_counts.failed`) carry no result and are
not written; neither are partial outputs (a cancelled, expired or failed batch's): a sink
holds whole batches.

Imports pyarrow and the sinks: no Dagster, no database driver until a connection is opened.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from dagster_gpuinfer.sinks.delta import DeltaSink
from dagster_gpuinfer.sinks.pgvector import PgVectorSink, SinkLayout, sink_layout
from dagster_gpuinfer.sinks.pgvector_write import (
    SinkError,
    SinkWrite,
    connect,
    ensure_table,
    replace_partition,
)
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage import Manifest


def _results(body: dict[str, Any], layout: SinkLayout) -> list[tuple[int, Any]]:
    """(index, payload) of each result in one response body."""
    if layout.vectors:
        items = body.get("data") or []
        return [(item.get("index", n), item.get("embedding")) for n, item in enumerate(items)]
    results = []
    for n, choice in enumerate(body.get("choices") or []):
        text = (choice.get("message") or {}).get("content") if "message" in choice else None
        results.append((choice.get("index", n), choice.get("text", text)))
    return results


def line_results(output: bytes, layout: SinkLayout, *, batch_id: str) -> Iterator[tuple[str, Any]]:
    """(row id, payload) of each result of the output file's lines (see the module's
    docstring), in the file's order.

    Raises:
        SinkError: not retryable: a line that is not an output line, or a result with no
            payload.
    """
    for number, raw in enumerate(output.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            response = line.get("response") or {}
        except (ValueError, AttributeError):
            raise _refused(
                batch_id, f"output line {number} is not an OpenAI Batch output line"
            ) from None
        if response.get("status_code") != 200:
            continue
        results = _results(response.get("body") or {}, layout)
        for index, payload in sorted(results, key=lambda result: result[0]):
            if payload is None:
                raise _refused(batch_id, f"line {number} ({line.get('custom_id')!r}) has no result")
            yield f"{line.get('custom_id')}{f'#{index}' if len(results) > 1 else ''}", payload


def check_rows(output: bytes, layout: SinkLayout, *, batch_id: str) -> tuple[int, int | None]:
    """(rows, vector length or None) of the output file, read once before anything is sent
    (a failure while the rows stream would look like the sink's own): holds the ids only.

    Raises:
        SinkError: not retryable: `line_results`'s, embeddings of different lengths, or two
            rows with one id.
    """
    seen: set[str] = set()
    dimension = None
    for row_id, payload in line_results(output, layout, batch_id=batch_id):
        if row_id in seen:
            raise _refused(batch_id, f"two rows would have the id {row_id!r}")
        seen.add(row_id)
        if layout.vectors:
            dimension = len(payload) if dimension is None else dimension
            if len(payload) != dimension:
                raise _refused(batch_id, "its embeddings are not all of one length")
    return len(seen), dimension


def _refused(batch_id: str, why: str) -> SinkError:
    return SinkError(f"batch {batch_id}: {why}; nothing was written to the sink", retryable=False)


def _record_batch(ids: list[str], payloads: list, layout: SinkLayout, tenant: str):
    if layout.vectors:
        flat = pa.array([x for vector in payloads for x in vector], pa.float32())
        payload = pa.FixedSizeListArray.from_arrays(flat, len(payloads[0]))
    else:
        payload = pa.array(payloads, pa.string())
    columns = [pa.array(ids, pa.string()), payload, pa.array([tenant] * len(ids), pa.string())]
    return pa.RecordBatch.from_arrays(columns, names=layout.columns)


def _batches(
    output: bytes, layout: SinkLayout, *, batch_id: str, tenant: str, size: int
) -> Iterator[pa.RecordBatch]:
    """The rows, at most `size` a batch: only one batch's payloads are held at a time."""
    ids: list[str] = []
    payloads: list[Any] = []
    for row_id, payload in line_results(output, layout, batch_id=batch_id):
        ids.append(row_id)
        payloads.append(payload)
        if len(ids) == size:
            yield _record_batch(ids, payloads, layout, tenant)
            ids, payloads = [], []
    if ids:
        yield _record_batch(ids, payloads, layout, tenant)


def write_batch(
    sink: PgVectorSink | DeltaSink,
    task: str,
    *,
    tenant: str,
    manifest: Manifest,
    output: bytes,
    storage: StorageOptions | None = None,
    connection: Callable[[PgVectorSink], Any] = connect,
) -> SinkWrite:
    """Replace the batch's rows in `sink` with the rows of its output file (`output`), in one
    transaction (pgvector) or one Delta commit, under `manifest.partition_key` (the batch
    id): a repeat writes the same rows again, never beside them.

    Raises:
        SinkError: nothing of the batch changed in the sink; `retryable` when the server,
            the connection or the storage failed, not when the rows or the settings must.
    """
    layout = sink_layout(task, tenants=True)
    batch_id = manifest.partition_key
    count, dimension = check_rows(output, layout, batch_id=batch_id)
    # The rows the sink must hold for the partition: one per result, not per line.
    rows = manifest.model_copy(update={"rows_out": count})
    batches = _batches(output, layout, batch_id=batch_id, tenant=tenant, size=sink.batch_rows)
    if isinstance(sink, DeltaSink):
        from dagster_gpuinfer.sinks.materialize import delta_write

        return delta_write(sink, storage, layout, rows, batches)
    conn = connection(sink)
    try:
        if not ensure_table(conn, sink, layout, dimension):
            return SinkWrite(partition_key=manifest.partition_key, rows=0)
        return replace_partition(conn, sink, layout, rows, batches)
    finally:
        conn.close()
