"""Output layout, atomic writes and the partition manifest, on local disk or S3.

Shared by the worker (which writes) and the control plane (which reads manifests to skip
finished partitions and to check row counts). Imports pyarrow and pydantic only.

Layout of one output partition::

    <root>/<asset>/<partition dir>/
        part-<spec hash>-<chunk>-<attempt>.parquet   one file per committed chunk
        errors-<spec hash>-<attempt>.parquet         quarantined rows, with a reason
        errors-<spec hash>-<attempt>.jsonl           the same as OpenAI error lines
                                                     (openai_batch output only)
        _SUCCESS                                     the manifest, written last
        _chunks/<spec hash>/<chunk>.json             chunk markers (deleted at commit)
        _chunks/<spec hash>/errors-<chunk>-<attempt>.parquet

A partition is done only when `_SUCCESS` exists and names the current spec hash. The
manifest names its error files (`partition_error_files` finds them): they carry the
committing attempt in their name, so a worker that loses a commit race never overwrites a
file the winner's manifest names. (Partitions committed before that used the fixed names
`errors.parquet` / `errors.jsonl`; their manifests name those.) Every file
is written under a temporary name and renamed (local disk) or written in one PUT (S3), so a
reader never sees half a file, and the manifest is the one source of which files count.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dagster_gpuinfer.spec import InferenceSpec, OutputSpec, StorageOptions

MANIFEST_NAME = "_SUCCESS"
# The error files' names before they carried the attempt (still read through old manifests);
# ERRORS_NAME is also the placeholder name of a manifest's errors entry before its commit.
ERRORS_NAME = "errors.parquet"
# With output_format="openai_batch": the quarantined rows again, as OpenAI error lines.
OPENAI_ERRORS_NAME = "errors.jsonl"


def error_file_names(spec_hash: str, attempt: str) -> tuple[str, str]:
    """The names of a commit's error files: (Parquet, OpenAI JSONL), unique to the attempt."""
    return f"errors-{spec_hash}-{attempt}.parquet", f"errors-{spec_hash}-{attempt}.jsonl"


CHUNKS_DIR = "_chunks"
MANIFEST_VERSION = 1
T = TypeVar("T")

ERRORS_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=True),
        pa.field("source", pa.string()),
        pa.field("row", pa.int64()),
        pa.field("error_type", pa.string()),
        pa.field("message", pa.string()),
        pa.field("prompt_tokens", pa.int64(), nullable=True),
    ]
)


# --------------------------------------------------------------------------- filesystems

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
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "this S3 operation needs boto3: install dagster-gpuinfer[aws] (control plane) or "
            "a worker extra"
        ) from exc
    storage = storage or StorageOptions()
    return boto3.client("s3", endpoint_url=storage.endpoint_url, region_name=storage.region or None)


def display_uri(fs: pafs.FileSystem, path: str) -> str:
    return f"s3://{path}" if isinstance(fs, pafs.S3FileSystem) else path


def partition_dir_name(partition_key: str) -> str:
    """A partition key as one safe path segment.

    Every character outside `[A-Za-z0-9_.-]` is percent-encoded, so `/` can never add a
    level, and a leading dot is encoded, so `.`, `..` and hidden names cannot occur: no key
    escapes the output root or collides with the `_chunks`/`_SUCCESS` bookkeeping names.
    """
    if not partition_key:
        raise ValueError("a partition key must not be empty")
    name = quote(partition_key, safe="")
    if name.startswith((".", "_")):
        name = "%" + format(ord(name[0]), "02X") + name[1:]
    return name


def partition_dir(output: OutputSpec, partition_key: str) -> str:
    """The output folder of one partition, as a URI (local path or `s3://...`)."""
    root = output.root.rstrip("/")
    return f"{root}/{partition_dir_name(output.asset_name)}/{partition_dir_name(partition_key)}"


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Make `path` hold `data`, all or nothing.

    Local disk: write a temporary sibling, fsync, rename over the target. S3: one PUT, which
    is atomic (readers see the old object or the new one, never a mix).
    """
    if isinstance(fs, pafs.LocalFileSystem):
        os.replace(_local_temporary_copy(path, data), path)
        return
    with fs.open_output_stream(path) as out:
        out.write(data)


def _local_temporary_copy(path: str, data: bytes) -> str:
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


# --------------------------------------------------------------------------- files


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


# --------------------------------------------------------------------------- versions


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
        try:
            client = s3_client(storage)
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

    Raises:
        FileNotFoundError: the shard is not there.
    """
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
    root = os.path.expanduser(spec.model.removeprefix("file://"))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"model folder {spec.model!r} is not there")
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


def source_version(spec: InferenceSpec, partition_key: str, *, model: str | None) -> SourceVersion:
    """The source version of a partition now, with the model folder's `model_version(spec)`
    computed once by the caller for all its partitions.

    Raises:
        FileNotFoundError: the shard is not there.
    """
    return SourceVersion(input=input_version(spec, partition_key), model=model)


# --------------------------------------------------------------------------- chunks


class RowCounts(BaseModel):
    """The row and token counts of a chunk or a partition; a partition's are the sum of its
    chunks' (`RowCounts.total`), the one place they are added up."""

    model_config = ConfigDict(extra="forbid")

    rows_in: int = 0
    rows_out: int = 0
    rows_errored: int = 0
    # Rows whose output fails its structured-output constraint (kept in the output, flagged).
    rows_invalid_output: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # Image tasks: images the rows carried and their encoded bytes (quarantined rows' too).
    images: int = 0
    image_bytes: int = 0

    @classmethod
    def total(cls, counts: Iterable[RowCounts]) -> RowCounts:
        """The field-by-field sum of `counts` (zero for none)."""
        sums = dict.fromkeys(RowCounts.model_fields, 0)
        for each in counts:
            for name in sums:
                sums[name] += getattr(each, name)
        return RowCounts(**sums)

    def counts(self) -> RowCounts:
        """Just the counts of this chunk or partition."""
        return RowCounts(**{name: getattr(self, name) for name in RowCounts.model_fields})

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


class ChunkMarker(RowCounts):
    """Proof that one chunk of a shard is committed: written after its files.

    `started_at` / `finished_at` (Unix time, as any process of the host reads it) bound the
    chunk's inference: its first row submitted, its last row done. `engine_seconds` is its
    share of its engine's time in `step()` (`worker/engine_time.py`; a score/classify
    chunk: its call). `write_seconds` is the
    time its files took to write, measured where they were written (a replica process).
    """

    index: int
    spec_hash: str
    # What the chunk was computed from; None: written before versions were recorded.
    source: SourceVersion | None = None
    inference_seconds: float = 0.0
    engine_seconds: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    write_seconds: float = 0.0
    part: FileEntry | None = None
    errors: FileEntry | None = None


def chunk_dir(partition_path: str, spec_hash: str) -> str:
    return posixpath.join(partition_path, CHUNKS_DIR, spec_hash)


def chunk_part_name(spec_hash: str, index: int, attempt: str, suffix: str) -> str:
    """A chunk's part file name, unique to the attempt that wrote it: two workers racing on a
    partition never overwrite each other's files; the chunk marker says which one counts."""
    return f"part-{spec_hash}-{index:05d}-{attempt}{suffix}"


def write_chunk_marker(fs: pafs.FileSystem, partition_path: str, marker: ChunkMarker) -> None:
    path = posixpath.join(chunk_dir(partition_path, marker.spec_hash), f"{marker.index:05d}.json")
    write_bytes_atomic(fs, path, marker.model_dump_json().encode())


def read_chunk_markers(
    fs: pafs.FileSystem,
    partition_path: str,
    spec_hash: str,
    source: SourceVersion | None = None,
) -> dict[int, ChunkMarker]:
    """The committed chunks of this spec, by index. Markers of other specs are ignored, and
    with `source` given, so are markers computed from another version of the input or the
    model (a shard rewritten since: its old chunks must not be resumed)."""
    directory = chunk_dir(partition_path, spec_hash)
    markers: dict[int, ChunkMarker] = {}
    for name in list_names(fs, directory):
        if name.endswith(".json") and not name.startswith(".tmp-"):
            marker = ChunkMarker.model_validate_json(
                read_bytes(fs, posixpath.join(directory, name))
            )
            if marker.spec_hash == spec_hash and (source is None or marker.source == source):
                markers[marker.index] = marker
    return markers


# --------------------------------------------------------------------------- manifest


class Manifest(RowCounts):
    """The `_SUCCESS` manifest: a partition is committed exactly when this exists.

    Its row counts (`RowCounts`) are the sum of all its chunks', resumed ones included;
    `computed` counts only the chunks this attempt computed, in `engine_seconds`: their share
    of the engine's time (`ChunkMarker.engine_seconds`). `active_seconds` is the partition's
    active span in this attempt (first row submitted to last row done), and
    `inference_seconds` the union of its chunks' inference intervals (chunks overlap under
    streaming, so never their sum), within `wall_seconds`.
    """

    version: int = MANIFEST_VERSION
    partition_key: str
    spec_hash: str
    # The input shard's and local model folder's versions the partition was computed from;
    # None: committed before versions were recorded, so never reused.
    source: SourceVersion | None = None
    model: str
    task: str
    output_format: str
    rows_resumed: int = 0
    parts: list[FileEntry]
    errors: FileEntry
    # errors.jsonl: the quarantined rows as OpenAI Batch error lines (openai_batch output).
    openai_errors: FileEntry | None = None
    error_types: dict[str, int] = Field(default_factory=dict)
    inference_seconds: float = 0.0
    wall_seconds: float = 0.0
    active_seconds: float = 0.0
    engine_seconds: float = 0.0
    computed: RowCounts = Field(default_factory=RowCounts)
    model_load_seconds: float = 0.0
    committed_at: float = Field(default_factory=time.time)
    worker: dict[str, Any] = Field(default_factory=dict)
    # GPU utilization, engine saturation, KV-cache usage while it ran (worker/telemetry.py).
    telemetry: dict[str, Any] = Field(default_factory=dict)

    @property
    def balanced(self) -> bool:
        return self.rows_in == self.rows_out + self.rows_errored

    def computed_from(self, spec_hash: str, source: SourceVersion | None) -> bool:
        """Whether this manifest holds the outputs of `spec_hash` over `source`."""
        return self.spec_hash == spec_hash and source is not None and self.source == source


def manifest_path(partition_path: str) -> str:
    return posixpath.join(partition_path, MANIFEST_NAME)


def read_manifest(fs: pafs.FileSystem, partition_path: str) -> Manifest | None:
    path = manifest_path(partition_path)
    try:
        data = read_bytes(fs, path)
    except FileNotFoundError:
        return None
    return Manifest.model_validate_json(data)


# `committed_manifest(..., model=MODEL_AS_RECORDED)`: the model folder cannot be read here.
MODEL_AS_RECORDED = "as recorded"


def committed_manifest(
    spec: InferenceSpec, partition_key: str, *, model: str | None
) -> Manifest | None:
    """The manifest of `partition_key` if it was committed for this exact spec from the
    shard and model files as they are now, else None (recompute it).

    Args:
        model: `model_version(spec)`, computed once by the caller for all its partitions;
            `MODEL_AS_RECORDED` where the folder cannot be read (the control plane of pods
            whose model cache it does not mount): the manifest's own record counts.
    """
    fs, path = filesystem_for(partition_dir(spec.output, partition_key), spec.storage)
    manifest = read_manifest(fs, path)
    if manifest is None or manifest.spec_hash != spec.spec_hash() or manifest.source is None:
        return None
    if model == MODEL_AS_RECORDED:
        model = manifest.source.model
    try:
        source = source_version(spec, partition_key, model=model)
    except FileNotFoundError:
        return None  # the shard is gone: nothing proves the outputs are its
    return manifest if manifest.computed_from(manifest.spec_hash, source) else None


def committed_manifests(spec: InferenceSpec, partition_keys: Iterable[str]) -> dict[str, Manifest]:
    """`committed_manifest` of each key that has one, the model folder's version read once.

    A model folder this process cannot see (a pod's model cache, mounted only in the pods)
    is taken as each manifest recorded it: the shard and the spec are still checked, and
    every worker checks the folder itself for the partitions it runs. New weights written
    under the same path there go unnoticed for partitions skipped here, so give each model
    revision its own folder in the cache (as the Hugging Face cache's snapshots do).
    """
    try:
        model = model_version(spec)
    except FileNotFoundError:
        model = MODEL_AS_RECORDED
    found = {}
    for key in partition_keys:
        manifest = committed_manifest(spec, key, model=model)
        if manifest is not None:
            found[key] = manifest
    return found


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
        tmp = _local_temporary_copy(path, data)
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
        if existing is not None and existing.computed_from(manifest.spec_hash, manifest.source):
            raise CommitConflict(existing)
        # The manifest of an older spec or source: its outputs no longer count; replace it.
        delete_quietly(fs, [target])
    else:
        existing = read_manifest(fs, partition_path)
        if existing is not None and existing.computed_from(manifest.spec_hash, manifest.source):
            raise CommitConflict(existing)
        raise OSError(f"could not create {display_uri(fs, target)}: it keeps reappearing")
    keep = {MANIFEST_NAME, manifest.errors.name, *(part.name for part in manifest.parts)}
    if manifest.openai_errors is not None:
        keep.add(manifest.openai_errors.name)
    stale = [
        posixpath.join(partition_path, name)
        for name in list_names(fs, partition_path)
        if name not in keep
    ]
    delete_quietly(fs, stale)
    return manifest


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


def count_rows(fs: pafs.FileSystem, path: str) -> int:
    if path.endswith(".parquet"):
        with fs.open_input_file(path) as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    return sum(1 for line in read_bytes(fs, path).splitlines() if line.strip())


# --------------------------------------------------------------------------- reading results


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


# --------------------------------------------------------------------------- OpenAI batch files


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
    from dagster_gpuinfer.worker.openai_batch import openai_error_lines

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
