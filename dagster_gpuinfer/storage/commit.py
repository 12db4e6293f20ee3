"""The partition commit: error files, then the exclusive `_SUCCESS` manifest, then cleanup;
and the check that a committed partition holds what its manifest says (`verify_manifest`).
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage.files import (
    count_rows,
    delete_quietly,
    display_uri,
    exists,
    list_names,
    local_temporary_copy,
    s3_client,
    table_to_parquet_bytes,
    write_bytes_atomic,
    write_file_entry,
)
from dagster_gpuinfer.storage.layout import (
    ERRORS_SCHEMA,
    Manifest,
    error_file_names,
    manifest_path,
    named_files,
    read_manifest,
)


class CommitConflict(Exception):
    """Another worker committed this partition for the same spec first."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(f"partition {manifest.partition_key!r} was committed by another worker")
        self.manifest = manifest


def create_exclusive(
    fs: pafs.FileSystem, path: str, data: bytes, storage: StorageOptions | None = None
) -> bool:
    """Create `path` holding `data` only if no file is there; False if one is.

    Local disk: a fully written temporary file is hard-linked to `path` (atomic, fails if it
    exists). S3: a conditional PUT (`If-None-Match: *`) through boto3. Without boto3 an S3
    PUT is unconditional: two workers racing on one partition then both commit, and the last
    manifest wins.
    """
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = local_temporary_copy(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    try:
        from botocore.exceptions import ClientError

        client = s3_client(storage)
    except ImportError:
        write_bytes_atomic(fs, path, data)
        return True
    bucket, key = path.split("/", 1)
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in (
            "PreconditionFailed",
            "ConditionalRequestConflict",
        ):
            return False
        raise


def commit_partition(
    fs: pafs.FileSystem,
    partition_path: str,
    manifest: Manifest,
    error_tables: list[pa.Table],
    storage: StorageOptions | None = None,
    openai_errors: bytes | None = None,
    attempt: str | None = None,
) -> Manifest:
    """Write the error files (`errors-<spec hash>-<attempt>.parquet`, and the `.jsonl` of
    OpenAI Batch error lines when `openai_errors` is given), then the manifest naming them
    (the commit point), then clear leftovers. `attempt` names this commit's files (default:
    a fresh one); a losing racer's files never replace the winner's.

    The manifest is created exclusively: of two workers racing on one partition exactly one
    commits, and the other gets `CommitConflict` with the winner's manifest. A manifest of an
    older spec, or of an older version of the input or model files, is replaced. Files that
    the new manifest does not name (chunks of an older spec or of the losing worker,
    temporary files of a killed attempt, chunk markers) are deleted only by the winner and
    only after its manifest is in place, so a crash at any point leaves either the old
    committed state or the new one.

    Raises:
        CommitConflict: another worker committed the partition for the same spec and source
            version first.
    """
    errors = pa.concat_tables(error_tables) if error_tables else ERRORS_SCHEMA.empty_table()
    parquet_name, jsonl_name = error_file_names(manifest.spec_hash, attempt or uuid.uuid4().hex[:8])
    errors_entry = write_file_entry(
        fs, partition_path, parquet_name, table_to_parquet_bytes(errors), errors.num_rows
    )
    update: dict[str, Any] = {"errors": errors_entry}
    if openai_errors is not None:
        update["openai_errors"] = write_file_entry(
            fs, partition_path, jsonl_name, openai_errors, errors.num_rows
        )
    manifest = manifest.model_copy(update=update)
    data = manifest.model_dump_json(indent=2).encode()
    target = manifest_path(partition_path)
    for _ in range(2):
        if create_exclusive(fs, target, data, storage):
            break
        existing = read_manifest(fs, partition_path)
        if existing is not None and existing.errors.name == manifest.errors.name:
            # This commit's own manifest (its errors file name is unique to the commit): an
            # S3 PUT that applied but answered 5xx or a reset, retried by the client, whose
            # `If-None-Match` then failed on this very object. The commit happened.
            break
        if existing is not None and existing.computed_from(manifest.spec_hash, manifest.source):
            raise CommitConflict(existing)
        # The manifest of an older spec or source: its outputs no longer count; replace it.
        delete_quietly(fs, [target])
    else:
        existing = read_manifest(fs, partition_path)
        if existing is not None and existing.computed_from(manifest.spec_hash, manifest.source):
            raise CommitConflict(existing)
        raise OSError(f"could not create {display_uri(fs, target)}: it keeps reappearing")
    clear_unnamed(fs, partition_path, manifest)
    return manifest


def clear_unnamed(fs: pafs.FileSystem, partition_path: str, manifest: Manifest) -> None:
    """The committer's last step, once its manifest is in place: delete every file in the
    partition's folder that `manifest` does not name (chunks of an older spec or of a losing
    attempt, temporary files of a killed one, chunk markers)."""
    keep = named_files(manifest)
    stale = [
        posixpath.join(partition_path, name)
        for name in list_names(fs, partition_path)
        if name not in keep
    ]
    delete_quietly(fs, stale)


def verify_manifest(fs: pafs.FileSystem, partition_path: str, manifest: Manifest) -> list[str]:
    """Check a committed partition against its files: every named file exists with the rows
    the manifest claims (read from the Parquet footer or by counting JSONL lines), and
    `rows_in == rows_out + rows_errored`. Returns the problems found; empty when sound."""
    problems: list[str] = []
    counted_out = 0
    for part in manifest.parts:
        path = posixpath.join(partition_path, part.name)
        if not exists(fs, path):
            problems.append(f"part file {part.name} named by the manifest is missing")
            continue
        rows = count_rows(fs, path)
        counted_out += rows
        if rows != part.rows:
            problems.append(f"{part.name} holds {rows} rows, the manifest says {part.rows}")
    for part in manifest.reuse_parts:
        path = posixpath.join(partition_path, part.name)
        if not exists(fs, path):
            problems.append(f"reuse file {part.name} named by the manifest is missing")
        elif count_rows(fs, path) != part.rows:
            problems.append(f"{part.name} holds {count_rows(fs, path)} rows, manifest {part.rows}")
    errors_path = posixpath.join(partition_path, manifest.errors.name)
    counted_errors = count_rows(fs, errors_path) if exists(fs, errors_path) else -1
    if counted_errors < 0:
        problems.append(f"{manifest.errors.name} named by the manifest is missing")
    if counted_out != manifest.rows_out:
        problems.append(
            f"output files hold {counted_out} rows, manifest rows_out={manifest.rows_out}"
        )
    if counted_errors >= 0 and counted_errors != manifest.rows_errored:
        problems.append(
            f"{manifest.errors.name} holds {counted_errors} rows, manifest rows_errored="
            f"{manifest.rows_errored}"
        )
    if manifest.openai_errors is not None:
        jsonl_path = posixpath.join(partition_path, manifest.openai_errors.name)
        if not exists(fs, jsonl_path):
            problems.append(f"{manifest.openai_errors.name} named by the manifest is missing")
        elif count_rows(fs, jsonl_path) != manifest.rows_errored:
            problems.append(
                f"{manifest.openai_errors.name} holds {count_rows(fs, jsonl_path)} lines, "
                f"manifest rows_errored={manifest.rows_errored}"
            )
    if not manifest.balanced:
        problems.append(
            f"rows_in={manifest.rows_in} != rows_out={manifest.rows_out} + "
            f"rows_errored={manifest.rows_errored}"
        )
    return problems
