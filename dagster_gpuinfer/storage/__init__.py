"""Storage: the outputs of inference on local disk or S3, and the one commit protocol.

Shared by the worker (which writes) and the control plane, the batch API and the sinks
(which read). Imports pyarrow and pydantic only, never the worker.

Modules: `files` (filesystems, atomic writes, listing), `versions` (the shard's and the model
folder's versions), `layout` (names, chunk markers, the manifest), `chunks` (a partition being
written: chunk files, markers read back, ids taken), `commit` (the partition's commit),
`reading` (committed partitions and error files, progress), `openai_lines` (error lines).

Layout of one output partition::

    <root>/<asset>/<partition dir>/
        part-<spec hash>-<chunk>-<attempt>.parquet   one file per committed chunk
        errors-<spec hash>-<attempt>.parquet         quarantined rows, with a reason
        errors-<spec hash>-<attempt>.jsonl           the same as OpenAI error lines
                                                     (openai_batch output only)
        reuse-<spec hash>-<chunk>-<attempt>.parquet  openai_batch output only: each part's
                                                     rows with their reuse keys, for row reuse
        _SUCCESS                                     the manifest, written last
        _chunks/<spec hash>/<chunk>.json             chunk markers (deleted at commit)
        _chunks/<spec hash>/errors-<chunk>-<attempt>.parquet

The commit protocol, the contract every writer (a run's worker, a pool worker, a sink)
builds on:

1. Files. Every file is written under a temporary name and renamed (local disk) or written
   in one PUT (S3) (`files.write_bytes_atomic`), so a reader never sees half a file. Every
   name a run writes carries its attempt (`chunk_part_name`, `error_file_names`), so two
   attempts racing on one partition never write the same file.
2. Chunks. Chunk i covers input rows [i * chunk_size, (i + 1) * chunk_size). When all its rows
   are done, its part file and its errors file are written (`chunks.write_chunk_files`),
   then its marker (`layout.write_chunk_marker`), which names them: a chunk counts as
   committed only once its marker exists. A marker records the spec hash and the source
   version (the shard and model files as they were read), so a rewritten shard's or an
   older spec's chunks are never resumed. The chunks of one partition may be written by
   several engines of a run, each chunk once, under the run's attempt name.
3. Resume. A restarted run reads the markers of its spec hash and source version
   (`PartitionOutput.markers`) and skips those chunks; it screens the ids of every chunk
   from the shard's start, committed or not, so the first occurrence of an id wins as in
   one uninterrupted run (chunks commit out of order), no row is computed twice and no id
   lands twice or is lost.
4. Partition commit. When every chunk is committed, one committer per partition (the run's
   coordinator; for a pool's chunk-range leases, `pools/ranges.py`, the range's worker that
   finds every chunk's marker in after writing its own) commits it
   (`commit.commit_partition`): the error files (named for the attempt), then the
   `_SUCCESS` manifest naming the part files and error files, created exclusively: of two
   attempts racing on one partition exactly one commits, the other gets `CommitConflict`
   with the winner's manifest and removes only its own files that the manifest does not
   name (`PartitionOutput.yield_to`). A manifest write that applied although the store
   answered with an error (an S3 5xx or reset after the PUT; the client's retry then fails
   its `If-None-Match` on the very object) is recognised as the committer's own by its
   errors file's name, which is unique to the commit, and counts as committed.
   Files the manifest does not name (older specs, the loser, killed attempts, chunk
   markers) are deleted by the winner, after its manifest is in place, so a crash at any
   point leaves either the old committed state or the new one. That clean-up can pull a
   file from under the loser's chunk write in progress (its temporary file, the chunk
   folder); the loser then writes the chunk again, and its yield removes it
   (`PartitionOutput.beside_commits`).
5. Done. A partition is done only when `_SUCCESS` exists and names the current spec hash and
   source version (`layout.committed_manifest`). The manifest is the one source of which
   files count (`reading.read_partition`, `reading.partition_error_files`); partitions
   committed before error files carried the attempt name the fixed names `errors.parquet` /
   `errors.jsonl` in their manifests. Exactly-once lives here, in markers and manifests,
   never in a queue.
"""

from __future__ import annotations

from dagster_gpuinfer.storage.chunks import (
    PartitionOutput as PartitionOutput,
)
from dagster_gpuinfer.storage.chunks import (
    read_chunk_errors as read_chunk_errors,
)
from dagster_gpuinfer.storage.chunks import (
    write_chunk_files as write_chunk_files,
)
from dagster_gpuinfer.storage.chunks import (
    write_reuse_part as write_reuse_part,
)
from dagster_gpuinfer.storage.commit import (
    CommitConflict as CommitConflict,
)
from dagster_gpuinfer.storage.commit import (
    clear_unnamed as clear_unnamed,
)
from dagster_gpuinfer.storage.commit import (
    commit_partition as commit_partition,
)
from dagster_gpuinfer.storage.commit import (
    create_exclusive as create_exclusive,
)
from dagster_gpuinfer.storage.commit import (
    verify_manifest as verify_manifest,
)
from dagster_gpuinfer.storage.files import (
    FileEntry as FileEntry,
)
from dagster_gpuinfer.storage.files import (
    count_rows as count_rows,
)
from dagster_gpuinfer.storage.files import (
    delete_quietly as delete_quietly,
)
from dagster_gpuinfer.storage.files import (
    display_uri as display_uri,
)
from dagster_gpuinfer.storage.files import (
    exists as exists,
)
from dagster_gpuinfer.storage.files import (
    filesystem_for as filesystem_for,
)
from dagster_gpuinfer.storage.files import (
    list_names as list_names,
)
from dagster_gpuinfer.storage.files import (
    local_temporary_copy as local_temporary_copy,
)
from dagster_gpuinfer.storage.files import (
    plain_file_name as plain_file_name,
)
from dagster_gpuinfer.storage.files import (
    read_bytes as read_bytes,
)
from dagster_gpuinfer.storage.files import (
    s3_client as s3_client,
)
from dagster_gpuinfer.storage.files import (
    table_to_parquet_bytes as table_to_parquet_bytes,
)
from dagster_gpuinfer.storage.files import (
    write_bytes_atomic as write_bytes_atomic,
)
from dagster_gpuinfer.storage.files import (
    write_file_entry as write_file_entry,
)
from dagster_gpuinfer.storage.layout import (
    CHUNKS_DIR as CHUNKS_DIR,
)
from dagster_gpuinfer.storage.layout import (
    ERRORS_NAME as ERRORS_NAME,
)
from dagster_gpuinfer.storage.layout import (
    ERRORS_SCHEMA as ERRORS_SCHEMA,
)
from dagster_gpuinfer.storage.layout import (
    MANIFEST_NAME as MANIFEST_NAME,
)
from dagster_gpuinfer.storage.layout import (
    MANIFEST_VERSION as MANIFEST_VERSION,
)
from dagster_gpuinfer.storage.layout import (
    MODEL_AS_RECORDED as MODEL_AS_RECORDED,
)
from dagster_gpuinfer.storage.layout import (
    OPENAI_ERRORS_NAME as OPENAI_ERRORS_NAME,
)
from dagster_gpuinfer.storage.layout import (
    ChunkMarker as ChunkMarker,
)
from dagster_gpuinfer.storage.layout import (
    Manifest as Manifest,
)
from dagster_gpuinfer.storage.layout import (
    RowCounts as RowCounts,
)
from dagster_gpuinfer.storage.layout import (
    chunk_dir as chunk_dir,
)
from dagster_gpuinfer.storage.layout import (
    chunk_part_name as chunk_part_name,
)
from dagster_gpuinfer.storage.layout import (
    committed_manifest as committed_manifest,
)
from dagster_gpuinfer.storage.layout import (
    committed_manifests as committed_manifests,
)
from dagster_gpuinfer.storage.layout import (
    error_file_names as error_file_names,
)
from dagster_gpuinfer.storage.layout import (
    manifest_path as manifest_path,
)
from dagster_gpuinfer.storage.layout import (
    partition_dir as partition_dir,
)
from dagster_gpuinfer.storage.layout import (
    partition_dir_name as partition_dir_name,
)
from dagster_gpuinfer.storage.layout import (
    read_chunk_markers as read_chunk_markers,
)
from dagster_gpuinfer.storage.layout import (
    read_manifest as read_manifest,
)
from dagster_gpuinfer.storage.layout import (
    write_chunk_marker as write_chunk_marker,
)
from dagster_gpuinfer.storage.openai_lines import (
    BatchError as BatchError,
)
from dagster_gpuinfer.storage.openai_lines import (
    BatchOutputLine as BatchOutputLine,
)
from dagster_gpuinfer.storage.openai_lines import (
    BatchResponse as BatchResponse,
)
from dagster_gpuinfer.storage.openai_lines import (
    error_line as error_line,
)
from dagster_gpuinfer.storage.openai_lines import (
    openai_error_lines as openai_error_lines,
)
from dagster_gpuinfer.storage.openai_lines import (
    request_id as request_id,
)
from dagster_gpuinfer.storage.reading import (
    OpenAIBatchFiles as OpenAIBatchFiles,
)
from dagster_gpuinfer.storage.reading import (
    partition_error_files as partition_error_files,
)
from dagster_gpuinfer.storage.reading import (
    partition_progress as partition_progress,
)
from dagster_gpuinfer.storage.reading import (
    read_errors as read_errors,
)
from dagster_gpuinfer.storage.reading import (
    read_openai_batch_files as read_openai_batch_files,
)
from dagster_gpuinfer.storage.reading import (
    read_partition as read_partition,
)
from dagster_gpuinfer.storage.versions import (
    SourceVersion as SourceVersion,
)
from dagster_gpuinfer.storage.versions import (
    adapter_versions as adapter_versions,
)
from dagster_gpuinfer.storage.versions import (
    file_version as file_version,
)
from dagster_gpuinfer.storage.versions import (
    folder_version as folder_version,
)
from dagster_gpuinfer.storage.versions import (
    input_version as input_version,
)
from dagster_gpuinfer.storage.versions import (
    model_version as model_version,
)
from dagster_gpuinfer.storage.versions import (
    source_version as source_version,
)
