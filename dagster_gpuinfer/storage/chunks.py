"""The chunks of one partition being written: where they go, their files, what they hold.

A run writes a partition through a `PartitionOutput` (its folder, spec hash and source
version): each chunk's part file and errors file under names unique to the attempt
(`write_chunk_files`), then its marker (`layout.write_chunk_marker`), which commits the chunk.
A restarted run reads the markers back (`PartitionOutput.markers`), so it resumes instead of
recomputing.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import InferenceSpec, StorageOptions
from dagster_gpuinfer.storage.files import (
    FileEntry,
    delete_quietly,
    filesystem_for,
    list_names,
    table_to_parquet_bytes,
    write_file_entry,
)
from dagster_gpuinfer.storage.layout import (
    CHUNKS_DIR,
    ChunkMarker,
    Manifest,
    chunk_dir,
    chunk_part_name,
    error_file_names,
    named_files,
    partition_dir,
    read_chunk_markers,
    read_manifest,
    reuse_part_name,
)
from dagster_gpuinfer.storage.versions import SourceVersion

log = logging.getLogger("dagster_gpuinfer.worker")

T = TypeVar("T")

# How many times `PartitionOutput.beside_commits` tries a write.
WRITE_TRIES = 3


@dataclass
class PartitionOutput:
    """Where one output partition's files live, and the spec hash and source version (the
    shard's and the model folder's, `SourceVersion`) they must carry."""

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

    def is_own(self, manifest: Manifest, attempt: str) -> bool:
        """Whether `manifest` is this attempt's own commit (its errors file carries the
        attempt's name): a manifest write that applied although the store answered with an
        error, found in place afterwards."""
        return manifest.errors.name == error_file_names(self.spec_hash, attempt)[0]

    def beside_commits(self, write: Callable[[], T]) -> T:
        """`write()` (this attempt's chunk files), tried again when it failed because another
        worker committed the partition meanwhile: the committer's clean-up deletes what its
        manifest does not name (temporary files, the chunk folder), which can pull a file
        from under a write in progress. What is written then belongs to a losing attempt,
        and its yield (`yield_to`) removes it.

        Raises:
            OSError: the write failed and no other worker has committed the partition, or it
                failed `WRITE_TRIES` times.
        """
        for tries_left in range(WRITE_TRIES - 1, -1, -1):
            try:
                return write()
            except OSError:
                if tries_left == 0 or self.committed() is None:
                    raise
                log.info(
                    "partition %s: a chunk write met another worker's commit; writing again",
                    self.partition_key,
                )
        raise AssertionError("unreachable")

    def yield_to(self, manifest: Manifest, attempt: str) -> Manifest:
        """Another worker committed this partition while this one ran: remove this attempt's
        own files that the manifest does not name, and leave everything else alone."""
        log.info("partition %s was committed by another worker; stopping", self.partition_key)
        named = named_files(manifest)
        own = [
            posixpath.join(self.path, name)
            for name in list_names(self.fs, self.path)
            if f"-{attempt}." in name and name not in named
        ]
        delete_quietly(self.fs, [*own, posixpath.join(self.path, CHUNKS_DIR)])
        return manifest


def write_chunk_files(
    where: PartitionOutput,
    index: int,
    attempt: str,
    *,
    part: tuple[bytes, str, int] | None,
    errors: pa.Table | None,
) -> tuple[FileEntry | None, FileEntry | None]:
    """Write chunk `index`'s part file (`part`: its bytes, suffix and rows) and its errors
    file (the quarantined rows, `ERRORS_SCHEMA`), under names unique to `attempt`; returns
    their entries for the chunk's marker, which the caller writes last."""
    part_entry = errors_entry = None
    if part is not None:
        data, suffix, rows = part
        name = chunk_part_name(where.spec_hash, index, attempt, suffix)
        part_entry = write_file_entry(where.fs, where.path, name, data, rows)
    if errors is not None:
        errors_entry = write_file_entry(
            where.fs,
            chunk_dir(where.path, where.spec_hash),
            f"errors-{index:05d}-{attempt}.parquet",
            table_to_parquet_bytes(errors),
            errors.num_rows,
        )
    return part_entry, errors_entry


def write_reuse_part(
    where: PartitionOutput, index: int, attempt: str, table: pa.Table
) -> FileEntry:
    """Write the Parquet file beside chunk `index`'s `openai_batch` part: its output rows with
    their reuse keys and input digests (`layout.reuse_part_name`), before the marker."""
    name = reuse_part_name(where.spec_hash, index, attempt)
    data = table_to_parquet_bytes(table)
    return write_file_entry(where.fs, where.path, name, data, table.num_rows)


def read_chunk_errors(where: PartitionOutput, marker: ChunkMarker) -> pa.Table:
    """The quarantined rows of a committed chunk."""
    assert marker.errors is not None
    path = posixpath.join(chunk_dir(where.path, where.spec_hash), marker.errors.name)
    with where.fs.open_input_file(path) as handle:
        return pq.read_table(handle)
