"""Source versions: the shard's and the model folder's versions a partition was computed
from, so a rewritten shard or new weights are never taken for the committed ones.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, Field

from dagster_gpuinfer.spec import InferenceSpec, StorageOptions, split_partition_key
from dagster_gpuinfer.storage.files import display_uri, filesystem_for, s3_client


class SourceVersion(BaseModel):
    """What a partition's outputs were computed from, beside its spec: the version of its
    input shard and, for a model given as a local folder, of that folder's files.

    The spec hash names the model by its path or hub id (and revision); a shard by its URI
    template. Neither says whether the bytes behind them changed, so a manifest or chunk
    marker counts only for the spec hash *and* the source version it records.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str = Field(description="The input shard's version (`input_version`).")
    model: str | None = Field(
        None, description="The local model folder's version (`model_version`); None: a hub id."
    )
    adapters: str | None = Field(
        None,
        description="The LoRA adapters' versions (`adapter_versions`, as `name=version` "
        "joined by `;`); None: the spec lists no adapters.",
    )


def file_version(fs: pafs.FileSystem, path: str, storage: StorageOptions | None = None) -> str:
    """A version of one file that changes whenever the file is rewritten.

    S3: the object's ETag (a digest of its content, or of its parts' for a multipart upload)
    and its version id where the bucket keeps versions, read with one HEAD (boto3); without
    boto3, its size and last-modified time. Local disk: size, modification time in
    nanoseconds (what `make` and `rsync` compare) and inode (a writer that renames a new
    file into place, as most do, changes it even within one tick of the file system's
    clock): a rewrite with other content changes it; a rewrite with the same bytes or a
    `touch` changes it too, which costs a recompute and never serves stale rows.

    Raises:
        FileNotFoundError: no file at `path`.
    """
    if isinstance(fs, pafs.S3FileSystem):
        storage = storage or StorageOptions()
        try:
            client = _version_client(storage.endpoint_url, storage.region)
        except ImportError:
            client = None
        if client is not None:
            return _s3_object_version(client, path)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"{display_uri(fs, path)} is not a file")
    if isinstance(fs, pafs.LocalFileSystem):
        stat = os.stat(path)
        return f"local:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    return f"{fs.type_name}:{info.size}:{info.mtime_ns}"


@functools.lru_cache(maxsize=8)
def _version_client(endpoint_url: str | None, region: str | None) -> Any:
    """One boto3 client per endpoint for the HEADs: observing 10,000 shards or checking a
    run's partitions builds one client, not one a shard (boto3 clients are thread-safe)."""
    return s3_client(StorageOptions(endpoint_url=endpoint_url, region=region))


def _s3_object_version(client: Any, path: str) -> str:
    from botocore.exceptions import ClientError

    bucket, _, key = path.partition("/")
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"s3://{path} does not exist") from None
        raise
    version = head.get("VersionId")
    etag = str(head.get("ETag", "")).strip('"')
    return f"s3:{etag}:{head.get('ContentLength')}" + (f":{version}" if version else "")


def input_version(spec: InferenceSpec, partition_key: str) -> str:
    """The version of the file `partition_key` reads (`file_version`); a range partition
    (`big@rows=0-1000`) takes its whole file's, so any change to the file recomputes it.
    A Delta table's partition: the digest of its data files (`DeltaPartition.version`), so
    a table version that rewrites the partition changes it and one that does not, does not.

    Raises:
        FileNotFoundError: the shard (or the table's partition) is not there.
    """
    if spec.input.is_table():
        from dagster_gpuinfer.storage.delta import table_partition

        value, _ = split_partition_key(partition_key)
        column = spec.input.partition_column or ""
        return table_partition(spec.input.uri, spec.storage, column, value).version()
    fs, path = filesystem_for(spec.input.shard_uri(partition_key), spec.storage)
    return file_version(fs, path, spec.storage)


def model_version(spec: InferenceSpec) -> str | None:
    """The version of a model given as a local folder: a digest of every file's relative
    path, size and modification time (links followed; hidden entries such as a download
    tool's `.cache/` left out). None for a hub id, which the spec hash names with its
    revision. Stat calls only: a 140 GB folder costs what listing it costs.

    Raises:
        FileNotFoundError: the folder is not there (or not readable from this process).
    """
    if not spec.model_is_local_path():
        return None
    return folder_version(spec.model, what="model folder")


def folder_version(folder: str, *, what: str) -> str:
    """A digest of a local folder's files: relative paths, sizes and modification times
    (links followed, hidden entries left out); stat calls only.

    Raises:
        FileNotFoundError: the folder is not there (or not readable from this process).
    """
    root = os.path.expanduser(folder.removeprefix("file://"))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{what} {folder!r} is not there")
    digest = hashlib.sha256()
    files = 0
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(folder, name)
            stat = os.stat(path)
            relative = os.path.relpath(path, root)
            digest.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            files += 1
    return f"files:{files}:{digest.hexdigest()[:16]}"


def s3_prefix_version(uri: str, storage: StorageOptions | None = None) -> str:
    """A digest of the objects under an `s3://` prefix: each one's key below the prefix
    and its version (`file_version`: ETag, size, version id).

    Raises:
        FileNotFoundError: no object under the prefix.
    """
    fs, prefix = filesystem_for(uri, storage or StorageOptions())
    prefix = prefix.rstrip("/")
    found = fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    files = sorted(info.path for info in found if info.type == pafs.FileType.File)
    if not files:
        raise FileNotFoundError(f"no object under {uri}")
    digest = hashlib.sha256()
    for path in files:
        relative = path[len(prefix) :].lstrip("/")
        digest.update(f"{relative}\0{file_version(fs, path, storage)}\n".encode())
    return f"s3:{len(files)}:{digest.hexdigest()[:16]}"


def adapter_version(spec: InferenceSpec, name: str) -> str:
    """The version of one listed LoRA adapter: its local folder's digest (`folder_version`)
    or its S3 prefix's (`s3_prefix_version`).

    Raises:
        FileNotFoundError: the adapter is not there.
    """
    path = spec.lora_adapters[name]
    if path.startswith("s3://"):
        return s3_prefix_version(path, spec.storage)
    return folder_version(path, what=f"LoRA adapter {name!r} folder")


def adapter_versions(spec: InferenceSpec) -> str | None:
    """Every listed adapter's version as `name=version` joined by `;` (names sorted);
    None when the spec lists none. What `SourceVersion.adapters` records.

    Raises:
        FileNotFoundError: an adapter is not there.
    """
    if not spec.lora_adapters:
        return None
    return ";".join(f"{name}={adapter_version(spec, name)}" for name in sorted(spec.lora_adapters))


def source_version(
    spec: InferenceSpec,
    partition_key: str,
    *,
    model: str | None,
    adapters: str | None | bool = True,
) -> SourceVersion:
    """The source version of a partition now, with the model folder's `model_version(spec)`
    computed once by the caller for all its partitions.

    Args:
        adapters: The adapters' versions as recorded (`adapter_versions`); True (the
            default): read them now.

    Raises:
        FileNotFoundError: the shard (or a listed adapter) is not there.
    """
    if adapters is True:
        adapters = adapter_versions(spec)
    return SourceVersion(
        input=input_version(spec, partition_key),
        model=model,
        adapters=adapters or None,
    )
