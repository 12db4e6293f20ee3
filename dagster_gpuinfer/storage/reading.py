"""Readers of partitions: committed outputs and error files, the progress of partitions
still being written, and an `openai_batch` partition's output and error lines.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import OutputSpec, StorageOptions
from dagster_gpuinfer.storage.files import (
    display_uri,
    filesystem_for,
    list_names,
    plain_file_name,
    read_bytes,
)
from dagster_gpuinfer.storage.layout import (
    CHUNKS_DIR,
    MANIFEST_NAME,
    ChunkMarker,
    Manifest,
    RowCounts,
    chunk_dir,
    partition_dir,
    read_chunk_markers,
    read_manifest,
)
from dagster_gpuinfer.storage.openai_lines import openai_error_lines

T = TypeVar("T")


def read_partition(
    output: OutputSpec, partition_key: str, storage: StorageOptions | None = None
) -> pa.Table:
    """The committed output rows of one partition, read through its manifest.

    Raises:
        FileNotFoundError: the partition has no manifest (not committed yet).
    """
    fs, path = filesystem_for(partition_dir(output, partition_key), storage)
    manifest = read_manifest(fs, path)
    if manifest is None:
        raise FileNotFoundError(
            f"partition {partition_key!r} of {output.asset_name!r} is not committed: no "
            f"{MANIFEST_NAME} in {display_uri(fs, path)}; materialize it first"
        )
    tables = []
    for part in manifest.parts:
        part_path = posixpath.join(path, part.name)
        if part.name.endswith(".parquet"):
            with fs.open_input_file(part_path) as handle:
                tables.append(pq.read_table(handle))
        else:
            lines = read_bytes(fs, part_path).splitlines()
            tables.append(pa.Table.from_pylist([json.loads(line) for line in lines if line]))
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")


def partition_error_files(
    output: OutputSpec, partition_key: str, storage: StorageOptions | None = None
) -> dict[str, str]:
    """The error files of a committed partition, as its manifest names them: `parquet`
    (every quarantined row, with its reason) and, for openai_batch output, `openai_jsonl`
    (the same rows as OpenAI Batch error lines: what a batch API serves as the error file).
    Values are full paths on the output's filesystem.

    Raises:
        FileNotFoundError: the partition has no manifest (not committed yet).
    """
    fs, path = filesystem_for(partition_dir(output, partition_key), storage)
    manifest = read_manifest(fs, path)
    if manifest is None:
        raise FileNotFoundError(
            f"partition {partition_key!r} of {output.asset_name!r} is not committed: no "
            f"{MANIFEST_NAME} in {display_uri(fs, path)}; materialize it first"
        )
    files = {"parquet": posixpath.join(path, manifest.errors.name)}
    if manifest.openai_errors is not None:
        files["openai_jsonl"] = posixpath.join(path, manifest.openai_errors.name)
    return files


def read_errors(
    output: OutputSpec, partition_key: str, storage: StorageOptions | None = None
) -> pa.Table:
    """The quarantined rows of a committed partition (through its manifest)."""
    fs, _ = filesystem_for(partition_dir(output, partition_key), storage)
    with fs.open_input_file(partition_error_files(output, partition_key, storage)["parquet"]) as h:
        return pq.read_table(h)


@dataclass(frozen=True)
class OpenAIBatchFiles:
    """What one `openai_batch` partition holds now: its output lines and its error lines.

    `committed` is True when the manifest exists (the whole shard); otherwise the lines are
    those of the chunks committed so far (partial output: a cancelled or expired batch), and
    each committed chunk counts once: the chunk marker names the one part file of the attempt
    that counts.
    """

    committed: bool
    rows_out: int
    rows_errored: int
    output: bytes
    errors: bytes


def _chunk_markers_of_any_spec(fs: pafs.FileSystem, partition_path: str) -> list[ChunkMarker]:
    markers: list[ChunkMarker] = []
    for spec_hash in list_names(fs, posixpath.join(partition_path, CHUNKS_DIR)):
        if not spec_hash.startswith(".tmp-"):
            markers.extend(read_chunk_markers(fs, partition_path, spec_hash).values())
    return sorted(markers, key=lambda marker: (marker.spec_hash, marker.index))


def partition_progress(
    output: OutputSpec, partition_key: str, storage: StorageOptions | None = None
) -> tuple[bool, RowCounts]:
    """`(committed, counts)` of a partition: its manifest's counts once committed, else the
    sum of the chunk markers written so far (rises while a worker runs)."""
    fs, path = filesystem_for(partition_dir(output, partition_key), storage)
    found = _read_partition(fs, path, RowCounts.total)
    if isinstance(found, Manifest):
        return True, found.counts()
    return False, found


def _read_partition(
    fs: pafs.FileSystem, path: str, read_chunks: Callable[[list[ChunkMarker]], T]
) -> Manifest | T:
    """A partition's manifest once committed, else `read_chunks(its chunk markers)`, for a
    reader outside the worker (the batch API polls partitions while workers commit them).

    The commit writes the manifest first and only then deletes the chunk markers and the
    chunk files, so a read of the chunks that finds no manifest after it saw them whole;
    one that finds the manifest after it (the chunks may have vanished under it: fewer
    markers, or a file gone) gives way to the manifest.
    """
    manifest = read_manifest(fs, path)
    if manifest is not None:
        return manifest
    try:
        found, vanished = read_chunks(_chunk_markers_of_any_spec(fs, path)), None
    except FileNotFoundError as error:
        found, vanished = None, error
    manifest = read_manifest(fs, path)
    if manifest is not None:
        return manifest
    if vanished is not None:  # deleted with no commit behind it: not the race above
        raise vanished
    return found


def read_openai_batch_files(
    output: OutputSpec, partition_key: str, storage: StorageOptions | None = None
) -> OpenAIBatchFiles:
    """The OpenAI Batch output and error lines of a partition written with
    `output_format="openai_batch"`: the one place that knows where they are.

    Committed: the part files and the error file named by the manifest. Not committed: the
    part files named by the chunk markers, and each chunk's quarantined rows as error lines
    (the same lines the commit would write to the error file).
    """
    fs, path = filesystem_for(partition_dir(output, partition_key), storage)
    found = _read_partition(fs, path, lambda markers: _openai_batch_chunks(fs, path, markers))
    if not isinstance(found, Manifest):
        return found
    output_bytes = b"".join(read_bytes(fs, posixpath.join(path, p.name)) for p in found.parts)
    errors = b""
    if found.openai_errors is not None:
        errors = read_bytes(fs, posixpath.join(path, found.openai_errors.name))
    return OpenAIBatchFiles(True, found.rows_out, found.rows_errored, output_bytes, errors)


def _openai_batch_chunks(
    fs: pafs.FileSystem, path: str, markers: list[ChunkMarker]
) -> OpenAIBatchFiles:
    """The output and error lines of the chunks committed so far (partition not committed)."""
    parts: list[bytes] = []
    error_lines: list[bytes] = []
    rows_out = rows_errored = 0
    for marker in markers:
        if marker.part is not None:
            parts.append(read_bytes(fs, posixpath.join(path, plain_file_name(marker.part.name))))
        if marker.errors is not None:
            errors_path = posixpath.join(
                chunk_dir(path, marker.spec_hash), plain_file_name(marker.errors.name)
            )
            with fs.open_input_file(errors_path) as handle:
                error_lines.append(openai_error_lines(marker.spec_hash, [pq.read_table(handle)]))
        rows_out += marker.rows_out
        rows_errored += marker.rows_errored
    return OpenAIBatchFiles(False, rows_out, rows_errored, b"".join(parts), b"".join(error_lines))
