"""One output partition's files: chunk part files and markers, then the partition's commit.

Chunk i covers input rows [i * chunk_size, (i + 1) * chunk_size). When a chunk is done, its
part file and its errors file are written under names unique to this attempt, then its
marker, which names those files: a chunk counts as committed only once its marker exists.
A worker that restarts (after SIGKILL, eviction, a retry) reads the markers of the current
spec hash and source version (the shard and model files as they are now: a rewritten
shard's old chunks are never resumed), skips those chunks, and rebuilds the set of ids
already taken from their files, so no row is computed twice and no id lands twice. When
every chunk is committed, the partition is committed: its error files (named for the
attempt), then the `_SUCCESS` manifest naming them.

The chunks of one partition may be written by several engines of a run (replicas pull
chunks, not shards): they all write under the run's attempt name for the partition, each
chunk once; only the run's coordinator (`worker/coordinator.py`) commits the partition,
once the markers of all its chunks are in.

Two workers racing on one partition never write the same file (attempt-unique names), and
each checks before every chunk and before committing whether the partition has been
committed for this spec meanwhile: the later one then stops and reports the committed
manifest, leaving the committed files alone.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import InferenceSpec, StorageOptions
from dagster_gpuinfer.storage import (
    CHUNKS_DIR,
    ERRORS_NAME,
    ChunkMarker,
    FileEntry,
    Manifest,
    RowCounts,
    SourceVersion,
    chunk_dir,
    chunk_part_name,
    commit_partition,
    delete_quietly,
    filesystem_for,
    list_names,
    partition_dir,
    read_bytes,
    read_chunk_markers,
    read_manifest,
    source_version,
    table_to_parquet_bytes,
    write_chunk_marker,
    write_file_entry,
)
from dagster_gpuinfer.worker.engine import ChunkResult
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.openai_batch import openai_error_lines
from dagster_gpuinfer.worker.readers import RawChunk
from dagster_gpuinfer.worker.validate import ValidChunk
from dagster_gpuinfer.worker.writers import (
    encode_openai_batch,
    errors_table,
    output_table,
    rows_invalid_output,
)

log = logging.getLogger("dagster_gpuinfer.worker")


@dataclass
class PartitionOutput:
    """Where one output partition's files live, and the spec hash and source version (the
    shard's and the model folder's, `storage.SourceVersion`) they must carry."""

    fs: pafs.FileSystem
    path: str
    spec_hash: str
    partition_key: str
    source: SourceVersion
    storage: StorageOptions | None = None

    @classmethod
    def of(
        cls, spec: InferenceSpec, partition_key: str, *, source: SourceVersion
    ) -> PartitionOutput:
        fs, path = filesystem_for(partition_dir(spec.output, partition_key), spec.storage)
        return cls(
            fs=fs,
            path=path,
            spec_hash=spec.spec_hash(),
            partition_key=partition_key,
            source=source,
            storage=spec.storage,
        )

    @classmethod
    def reading(
        cls, spec: InferenceSpec, partition_key: str, *, model: str | None
    ) -> PartitionOutput:
        """The partition as its shard is now, for the run about to read it (`model`: the
        model folder's version, read once per run).

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
        return cls.of(spec, partition_key, source=source)

    def committed(self) -> Manifest | None:
        """The manifest if the partition is committed for this spec and source (by anyone),
        else None."""
        manifest = read_manifest(self.fs, self.path)
        if manifest is not None and manifest.computed_from(self.spec_hash, self.source):
            return manifest
        return None

    def markers(self) -> dict[int, ChunkMarker]:
        """The chunks committed for this spec and source, by index."""
        return read_chunk_markers(self.fs, self.path, self.spec_hash, self.source)

    def yield_to(self, manifest: Manifest, attempt: str) -> Manifest:
        """Another worker committed this partition while this one ran: remove this attempt's
        own files that the manifest does not name, and leave everything else alone."""
        log.info("partition %s was committed by another worker; stopping", self.partition_key)
        named = {part.name for part in manifest.parts}
        own = [
            posixpath.join(self.path, name)
            for name in list_names(self.fs, self.path)
            if f"-{attempt}." in name and name not in named
        ]
        delete_quietly(self.fs, [*own, posixpath.join(self.path, CHUNKS_DIR)])
        return manifest


def write_chunk(
    spec: InferenceSpec,
    where: PartitionOutput,
    chunk: RawChunk,
    valid: ValidChunk,
    result: ChunkResult,
    attempt: str,
    *,
    engine_seconds: float | None = None,
) -> ChunkMarker:
    """Write one chunk's outputs and quarantined rows; its marker, written last, commits it.

    The writer takes a chunk the moment its last row is done, and `result.seconds` runs from
    its first row submitted to then: so the chunk's inference interval ends now.
    `engine_seconds` is its rows' share of the engine's time (default: `result.seconds`).
    """
    finished_at = time.time()
    started = time.perf_counter()
    part = None
    invalid_outputs = 0
    if valid.ids:
        table = output_table(spec, valid, result)
        invalid_outputs = rows_invalid_output(table)
        if spec.output.format == "openai_batch":
            data = encode_openai_batch(spec.task, spec.model, where.spec_hash, table, valid)
            suffix = ".jsonl"
        else:
            data = table_to_parquet_bytes(table)
            suffix = ".parquet"
        name = chunk_part_name(where.spec_hash, chunk.index, attempt, suffix)
        part = write_file_entry(where.fs, where.path, name, data, table.num_rows)
    errors = None
    if valid.errors:
        errors = write_file_entry(
            where.fs,
            chunk_dir(where.path, where.spec_hash),
            f"errors-{chunk.index:05d}-{attempt}.parquet",
            table_to_parquet_bytes(errors_table(valid.errors)),
            len(valid.errors),
        )
    marker = ChunkMarker(
        index=chunk.index,
        spec_hash=where.spec_hash,
        source=where.source,
        rows_in=chunk.rows_in,
        rows_out=len(valid.ids),
        rows_errored=len(valid.errors),
        rows_invalid_output=invalid_outputs,
        prompt_tokens=sum(result.prompt_tokens or ()),
        generated_tokens=sum(result.generated_tokens or ()),
        images=valid.image_count,
        image_bytes=valid.image_bytes,
        inference_seconds=result.seconds,
        engine_seconds=result.seconds if engine_seconds is None else engine_seconds,
        started_at=finished_at - result.seconds,
        finished_at=finished_at,
        write_seconds=time.perf_counter() - started,
        part=part,
        errors=errors,
    )
    write_chunk_marker(where.fs, where.path, marker)
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


def read_chunk_errors(where: PartitionOutput, marker: ChunkMarker) -> pa.Table:
    assert marker.errors is not None
    path = posixpath.join(chunk_dir(where.path, where.spec_hash), marker.errors.name)
    with where.fs.open_input_file(path) as handle:
        return pq.read_table(handle)


def committed_ids(where: PartitionOutput, markers: dict[int, ChunkMarker]) -> set[str]:
    """Ids already taken by committed chunks: resume must not let a later duplicate in."""
    ids: set[str] = set()
    for marker in markers.values():
        if marker.part is not None:
            part_path = posixpath.join(where.path, marker.part.name)
            if marker.part.name.endswith(".parquet"):
                with where.fs.open_input_file(part_path) as handle:
                    ids.update(pq.read_table(handle, columns=["id"]).column("id").to_pylist())
            else:
                for line in read_bytes(where.fs, part_path).splitlines():
                    if line.strip():
                        ids.add(json.loads(line)["custom_id"])
        if marker.errors is not None:
            table = read_chunk_errors(where, marker)
            ids.update(i for i in table.column("id").to_pylist() if i is not None)
    return ids
