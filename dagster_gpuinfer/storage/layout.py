"""The partition layout: names, the chunk markers and the `_SUCCESS` manifest.

Where a partition's files live (`partition_dir`), what a chunk marker and a manifest hold
(`ChunkMarker`, `Manifest`), and which manifests count for a spec (`committed_manifest`).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, Field

from dagster_gpuinfer.spec import InferenceSpec, OutputSpec
from dagster_gpuinfer.storage.files import (
    FileEntry,
    filesystem_for,
    list_names,
    read_bytes,
    write_bytes_atomic,
)
from dagster_gpuinfer.storage.versions import (
    SourceVersion,
    adapter_versions,
    model_version,
    source_version,
)

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


class RowCounts(BaseModel):
    """The row and token counts of a chunk or a partition; a partition's are the sum of its
    chunks' (`RowCounts.total`), the one place they are added up."""

    model_config = ConfigDict(extra="forbid")

    rows_in: int = 0
    rows_out: int = 0
    rows_errored: int = 0
    # Rows whose output fails its structured-output constraint (kept in the output, flagged).
    rows_invalid_output: int = 0
    # Row reuse (worker/loop/reuse.py): output rows copied from the partition's earlier
    # output, and rows copied from an identical request this run computed (dedup). Token
    # counts are of the rows the engine computed.
    rows_reused: int = 0
    rows_deduplicated: int = 0
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
    share of its engine's time in `step()` (`worker/loop/engine_time.py`; a score/classify
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
    # openai_batch output: the part's rows again as Parquet, with their reuse keys and input
    # digests (`reuse_part_name`), which row reuse reads; the JSONL part stays OpenAI's.
    reuse_part: FileEntry | None = None
    # The pool job whose chunk-range lease wrote it (`pools/ranges.py`): the partition's
    # committer counts a job's own chunks as computed, whichever worker wrote them. None:
    # written by a run or a whole-partition lease.
    job: str | None = None


def chunk_dir(partition_path: str, spec_hash: str) -> str:
    return posixpath.join(partition_path, CHUNKS_DIR, spec_hash)


def chunk_part_name(spec_hash: str, index: int, attempt: str, suffix: str) -> str:
    """A chunk's part file name, unique to the attempt that wrote it: two workers racing on a
    partition never overwrite each other's files; the chunk marker says which one counts."""
    return f"part-{spec_hash}-{index:05d}-{attempt}{suffix}"


def reuse_part_name(spec_hash: str, index: int, attempt: str) -> str:
    """The name of the Parquet file beside an `openai_batch` chunk's JSONL part: the same
    rows with their `reuse_key` and `input_digest` columns (`ChunkMarker.reuse_part`)."""
    return f"reuse-{spec_hash}-{index:05d}-{attempt}.parquet"


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
    # openai_batch output: each part's rows as Parquet, with reuse keys (`reuse_part_name`).
    reuse_parts: list[FileEntry] = Field(default_factory=list)
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

    def keyed_parts(self) -> list[FileEntry]:
        """The Parquet files holding the output rows with their reuse keys and input digests:
        the parts (Parquet output), or the reuse files beside an `openai_batch` output's JSONL
        parts (none when committed before they were written: nothing is reused from it)."""
        return self.parts if self.output_format != "openai_batch" else self.reuse_parts

    @property
    def balanced(self) -> bool:
        return self.rows_in == self.rows_out + self.rows_errored

    def computed_from(self, spec_hash: str, source: SourceVersion | None) -> bool:
        """Whether this manifest holds the outputs of `spec_hash` over `source`."""
        return self.spec_hash == spec_hash and source is not None and self.source == source


def manifest_path(partition_path: str) -> str:
    return posixpath.join(partition_path, MANIFEST_NAME)


def named_files(manifest: Manifest) -> set[str]:
    """The file names a committed partition's manifest counts: its parts (and an
    `openai_batch` output's reuse files), its error files and the manifest itself. Nothing
    else in the partition's folder is kept."""
    parts = [*manifest.parts, *manifest.reuse_parts]
    names = {MANIFEST_NAME, manifest.errors.name, *(part.name for part in parts)}
    if manifest.openai_errors is not None:
        names.add(manifest.openai_errors.name)
    return names


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
    spec: InferenceSpec,
    partition_key: str,
    *,
    model: str | None,
    adapters: str | None | bool = True,
) -> Manifest | None:
    """The manifest of `partition_key` if it was committed for this exact spec from the
    shard and model files as they are now, else None (recompute it).

    Args:
        model: `model_version(spec)`, computed once by the caller for all its partitions;
            `MODEL_AS_RECORDED` where the folder cannot be read (the control plane of pods
            whose model cache it does not mount): the manifest's own record counts.
        adapters: `adapter_versions(spec)`, computed once by the caller; True (the
            default): read them now. With `MODEL_AS_RECORDED`, the manifest's record.
    """
    fs, path = filesystem_for(partition_dir(spec.output, partition_key), spec.storage)
    manifest = read_manifest(fs, path)
    if manifest is None or manifest.spec_hash != spec.spec_hash() or manifest.source is None:
        return None
    if model == MODEL_AS_RECORDED:  # the pods' model cache: adapters live there too
        model, adapters = manifest.source.model, manifest.source.adapters
    try:
        source = source_version(spec, partition_key, model=model, adapters=adapters)
    except FileNotFoundError:
        return None  # the shard is gone: nothing proves the outputs are its
    return manifest if manifest.computed_from(manifest.spec_hash, source) else None


def committed_manifests(spec: InferenceSpec, partition_keys: Iterable[str]) -> dict[str, Manifest]:
    """`committed_manifest` of each key that has one, the versions of the model folder and
    the LoRA adapters read once.

    A model folder this process cannot see (a pod's model cache, mounted only in the pods)
    is taken as each manifest recorded it: the shard and the spec are still checked, and
    every worker checks the folder itself for the partitions it runs. New weights written
    under the same path there go unnoticed for partitions skipped here, so give each model
    revision its own folder in the cache (as the Hugging Face cache's snapshots do).
    """
    adapters: str | None | bool = True  # as recorded, with the model
    try:
        model = model_version(spec)
    except FileNotFoundError:
        model = MODEL_AS_RECORDED
    else:
        try:  # once, not per partition: an S3 adapter is a listing and a HEAD a file
            adapters = adapter_versions(spec)
        except FileNotFoundError:
            return {}  # an adapter is gone: nothing proves any output is its
    found = {}
    for key in partition_keys:
        manifest = committed_manifest(spec, key, model=model, adapters=adapters)
        if manifest is not None:
            found[key] = manifest
    return found
