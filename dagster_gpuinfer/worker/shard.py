"""One shard, end to end: stream chunks, validate, infer, write, commit.

Chunk i covers input rows [i * chunk_size, (i + 1) * chunk_size). When a chunk is done its
part file and its errors file are written, then its marker: a chunk counts as committed only
once its marker exists. A worker that restarts (after SIGKILL, eviction, a retry) reads the
markers of the current spec hash, skips those chunks, and rebuilds the set of ids already
taken from their files, so no row is computed twice and no id lands twice. When every chunk
is committed, the partition is committed: `errors.parquet`, then the `_SUCCESS` manifest.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    ChunkMarker,
    FileEntry,
    Manifest,
    chunk_dir,
    chunk_part_name,
    commit_partition,
    filesystem_for,
    partition_dir,
    read_bytes,
    read_chunk_markers,
    read_manifest,
    table_to_parquet_bytes,
    write_chunk_marker,
    write_file_entry,
)
from dagster_gpuinfer.worker.engine import InferenceEngine
from dagster_gpuinfer.worker.readers import ShardReader
from dagster_gpuinfer.worker.validate import RowValidator
from dagster_gpuinfer.worker.writers import encode_openai_batch, errors_table, output_table

log = logging.getLogger("dagster_gpuinfer.worker")


def process_shard(
    engine: InferenceEngine, spec: InferenceSpec, partition_key: str, *, replica: int = 0
) -> tuple[Manifest, bool]:
    """Make partition `partition_key` committed for `spec`.

    Returns:
        The manifest, and whether this call did the work (False: it was already committed).
    """
    started = time.perf_counter()
    spec_hash = spec.spec_hash()
    fs, path = filesystem_for(partition_dir(spec.output, partition_key), spec.storage)
    existing = read_manifest(fs, path)
    if existing is not None and existing.spec_hash == spec_hash:
        return existing, False

    markers = read_chunk_markers(fs, path, spec_hash)
    seen_ids = _committed_ids(fs, path, spec_hash, markers)
    validator = RowValidator(
        task=spec.task,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        seen_ids=seen_ids,
    )
    suffix = ".jsonl" if spec.output.format == "openai_batch" else ".parquet"
    reader = ShardReader(spec, partition_key)
    resumed_rows = 0
    for chunk in reader.chunks(spec.chunk_size):
        if chunk.index in markers:
            resumed_rows += markers[chunk.index].rows_in
            continue
        valid = validator.validate(chunk)
        result = engine.run(valid.token_ids)
        part = None
        if valid.ids:
            table = output_table(spec.task, valid.ids, result)
            data = (
                encode_openai_batch(spec.task, spec.model, spec_hash, table)
                if spec.output.format == "openai_batch"
                else table_to_parquet_bytes(table)
            )
            part = write_file_entry(
                fs, path, chunk_part_name(spec_hash, chunk.index, suffix), data, table.num_rows
            )
        errors = None
        if valid.errors:
            errors = write_file_entry(
                fs,
                chunk_dir(path, spec_hash),
                f"errors-{chunk.index:05d}.parquet",
                table_to_parquet_bytes(errors_table(valid.errors)),
                len(valid.errors),
            )
        marker = ChunkMarker(
            index=chunk.index,
            spec_hash=spec_hash,
            rows_in=chunk.rows_in,
            rows_out=len(valid.ids),
            rows_errored=len(valid.errors),
            prompt_tokens=sum(result.prompt_tokens or ()),
            generated_tokens=sum(result.generated_tokens or ()),
            inference_seconds=result.seconds,
            part=part,
            errors=errors,
        )
        write_chunk_marker(fs, path, marker)
        markers[chunk.index] = marker
        log.info(
            "partition %s chunk %d committed: %d rows out, %d quarantined",
            partition_key, chunk.index, marker.rows_out, marker.rows_errored,
        )

    ordered = [markers[i] for i in sorted(markers)]
    error_tables = [_read_chunk_errors(fs, path, spec_hash, m) for m in ordered if m.errors]
    error_types: Counter[str] = Counter()
    for table in error_tables:
        error_types.update(table.column("error_type").to_pylist())
    manifest = Manifest(
        partition_key=partition_key,
        spec_hash=spec_hash,
        model=spec.model,
        task=spec.task,
        output_format=spec.output.format,
        rows_in=sum(m.rows_in for m in ordered),
        rows_out=sum(m.rows_out for m in ordered),
        rows_errored=sum(m.rows_errored for m in ordered),
        rows_resumed=resumed_rows,
        prompt_tokens=sum(m.prompt_tokens for m in ordered),
        generated_tokens=sum(m.generated_tokens for m in ordered),
        parts=[m.part for m in ordered if m.part is not None],
        errors=FileEntry(name="errors.parquet", rows=0, bytes=0, sha256=""),
        error_types=dict(error_types),
        inference_seconds=sum(m.inference_seconds for m in ordered),
        wall_seconds=time.perf_counter() - started,
        model_load_seconds=engine.load_seconds,
        worker={"host": socket.gethostname(), "pid": os.getpid(), "replica": replica},
    )
    return commit_partition(fs, path, manifest, error_tables), True


def _read_chunk_errors(fs, path: str, spec_hash: str, marker: ChunkMarker) -> pa.Table:
    assert marker.errors is not None
    with fs.open_input_file(posixpath.join(chunk_dir(path, spec_hash), marker.errors.name)) as f:
        return pq.read_table(f)


def _committed_ids(fs, path: str, spec_hash: str, markers: dict[int, ChunkMarker]) -> set[str]:
    """Ids already taken by committed chunks: resume must not let a later duplicate in."""
    ids: set[str] = set()
    for marker in markers.values():
        if marker.part is not None:
            part_path = posixpath.join(path, marker.part.name)
            if marker.part.name.endswith(".parquet"):
                with fs.open_input_file(part_path) as f:
                    ids.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
            else:
                for line in read_bytes(fs, part_path).splitlines():
                    if line.strip():
                        ids.add(json.loads(line)["custom_id"])
        if marker.errors is not None:
            table = _read_chunk_errors(fs, path, spec_hash, marker)
            ids.update(i for i in table.column("id").to_pylist() if i is not None)
    return ids
