"""Delta Lake tables on local disk or S3, as both sides read them: the sink writes one
(control plane), a table-scan source reads one partition of it (worker).

`deltalake` (delta-rs, the `delta` extra) is imported only when a table is opened, so the
worker and the control plane load it only for pipelines that use a Delta table.

A partition of a source table is the set of data files whose partition column holds the
key at the table's current version. Delta data files are never rewritten in place (a
write, delete or compaction adds new file names and removes old ones from the log), so the
sorted list of a partition's file paths and sizes is its version: a table version that
changes the partition changes it; one that only touches other partitions does not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from dagster_gpuinfer.spec import StorageOptions

# Reader features a table may use that plain Parquet reads of its files would get wrong:
# deleted rows kept in the files, renamed columns, rows of several files merged.
UNREADABLE_FEATURES = frozenset({"deletionVectors", "columnMapping", "v2Checkpoint"})


class DeltaUnavailable(Exception):
    """deltalake is not installed, or the table cannot be opened."""


def storage_options(uri: str, storage: StorageOptions | None) -> dict[str, str] | None:
    """delta-rs storage options for `uri`: the S3 endpoint, region and plain-http switch
    of `storage` (credentials come from the environment, the standard AWS variables, as for
    pyarrow's S3); None for a local path."""
    if not uri.startswith("s3://"):
        return None
    storage = storage or StorageOptions()
    options: dict[str, str] = {}
    if storage.endpoint_url:
        if storage.endpoint_url.startswith("http://") and not storage.allow_http:
            raise ValueError(
                f"storage endpoint {storage.endpoint_url} is plain http; set "
                "storage.allow_http=True only for local test servers"
            )
        options["AWS_ENDPOINT_URL"] = storage.endpoint_url
    if storage.region:
        options["AWS_REGION"] = storage.region
    if storage.allow_http:
        options["AWS_ALLOW_HTTP"] = "true"
    return options


def open_table(uri: str, storage: StorageOptions | None, *, version: int | None = None) -> Any:
    """The `deltalake.DeltaTable` at `uri` (latest version, or `version`).

    Raises:
        FileNotFoundError: no Delta table at `uri`.
        DeltaUnavailable: deltalake is not installed.
    """
    try:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError
    except ImportError:
        raise DeltaUnavailable(
            "Delta tables need the deltalake package: install dagster-gpuinfer[delta]"
        ) from None
    try:
        return DeltaTable(uri, version=version, storage_options=storage_options(uri, storage))
    except TableNotFoundError:
        raise FileNotFoundError(f"no Delta table at {uri}") from None


@dataclass(frozen=True)
class DeltaPartition:
    """One partition of a Delta table at one table version: its data files in a fixed
    order (by path) and that version."""

    table_version: int
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    rows: int  # as the log's statistics count them (estimates; the reader counts footers)

    def version(self) -> str:
        """The partition's source version: a digest of its data files' paths and sizes
        (the table version is not part of it, see the module's docstring)."""
        digest = hashlib.sha256()
        for path, size in zip(self.files, self.sizes, strict=True):
            digest.update(f"{path}\0{size}\n".encode())
        return f"delta:files={len(self.files)}:{digest.hexdigest()[:20]}"


def data_file_uri(uri: str, path: str) -> str:
    """Where a data file of the table at `uri` is: the log's `path` is URL-encoded and
    relative to the root (absolute only in a shallow clone)."""
    if "://" in path:
        return path
    return f"{uri.rstrip('/')}/{unquote(path)}"


def unreadable_features(table: Any) -> list[str]:
    """The table's reader features that reading its Parquet files directly cannot honour."""
    features = table.protocol().reader_features or []
    return sorted(set(features) & UNREADABLE_FEATURES)


def table_partition(
    uri: str, storage: StorageOptions | None, column: str, value: str
) -> DeltaPartition:
    """The data files of the table's partition `column = value` at its latest version.

    Raises:
        FileNotFoundError: no table at `uri`, or no file holds the partition.
        ValueError: `column` is not one of the table's partition columns, or the table uses
            a reader feature its files cannot be read without.
    """
    table = open_table(uri, storage)
    columns = list(table.metadata().partition_columns)
    if column not in columns:
        raise ValueError(
            f"Delta table {uri} is partitioned by {columns or 'nothing'}, not {column!r}; set "
            "input.partition_column to one of its partition columns"
        )
    features = unreadable_features(table)
    if features:
        raise ValueError(
            f"Delta table {uri} uses {', '.join(features)}; its rows cannot be read from its "
            "Parquet files alone (rewrite it without them, e.g. OPTIMIZE/REORG PURGE)"
        )
    actions = pa.table(table.get_add_actions(flatten=True))
    values = actions.column(f"partition.{column}").to_pylist()
    paths = actions.column("path").to_pylist()
    sizes = actions.column("size_bytes").to_pylist()
    records = actions.column("num_records").to_pylist()
    found = sorted(
        (path, size, rows or 0)
        for path, size, rows, held in zip(paths, sizes, records, values, strict=True)
        if held is not None and str(held) == value
    )
    if not found:
        raise FileNotFoundError(
            f"Delta table {uri} (version {table.version()}) has no partition {column}={value!r}"
        )
    return DeltaPartition(
        table_version=table.version(),
        files=tuple(data_file_uri(uri, path) for path, _, _ in found),
        sizes=tuple(int(size) for _, size, _ in found),
        rows=sum(int(rows) for _, _, rows in found),
    )


def partition_values(uri: str, storage: StorageOptions | None, column: str) -> list[str]:
    """The values of the table's partition column at its latest version, sorted: the keys
    of a pipeline that scans it (`dg.StaticPartitionsDefinition(partition_values(...))`, or
    added to dynamic partitions by a schedule).

    Raises:
        FileNotFoundError: no table at `uri`.
    """
    table = open_table(uri, storage)
    actions = pa.table(table.get_add_actions(flatten=True))
    values = actions.column(f"partition.{column}").to_pylist()
    return sorted({str(value) for value in values if value is not None})
