"""The PostgreSQL + pgvector sink's writes: the table made ready once, then each committed
partition replaced in one transaction.

The replace, for one partition key::

    BEGIN
    SELECT pg_advisory_xact_lock(...)             one writer of this partition at a time
    SELECT committed_at FROM <table>_partitions   a newer commit written already: stop
    DELETE FROM <table> WHERE partition_key = k
    COPY <table> FROM STDIN (FORMAT csv)          the committed rows, batch by batch
    INSERT INTO <table>_partitions ... ON CONFLICT DO UPDATE   the manifest's record
    COMMIT

so readers see the old partition or the new one, whole; a failure anywhere (a bad row, a
lost connection, a killed writer) rolls back to the old. The lock matters: under READ
COMMITTED a second writer's DELETE would not see rows the first inserts, and would then
insert its own beside them (or, with the primary key, fail).

psycopg2 (installed with dagster-postgres, the `postgres` extra) is imported only when a
connection is opened; the connection is injected everywhere else, so tests hand in their own.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dagster_gpuinfer.sinks.pgvector import (
    HNSW_MAX_DIMENSIONS,
    OPERATOR_CLASSES,
    PgVectorSink,
    SinkLayout,
    copy_columns,
    copy_csv,
    partitions_table,
    split_table,
)
from dagster_gpuinfer.storage import Manifest

DDL_LOCK = "dagster-gpuinfer sink tables"


class SinkError(Exception):
    """The sink could not write a partition; the sink's table is as it was before.

    `retryable`: the server or the connection failed (a retry may succeed); otherwise the
    configuration or the rows must change first.
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class SinkWrite:
    """What the sink holds for one partition after a write."""

    partition_key: str
    rows: int
    # A newer commit of the partition had been written already: nothing was changed.
    superseded: bool = False


def connect(sink: PgVectorSink) -> Any:
    """A psycopg2 connection to the database named by the environment variable `url_env`.

    Raises:
        SinkError: the variable is unset, psycopg2 is missing or the server cannot be
            reached (the URL is never repeated in the message).
    """
    url = os.environ.get(sink.url_env)
    if not url:
        raise SinkError(
            f"the {sink.describe()} sink reads its database URL from the environment "
            f"variable {sink.url_env}, which is not set in this process; set it where the "
            "code location runs (a batch API route's sink: where the batch API service runs; "
            "in Kubernetes: a Secret as an env var)",
            retryable=False,
        )
    try:
        import psycopg2
    except ImportError:
        raise SinkError(
            "the pgvector sink needs psycopg2: install dagster-gpuinfer[postgres]",
            retryable=False,
        ) from None
    try:
        return psycopg2.connect(
            url, connect_timeout=sink.connect_timeout, application_name="dagster-gpuinfer sink"
        )
    except psycopg2.OperationalError as exc:
        raise SinkError(
            f"cannot connect to the {sink.describe()} sink's database ({sink.url_env}): "
            f"{first_line(exc)}",
            retryable=True,
        ) from None


def _identifier(conn: Any, name: str) -> str:
    from psycopg2 import sql

    schema, table = split_table(name)
    parts = [sql.Identifier(schema), sql.Identifier(table)] if schema else [sql.Identifier(table)]
    return sql.SQL(".").join(parts).as_string(conn)


def _vector_dimension(cur: Any, table: str) -> int | None:
    """The declared dimension of the table's `embedding` column; None if it has none."""
    cur.execute(
        "SELECT atttypmod FROM pg_attribute WHERE attrelid = to_regclass(%s) "
        "AND attname = 'embedding' AND NOT attisdropped",
        [table],
    )
    row = cur.fetchone()
    return None if row is None else int(row[0])


def _has_column(cur: Any, table: str, column: str) -> bool:
    cur.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s "
        "AND NOT attisdropped",
        [table, column],
    )
    return cur.fetchone() is not None


def create_statements(
    conn: Any, sink: PgVectorSink, layout: SinkLayout, dimension: int | None
) -> list[str]:
    """CREATE ... IF NOT EXISTS for the extension, the row table, the partitions table and
    (embeddings with `index="hnsw"`) the HNSW index."""
    table, parts = _identifier(conn, sink.table), _identifier(conn, partitions_table(sink.table))
    statements = []
    if layout.vectors:
        statements.append("CREATE EXTENSION IF NOT EXISTS vector")
    payload = "embedding" if layout.vectors else "text"
    statements.append(
        f"CREATE TABLE IF NOT EXISTS {table} (partition_key text NOT NULL, id text NOT NULL, "
        f"{payload} {layout.sql_type(dimension)}, spec_hash text NOT NULL, "
        + ("tenant text NOT NULL, " if layout.tenants else "")
        + "PRIMARY KEY (partition_key, id))"
    )
    statements.append(
        f"CREATE TABLE IF NOT EXISTS {parts} (partition_key text PRIMARY KEY, spec_hash text "
        "NOT NULL, input_version text, model_version text, committed_at double precision NOT "
        "NULL, rows bigint NOT NULL, written_at timestamptz NOT NULL DEFAULT now())"
    )
    if layout.vectors and sink.index == "hnsw":
        index_name = _identifier(conn, f"{split_table(sink.table)[1]}_embedding_hnsw")
        statements.append(
            f"CREATE INDEX IF NOT EXISTS {index_name} ON {table} USING hnsw "
            f"(embedding {OPERATOR_CLASSES[sink.distance]})"
        )
    return statements


def ensure_table(conn: Any, sink: PgVectorSink, layout: SinkLayout, dimension: int | None) -> bool:
    """Create the sink's tables (and the pgvector extension) if missing, serialized across
    writers by an advisory lock; check an existing table takes these outputs. False when the
    table is missing and nothing is known to create it with (no rows, no dimension).

    Raises:
        SinkError: the table holds vectors of another dimension or is not a table of this
            kind of sink, the dimension is past what an HNSW index takes, or the server
            refused a statement (retryable when the connection failed).
    """
    import psycopg2

    try:
        return _ensure_table(conn, sink, layout, dimension)
    except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
        raise SinkError(
            f"the connection to {sink.describe()} failed while making its table ready "
            f"({first_line(exc)})",
            retryable=True,
        ) from None
    except psycopg2.Error as exc:
        raise SinkError(
            f"{sink.describe()} refused to make its table ready ({first_line(exc)}); is "
            f"{sink.table} a table of another kind?",
            retryable=False,
        ) from None


def _ensure_table(conn: Any, sink: PgVectorSink, layout: SinkLayout, dimension: int | None) -> bool:
    with conn, conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [DDL_LOCK])
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", [sink.table])
        exists = cur.fetchone()[0]
        if not exists and layout.vectors and dimension is None:
            return False
        if not exists and layout.vectors and sink.index == "hnsw":
            if dimension is not None and dimension > HNSW_MAX_DIMENSIONS:
                raise SinkError(
                    f"{sink.describe()}: {dimension}-dimensional embeddings are past the "
                    f"{HNSW_MAX_DIMENSIONS} an HNSW index takes; set index='none'",
                    retryable=False,
                )
        for statement in create_statements(conn, sink, layout, dimension):
            cur.execute(statement)
        held = _vector_dimension(cur, sink.table) if layout.vectors else None
        tenants = _has_column(cur, sink.table, "tenant")
    if tenants != layout.tenants:
        raise SinkError(
            f"{sink.describe()}: the table "
            + (
                "has no tenant column, so it is a pipeline's sink; a batch API route's sink "
                "records each row's tenant: name another table"
                if layout.tenants
                else "has a tenant column, so it is a batch API route's sink; name another "
                "table for this pipeline"
            ),
            retryable=False,
        )
    if layout.vectors and dimension is not None and held != dimension:
        raise SinkError(
            f"{sink.describe()}: the table holds vector({held}) embeddings but these outputs "
            f"are {dimension}-dimensional; name another table, or drop this one to recreate "
            "it",
            retryable=False,
        )
    return True


def _record_partition(cur: Any, sink: PgVectorSink, manifest: Manifest, rows: int) -> None:
    parts = _identifier(cur.connection, partitions_table(sink.table))
    source = manifest.source
    cur.execute(
        f"INSERT INTO {parts} (partition_key, spec_hash, input_version, model_version, "
        "committed_at, rows, written_at) VALUES (%s, %s, %s, %s, %s, %s, now()) "
        "ON CONFLICT (partition_key) DO UPDATE SET spec_hash = EXCLUDED.spec_hash, "
        "input_version = EXCLUDED.input_version, model_version = EXCLUDED.model_version, "
        "committed_at = EXCLUDED.committed_at, rows = EXCLUDED.rows, written_at = now()",
        [
            manifest.partition_key,
            manifest.spec_hash,
            source.input if source else None,
            source.model if source else None,
            manifest.committed_at,
            rows,
        ],
    )


def _newer_commit_written(cur: Any, sink: PgVectorSink, manifest: Manifest) -> int | None:
    """The rows of a newer commit of this partition already in the sink, if there is one."""
    parts = _identifier(cur.connection, partitions_table(sink.table))
    cur.execute(
        f"SELECT committed_at, rows FROM {parts} WHERE partition_key = %s",
        [manifest.partition_key],
    )
    row = cur.fetchone()
    return int(row[1]) if row is not None and row[0] > manifest.committed_at else None


def replace_partition(
    conn: Any,
    sink: PgVectorSink,
    layout: SinkLayout,
    manifest: Manifest,
    batches: Iterable[pa.RecordBatch],
) -> SinkWrite:
    """Replace the partition's rows with `batches` (its committed rows) in one transaction;
    see the module's docstring for the steps. The rows sent must be the manifest's
    `rows_out`, or nothing changes.

    Raises:
        SinkError: the write failed and was rolled back (the sink holds what it held).
    """
    import psycopg2

    key = manifest.partition_key
    table = _identifier(conn, sink.table)
    columns = copy_columns(layout)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"{sink.table}/{key}"]
            )
            newer = _newer_commit_written(cur, sink, manifest)
            if newer is not None:
                return SinkWrite(partition_key=key, rows=newer, superseded=True)
            cur.execute(f"DELETE FROM {table} WHERE partition_key = %s", [key])
            rows = 0
            for batch in batches:
                data = copy_csv(batch, layout, partition_key=key, spec_hash=manifest.spec_hash)
                cur.copy_expert(
                    f"COPY {table} ({columns}) FROM STDIN (FORMAT csv)", io.BytesIO(data)
                )
                rows += batch.num_rows
            if rows != manifest.rows_out:
                raise SinkError(
                    f"partition {key!r}: its part files hold {rows} rows but its manifest says "
                    f"rows_out={manifest.rows_out}; nothing was written to {sink.describe()}",
                    retryable=False,
                )
            _record_partition(cur, sink, manifest, rows)
    except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
        raise SinkError(
            f"partition {key!r}: the connection to {sink.describe()} failed mid-write "
            f"({first_line(exc)}); the transaction was rolled back, the table holds the "
            "partition as it was",
            retryable=True,
        ) from None
    except psycopg2.Error as exc:
        raise SinkError(
            f"partition {key!r}: {sink.describe()} refused the rows ({first_line(exc)}); the "
            "transaction was rolled back, the table holds the partition as it was",
            retryable=False,
        ) from None
    return SinkWrite(partition_key=key, rows=rows)


def first_line(exc: BaseException) -> str:
    """The first line of the error's message; its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
