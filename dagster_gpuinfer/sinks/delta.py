"""The Delta Lake sink: each committed partition overwritten, whole and in one table
commit, in a Delta table on local disk or S3 (delta-rs, no Spark, no catalog).

Layout of the table (created by the first write, partitioned by `partition_key`)::

    partition_key string, id string, embedding list<float> | text string,
    spec_hash string, input_version string, committed_at double
    [, tenant string]    batch API routes: the tenant whose batch the row is of

The write of one partition is `write_deltalake(mode="overwrite", predicate="partition_key =
'k'")`: new data files, then one commit to the transaction log that removes the
partition's old files and adds the new ones. Readers (delta-rs, polars, duckdb, Spark) see
the log before that commit or after it, so the old partition or the new one, whole. A
write that fails or is killed before its commit leaves only unreferenced files (`vacuum`
removes them); one that fails after it has replaced the partition, and a retry replaces it
again with the same rows: never a row twice. Two writers of one partition at once: delta-rs
detects the conflict at commit and one of them fails, retryably.

`committed_at` is the manifest's commit time: a write never replaces a partition that a
newer commit of it has written already (a slow retry of an old run).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dagster_gpuinfer.sinks.partition_rows import SinkInputError
from dagster_gpuinfer.sinks.pgvector import SinkLayout
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage import Manifest
from dagster_gpuinfer.storage.delta import DeltaUnavailable, open_table, storage_options

PARTITION_COLUMN = "partition_key"


class DeltaSink(BaseModel):
    """Each committed partition overwritten, whole and in one Delta commit, in a Delta Lake
    table: a retry, a resumed run or a re-materialization never leaves a row twice or a
    partition half-written.

    Embedding tasks write `embedding` (a list of float32), generation tasks `text`. The
    table lives on local disk or S3; S3's endpoint and region are the run's (the resource's
    `s3_endpoint_url`, `s3_region`) unless `storage` is set here, credentials the standard
    AWS environment variables.

    Examples:
        >>> inference_assets(..., sink=DeltaSink(uri="s3://lake/doc_embeddings"))
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["delta"] = Field("delta", description="The sink's kind.")
    uri: str = Field(description="The table's root: a local folder or `s3://bucket/prefix`.")
    storage: StorageOptions | None = Field(
        None, description="S3 endpoint and region of the table; None: the run's storage."
    )
    batch_rows: int = Field(
        65536, ge=1, le=10_000_000, description="Rows read from the part files at a time."
    )

    @field_validator("uri")
    @classmethod
    def _a_table_root(cls, value: str) -> str:
        if not value or "{" in value or "://" in value and not value.startswith("s3://"):
            raise ValueError(
                f"uri {value!r} is not a table root: a local folder or s3://bucket/prefix "
                "(no placeholder: the partition key is a column of the table)"
            )
        return value

    def describe(self) -> str:
        """`delta:<uri>`: how metadata names the sink."""
        return f"{self.kind}:{self.uri}"


def sink_schema(layout: SinkLayout) -> pa.Schema:
    """The table's columns for a task's outputs (see the module's docstring)."""
    payload = pa.list_(pa.float32()) if layout.vectors else pa.string()
    return pa.schema(
        [
            (PARTITION_COLUMN, pa.string()),
            ("id", pa.string()),
            (layout.column, payload),
            ("spec_hash", pa.string()),
            ("input_version", pa.string()),
            ("committed_at", pa.float64()),
            *([("tenant", pa.string())] if layout.tenants else []),
        ]
    )


def sink_batch(batch: pa.RecordBatch, schema: pa.Schema, manifest: Manifest) -> pa.RecordBatch:
    """One batch of output rows (`id`, the payload column and, for a batch API route's
    table, `tenant`) as rows of the table."""
    rows = batch.num_rows
    payload_name = schema.names[2]
    source = manifest.source
    return pa.RecordBatch.from_arrays(
        [
            pa.repeat(pa.scalar(manifest.partition_key, pa.string()), rows),
            pc.cast(batch.column("id"), pa.string()),
            pc.cast(batch.column(payload_name), schema.field(payload_name).type),
            pa.repeat(pa.scalar(manifest.spec_hash, pa.string()), rows),
            pa.repeat(pa.scalar(source.input if source else None, pa.string()), rows),
            pa.repeat(pa.scalar(manifest.committed_at, pa.float64()), rows),
            *([pc.cast(batch.column("tenant"), pa.string())] if "tenant" in schema.names else []),
        ],
        schema=schema,
    )


def partition_predicate(partition_key: str) -> str:
    """The SQL predicate selecting one partition (quotes doubled)."""
    return f"{PARTITION_COLUMN} = '{partition_key.replace(chr(39), chr(39) * 2)}'"


def held_commit(table: Any, partition_key: str) -> tuple[float | None, int]:
    """The commit time recorded for the partition in the table and its row count (None, 0:
    the table holds none of it); reads one column of the partition's files."""
    import pyarrow.dataset as ds

    dataset = table.to_pyarrow_dataset()
    held = dataset.to_table(
        columns=["committed_at"], filter=ds.field(PARTITION_COLUMN) == partition_key
    )
    if held.num_rows == 0:
        return None, 0
    return pc.max(held.column("committed_at")).as_py(), held.num_rows


def ready_table(sink: DeltaSink, storage: StorageOptions | None, schema: pa.Schema) -> Any:
    """The sink's table, created empty (its schema, partitioned by `partition_key`) if it is
    not there. Every write then overwrites from a snapshot of an existing table, which is
    what lets delta-rs see a concurrent write of the same partition and refuse one of the
    two: two writers that both created the table would both append their rows."""
    try:
        return open_table(sink.uri, storage)
    except FileNotFoundError:
        pass
    from deltalake import DeltaTable

    try:
        DeltaTable.create(
            sink.uri,
            schema=schema,
            partition_by=[PARTITION_COLUMN],
            mode="ignore",
            storage_options=storage_options(sink.uri, storage),
        )
    except Exception:
        try:  # another writer created it at the same moment
            return open_table(sink.uri, storage)
        except FileNotFoundError:
            pass
        raise
    return open_table(sink.uri, storage)


class _CountedRows:
    """The partition's rows as table batches, counted; past the last one, the count must be
    the manifest's `rows_out` or the stream fails, so the write never commits. delta-rs
    reports a failure of the stream as its own error; `failed` keeps the original."""

    def __init__(self, batches: Iterable[pa.RecordBatch], schema: pa.Schema, manifest: Manifest):
        self.batches, self.schema, self.manifest = batches, schema, manifest
        self.rows = 0
        self.failed: SinkInputError | None = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        try:
            for batch in self.batches:
                self.rows += batch.num_rows
                yield sink_batch(batch, self.schema, self.manifest)
        except SinkInputError as exc:
            self.failed = exc
            raise
        if self.rows != self.manifest.rows_out:
            self.failed = SinkInputError(
                f"partition {self.manifest.partition_key!r}: its part files hold {self.rows} "
                f"rows but its manifest says rows_out={self.manifest.rows_out}"
            )
            raise self.failed


def overwrite_partition(
    sink: DeltaSink,
    storage: StorageOptions | None,
    layout: SinkLayout,
    manifest: Manifest,
    batches: Iterable[pa.RecordBatch],
) -> tuple[int, bool]:
    """Overwrite the partition with `batches` (its committed rows) in one Delta commit, or
    leave it when a newer commit of it is there. (rows the table holds for it, superseded).

    Raises:
        SinkInputError: the rows are not what the manifest says (nothing was committed).
        DeltaUnavailable: deltalake is not installed.
        Exception: delta-rs's own (storage, conflicting commit, schema), table unchanged.
    """
    storage = sink.storage or storage
    key = manifest.partition_key
    schema = sink_schema(layout)
    table = ready_table(sink, storage, schema)  # DeltaUnavailable without deltalake
    from deltalake import write_deltalake

    committed_at, rows = held_commit(table, key)
    if committed_at is not None and committed_at > manifest.committed_at:
        return rows, True
    counted = _CountedRows(batches, schema, manifest)
    reader = pa.RecordBatchReader.from_batches(schema, iter(counted))
    try:
        write_deltalake(
            table,
            reader,
            mode="overwrite",
            predicate=partition_predicate(key),
            partition_by=[PARTITION_COLUMN],
        )
    except Exception:
        if counted.failed is not None:
            raise counted.failed from None
        raise
    return counted.rows, False


__all__ = ["DeltaSink", "DeltaUnavailable", "overwrite_partition", "sink_schema"]
