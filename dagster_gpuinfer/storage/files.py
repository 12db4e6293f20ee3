"""Filesystems and files: local disk or S3 through `pyarrow.fs`, atomic writes, listing.

Every file of the layout is written here: under a temporary name and renamed (local disk) or
in one PUT (S3), so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, field_validator

from dagster_gpuinfer.spec import StorageOptions

# Attempts per S3 request, pyarrow's and boto3's (both "standard" retries: 5xx, throttling,
# connection errors; exponential backoff with jitter). Their default of 3 is spent by a
# minute of a flaky endpoint; a failed request then fails the chunk or the step, and every
# request the worker and the commit make is idempotent (unique names, conditional manifest).
S3_MAX_ATTEMPTS = 8

# AWS environment variable -> pyarrow.fs.S3FileSystem argument.
_PYARROW_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "access_key",
    "AWS_SECRET_ACCESS_KEY": "secret_key",
    "AWS_SESSION_TOKEN": "session_token",
}


def filesystem_for(
    uri: str,
    storage: StorageOptions | None = None,
    *,
    credentials: Mapping[str, str] | None = None,
) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and the path within it for a local path or an `s3://` URI.

    S3 credentials come from the standard AWS chain (environment, profile, instance role,
    web identity); only the endpoint and region travel in the spec. The control plane may
    pass `credentials` it holds (an `S3Resource`'s keys) for its own reads.

    Args:
        uri: A local path, `file://` path or `s3://bucket/key` URI.
        storage: The S3 endpoint, region and whether plain http is allowed.
        credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`;
            None uses the standard chain.

    Raises:
        ValueError: the endpoint is plain `http://` and `storage.allow_http` is not set.
    """
    storage = storage or StorageOptions()
    if uri.startswith("s3://"):
        kwargs: dict[str, Any] = {}
        if storage.endpoint_url:
            endpoint = storage.endpoint_url
            if endpoint.startswith("http://"):
                if not storage.allow_http:
                    raise ValueError(
                        f"S3 endpoint {endpoint} for {uri} is plain http, which sends data and "
                        "signatures unencrypted. Use an https endpoint, or set allow_http "
                        "(GpuInferenceResource(s3_allow_http=True)) for a local test server"
                    )
                kwargs["scheme"] = "http"
                endpoint = endpoint[len("http://") :]
            elif endpoint.startswith("https://"):
                endpoint = endpoint[len("https://") :]
            kwargs["endpoint_override"] = endpoint
        if storage.region:
            kwargs["region"] = storage.region
        for variable, argument in _PYARROW_CREDENTIALS.items():
            if credentials and credentials.get(variable):
                kwargs[argument] = credentials[variable]
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS)
        return pafs.S3FileSystem(**kwargs), uri[len("s3://") :].rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def s3_client(storage: StorageOptions | None = None) -> Any:
    """A boto3 S3 client for what pyarrow cannot do: conditional PUT and `StartAfter` paging.

    The package's one boto3 client factory; credentials come from the standard AWS chain.

    Raises:
        ImportError: boto3 is not installed (it comes with the `aws` and worker extras).
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "this S3 operation needs boto3: install dagster-gpuinfer[aws] (control plane) or "
            "a worker extra"
        ) from exc
    storage = storage or StorageOptions()
    return boto3.client(
        "s3",
        endpoint_url=storage.endpoint_url,
        region_name=storage.region or None,
        config=Config(retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"}),
    )


def display_uri(fs: pafs.FileSystem, path: str) -> str:
    return f"s3://{path}" if isinstance(fs, pafs.S3FileSystem) else path


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Make `path` hold `data`, all or nothing.

    Local disk: write a temporary sibling, fsync, rename over the target. S3: one PUT, which
    is atomic (readers see the old object or the new one, never a mix).
    """
    if isinstance(fs, pafs.LocalFileSystem):
        os.replace(local_temporary_copy(path, data), path)
        return
    with fs.open_output_stream(path) as out:
        out.write(data)


def local_temporary_copy(path: str, data: bytes) -> str:
    """`data` written and fsynced to a temporary sibling of `path`; returns its path."""
    parent = posixpath.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return tmp


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.read()


def delete_quietly(fs: pafs.FileSystem, paths: Iterable[str]) -> None:
    for path in paths:
        try:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.Directory:
                fs.delete_dir(path)
            elif info.type == pafs.FileType.File:
                fs.delete_file(path)
        except (FileNotFoundError, OSError):
            pass


def list_names(fs: pafs.FileSystem, directory: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    return sorted(posixpath.basename(info.path) for info in infos)


class FileEntry(BaseModel):
    """One committed file: its name inside the partition folder, rows and checksum."""

    model_config = ConfigDict(extra="forbid")

    name: str
    rows: int
    bytes: int
    sha256: str

    @field_validator("name")
    @classmethod
    def _plain_file_name(cls, name: str) -> str:
        return plain_file_name(name)


def plain_file_name(name: str) -> str:
    """`name` if it is a plain file name inside a partition folder, else ValueError.

    Manifests name their files; a name with a separator, `..` or a NUL byte would make a
    reader (`read_partition`, `verify_manifest`) open a file outside the partition.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ValueError(
            f"manifest file name {name!r} is not a plain file name inside the partition "
            "folder (no '/', '\\', '..' or NUL); the manifest was not written by "
            "dagster-gpuinfer or was tampered with: re-materialize the partition"
        )
    return name


def table_to_parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_file_entry(
    fs: pafs.FileSystem, directory: str, name: str, data: bytes, rows: int
) -> FileEntry:
    write_bytes_atomic(fs, posixpath.join(directory, name), data)
    return FileEntry(name=name, rows=rows, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def count_rows(fs: pafs.FileSystem, path: str) -> int:
    if path.endswith(".parquet"):
        with fs.open_input_file(path) as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    return sum(1 for line in read_bytes(fs, path).splitlines() if line.strip())
