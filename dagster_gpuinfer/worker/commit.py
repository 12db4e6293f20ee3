"""The worker's side of the commit protocol (`dagster_gpuinfer.storage` documents it): a
chunk's outputs encoded (Parquet or OpenAI Batch lines) and written with its marker, and a
partition's manifest built from its markers and committed.

The chunks of one partition may be written by several engines of a run (replicas pull
chunks, not shards): they all write under the run's attempt name for the partition, each
chunk once; only the run's coordinator (`worker/run/coordinator.py`) commits the partition,
once the markers of all its chunks are in.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    ERRORS_NAME,
    ChunkMarker,
    FileEntry,
    Manifest,
    PartitionOutput,
    RowCounts,
    commit_partition,
    openai_error_lines,
    read_chunk_errors,
    source_version,
    table_to_parquet_bytes,
    write_chunk_files,
    write_chunk_marker,
    write_reuse_part,
)
from dagster_gpuinfer.storage.digests import (
    INPUT_DIGEST_COLUMN,
    REUSE_KEY_COLUMN,
    digest_columns_metadata,
)
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.rows.readers import RawChunk
from dagster_gpuinfer.worker.rows.validate import ValidChunk
from dagster_gpuinfer.worker.rows.writers import (
    encode_openai_batch,
    errors_table,
    output_table,
    rows_invalid_output,
)
from dagster_gpuinfer.worker.stage_messages import ChunkResult

log = logging.getLogger("dagster_gpuinfer.worker")


def partition_reading(
    spec: InferenceSpec, partition_key: str, *, model: str | None
) -> PartitionOutput:
    """The partition as its shard is now, for the run about to read it (`model`: the model
    folder's version, read once per run).

    Raises:
        ShardError: the shard is not there.
    """
    try:
        source = source_version(spec, partition_key, model=model)
    except FileNotFoundError as exc:
        raise ShardError(
            f"shard {spec.input.shard_uri(partition_key)} of partition {partition_key!r} "
            f"is not there ({exc}); write it, or drop the partition",
            partition_key=partition_key,
        ) from None
    return PartitionOutput.of(spec, partition_key, source=source)


def with_input_digests(table: pa.Table, chunk: RawChunk, valid: ValidChunk, scope: str) -> pa.Table:
    """`table` with each row's input digest (`storage.digests`) and, in its schema metadata,
    the input columns the digests cover and the reuse scope (`scope`): what the backfill
    estimate compares a changed shard with. Unchanged when the reader gave none."""
    if INPUT_DIGEST_COLUMN in table.column_names:  # copied rows' earlier digests: replaced
        table = table.drop_columns([INPUT_DIGEST_COLUMN])
    if not chunk.digests:
        return table
    digests = pa.array([chunk.digests.get(row) for row in valid.rows], pa.string())
    table = table.append_column(INPUT_DIGEST_COLUMN, digests)
    metadata = dict(table.schema.metadata or {})
    metadata.update(digest_columns_metadata(chunk.digest_columns, scope))
    return table.replace_schema_metadata(metadata)


def _keeps_keys(spec: InferenceSpec, table: pa.Table) -> bool:
    """Whether an `openai_batch` chunk's rows are kept as Parquet beside its JSONL part
    (`ChunkMarker.reuse_part`): row reuse is on and some row has a key (not every row is
    unseeded sampling)."""
    if spec.row_reuse == "off" or REUSE_KEY_COLUMN not in table.column_names:
        return False
    keys = table.column(REUSE_KEY_COLUMN)
    return keys.null_count < len(keys)


def write_chunk(
    spec: InferenceSpec,
    where: PartitionOutput,
    chunk: RawChunk,
    valid: ValidChunk,
    result: ChunkResult,
    attempt: str,
    *,
    engine_seconds: float | None = None,
    table: pa.Table | None = None,
    rows_reused: int = 0,
    rows_deduplicated: int = 0,
    job: str | None = None,
) -> ChunkMarker:
    """Write one chunk's outputs and quarantined rows; its marker, written last, commits it.

    The writer takes a chunk the moment its last row is done, and `result.seconds` runs from
    its first row submitted to then: so the chunk's inference interval ends now.
    `engine_seconds` is its rows' share of the engine's time (default: `result.seconds`).
    `table`: the chunk's output rows already built (row reuse: computed and copied rows
    together, `rows_reused` and `rows_deduplicated` of them copied); default: `result`'s.
    `job`: the pool job of the chunk-range lease that wrote it (`ChunkMarker.job`).
    `openai_batch` output: the JSONL part holds OpenAI's lines only; the rows with their
    reuse keys and input digests go to the reuse file beside it (`ChunkMarker.reuse_part`).
    """
    finished_at = time.time()
    started = time.perf_counter()
    part = keyed = None
    invalid_outputs = 0
    if valid.ids:
        if table is None:
            table = output_table(spec, valid, result)
        invalid_outputs = rows_invalid_output(table)
        if spec.output.format == "openai_batch":
            data = encode_openai_batch(spec.task, spec.served_model, where.spec_hash, table, valid)
            part = (data, ".jsonl", table.num_rows)
            if _keeps_keys(spec, table):  # the keys go beside the JSONL, never into it
                keyed = with_input_digests(table, chunk, valid, spec.reuse_scope())
        else:
            table = with_input_digests(table, chunk, valid, spec.reuse_scope())
            part = (table_to_parquet_bytes(table), ".parquet", table.num_rows)
    errors = errors_table(valid.errors) if valid.errors else None

    def write_files() -> tuple[FileEntry | None, FileEntry | None, FileEntry | None]:
        reuse = None if keyed is None else write_reuse_part(where, chunk.index, attempt, keyed)
        return reuse, *write_chunk_files(where, chunk.index, attempt, part=part, errors=errors)

    reuse_part, part_entry, errors_entry = where.beside_commits(write_files)
    marker = ChunkMarker(
        index=chunk.index,
        spec_hash=where.spec_hash,
        source=where.source,
        rows_in=chunk.rows_in,
        rows_out=len(valid.ids),
        rows_errored=len(valid.errors),
        rows_invalid_output=invalid_outputs,
        rows_reused=rows_reused,
        rows_deduplicated=rows_deduplicated,
        prompt_tokens=sum(result.prompt_tokens or ()),
        generated_tokens=sum(result.generated_tokens or ()),
        images=valid.image_count,
        image_bytes=valid.image_bytes,
        inference_seconds=result.seconds,
        engine_seconds=result.seconds if engine_seconds is None else engine_seconds,
        started_at=finished_at - result.seconds,
        finished_at=finished_at,
        write_seconds=time.perf_counter() - started,
        part=part_entry,
        errors=errors_entry,
        reuse_part=reuse_part,
        job=job,
    )
    where.beside_commits(lambda: write_chunk_marker(where.fs, where.path, marker))
    current_metrics().chunk_committed(where.partition_key, marker, valid.errors)
    log.debug(
        "partition %s chunk %d committed: %d rows out, %d quarantined",
        where.partition_key,
        chunk.index,
        marker.rows_out,
        marker.rows_errored,
    )
    return marker


@dataclass(frozen=True)
class PartitionTimes:
    """A partition's times in one attempt: `wall_seconds` from `started_at` (its reading
    began; Unix time) to its commit; the chunks it computed lie within that window."""

    started_at: float
    model_load_seconds: float


def chunk_span(markers: list[ChunkMarker], since: float, until: float) -> tuple[float, float]:
    """(union, span) of the chunks' inference intervals clipped to [since, until]: the union
    counts time in which any chunk was in inference once (chunks overlap under streaming);
    the span runs from the first chunk's start to the last chunk's end. Both are at most
    `until - since`; chunks without times (written by an older worker) count for nothing."""
    intervals = sorted(
        (max(m.started_at, since), min(m.finished_at, until))
        for m in markers
        if m.started_at is not None and m.finished_at is not None
    )
    intervals = [(start, end) for start, end in intervals if end > start]
    if not intervals:
        return 0.0, 0.0
    union = 0.0
    current_start, current_end = intervals[0]
    for start, end in intervals[1:]:
        if start > current_end:
            union += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    union += current_end - current_start
    span = max(end for _, end in intervals) - intervals[0][0]
    return union, span


def commit_chunks(
    where: PartitionOutput,
    spec: InferenceSpec,
    markers: dict[int, ChunkMarker],
    *,
    computed: set[int],
    rows_resumed: int,
    times: PartitionTimes,
    worker: dict[str, object],
) -> Manifest:
    """Commit a partition from its chunk markers: gather the errors, then write the manifest.

    `computed` names the chunks this attempt computed (the others were resumed): the
    partition's own figures (`computed` counts, `engine_seconds`, `active_seconds`,
    `inference_seconds`, `commit_seconds`) come from those alone.
    """
    ordered = [markers[i] for i in sorted(markers)]
    error_tables = [read_chunk_errors(where, m) for m in ordered if m.errors]
    error_types: Counter[str] = Counter()
    for table in error_tables:
        error_types.update(table.column("error_type").to_pylist())
    now = time.time()
    this_attempt = [m for m in ordered if m.index in computed]
    union, span = chunk_span(this_attempt, times.started_at, now)
    telemetry = current_metrics().partition_telemetry(
        where.partition_key,
        rows_resumed=rows_resumed,
        commit_seconds=sum(m.write_seconds for m in this_attempt),
    )
    manifest = Manifest(
        partition_key=where.partition_key,
        spec_hash=where.spec_hash,
        source=where.source,
        model=spec.model,
        task=spec.task,
        output_format=spec.output.format,
        **RowCounts.total(ordered).model_dump(),
        rows_resumed=rows_resumed,
        parts=[m.part for m in ordered if m.part is not None],
        reuse_parts=[m.reuse_part for m in ordered if m.reuse_part is not None],
        errors=FileEntry(name=ERRORS_NAME, rows=0, bytes=0, sha256=""),
        error_types=dict(error_types),
        inference_seconds=union,
        wall_seconds=now - times.started_at,
        active_seconds=span,
        engine_seconds=sum(m.engine_seconds for m in this_attempt),
        computed=RowCounts.total(this_attempt),
        model_load_seconds=times.model_load_seconds,
        worker=worker,
        telemetry=telemetry,
    )
    openai_errors = None
    if spec.output.format == "openai_batch":
        openai_errors = openai_error_lines(where.spec_hash, error_tables)
    attempt = worker.get("attempt")
    return commit_partition(
        where.fs,
        where.path,
        manifest,
        error_tables,
        where.storage,
        openai_errors=openai_errors,
        attempt=attempt if isinstance(attempt, str) else None,
    )
