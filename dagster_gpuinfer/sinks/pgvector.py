"""The PostgreSQL + pgvector sink's configuration and its pure parts: the table layout a
task's outputs take, the SQL that creates and replaces a partition, and the rows as COPY
input. No I/O and no database driver here (`sinks.pgvector_write` talks to the server).

Layout of the sink table (`PgVectorSink.table`, created if missing)::

    partition_key text, id text, embedding vector(d) | text text, spec_hash text
    [, tenant text]    batch API routes: the tenant whose batch the row is of
    PRIMARY KEY (partition_key, id)

and beside it `<table>_partitions`, one row per partition written: the manifest's spec hash,
source versions, commit time and row count, replaced in the same transaction as the rows.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dagster_gpuinfer.task_table import task_facts

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# An unquoted identifier, optionally schema-qualified; 48 characters leave room for the
# `_partitions` and `_embedding_hnsw` suffixes within PostgreSQL's 63.
TABLE_NAME = re.compile(r"^([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,47}$")
# pgvector's HNSW index takes vectors of at most 2,000 dimensions.
HNSW_MAX_DIMENSIONS = 2000
OPERATOR_CLASSES = {
    "cosine": "vector_cosine_ops",
    "l2": "vector_l2_ops",
    "inner_product": "vector_ip_ops",
}
DISTANCE_OPERATORS = {"cosine": "<=>", "l2": "<->", "inner_product": "<#>"}


class PgVectorSink(BaseModel):
    """Each committed partition replaced, whole and in one transaction, in a PostgreSQL
    table (with pgvector for embeddings): a retry, a resumed run or a re-materialization
    never leaves a row twice or a partition half-written.

    Embedding tasks (embed, image_embed) write `embedding vector(d)`, d from the output;
    generation tasks (generate, chat, vision_*) write `text`. The connection URL is read at
    run time from the environment variable `url_env`: only its name is configuration.

    Examples:
        >>> inference_assets(..., sink=PgVectorSink(url_env="EMBEDDINGS_DB_URL",
        ...                                          table="doc_embeddings"))
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["pgvector"] = Field("pgvector", description="The sink's kind.")
    url_env: str = Field(
        description="Name of the environment variable that holds the database's libpq URL "
        "(postgresql://user:password@host:5432/db); the URL itself never goes in the "
        "pipeline's configuration."
    )
    table: str = Field(
        description="Table for the rows, optionally schema-qualified (lower case); created "
        "with the pgvector extension if missing, beside `<table>_partitions`."
    )
    index: Literal["hnsw", "none"] = Field(
        "hnsw", description="Embeddings: an HNSW index for nearest-neighbour queries, or none."
    )
    distance: Literal["cosine", "l2", "inner_product"] = Field(
        "cosine", description="Embeddings: the distance the HNSW index serves."
    )
    batch_rows: int = Field(
        4096, ge=1, le=1_000_000, description="Rows read and sent to the server at a time."
    )
    connect_timeout: int = Field(10, ge=1, description="Seconds to wait for a connection.")

    @field_validator("url_env")
    @classmethod
    def _a_variable_name(cls, value: str) -> str:
        if not ENV_NAME.match(value):
            raise ValueError(
                "url_env names the environment variable that holds the database URL (e.g. "
                "'EMBEDDINGS_DB_URL'), not the URL: a URL here would travel in asset "
                "metadata and the run's config; set it in the environment of the code "
                "location, or of the batch API service for a route's sink (a Kubernetes "
                "Secret as an env var in production)"
            )
        return value

    @field_validator("table")
    @classmethod
    def _a_table_name(cls, value: str) -> str:
        if not TABLE_NAME.match(value):
            raise ValueError(
                f"table {value!r} is not a plain lower-case name ([a-z_][a-z0-9_]*, at most "
                "48 characters, optionally 'schema.name')"
            )
        return value

    def describe(self) -> str:
        """`pgvector:<table>`: how metadata names the sink (never the URL)."""
        return f"{self.kind}:{self.table}"


@dataclass(frozen=True)
class SinkLayout:
    """Which output column a task's rows send, and as what SQL type; `tenants`: the rows
    also carry a `tenant` column (a batch API route's sink: one table, every tenant's
    batches)."""

    column: str
    vectors: bool
    tenants: bool = False

    @property
    def columns(self) -> list[str]:
        """The columns the rows sent to the sink carry besides the partition's own."""
        return ["id", self.column, *(["tenant"] if self.tenants else [])]

    def sql_type(self, dimension: int | None) -> str:
        return f"vector({dimension})" if self.vectors else "text"


def sink_layout(task: str, *, tenants: bool = False) -> SinkLayout:
    """The column a task's outputs are written from (`tenants`: and a `tenant` column).

    Raises:
        ValueError: a task whose outputs this sink does not take (score, classify).
    """
    if task_facts(task).embeds:
        return SinkLayout(column="embedding", vectors=True, tenants=tenants)
    if task_facts(task).samples:
        return SinkLayout(column="text", vectors=False, tenants=tenants)
    raise ValueError(
        f"a sink takes embeddings (embed, image_embed) or generated text "
        f"(generate, chat, vision_generate, vision_chat), not task {task!r}"
    )


def split_table(table: str) -> tuple[str | None, str]:
    """(schema or None, name) of a validated table name."""
    schema, _, name = table.rpartition(".")
    return schema or None, name


def partitions_table(table: str) -> str:
    """The table recording each written partition's manifest, beside the rows."""
    return f"{table}_partitions"


def vector_text(column: pa.Array) -> pa.Array:
    """Fixed-size float vectors as pgvector's text input (`[0.1,-2,3e-05]`), columnar: each
    float's shortest round-trip text, so the server stores the very float32 values."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    size = column.type.list_size
    values = column.values.slice(column.offset * size, len(column) * size)
    offsets = pa.array(range(0, len(column) * size + 1, size), pa.int32())
    as_text = pa.ListArray.from_arrays(offsets, pc.cast(values, pa.string()), mask=column.is_null())
    return pc.binary_join_element_wise("[", pc.binary_join(as_text, ","), "]", "")


def copy_columns(layout: SinkLayout) -> str:
    """The columns of `copy_csv`'s rows, as COPY names them."""
    payload = "embedding" if layout.vectors else "text"
    return ", ".join(["partition_key", "id", payload, "spec_hash", *(["tenant"] * layout.tenants)])


def copy_csv(
    batch: pa.RecordBatch, layout: SinkLayout, *, partition_key: str, spec_hash: str
) -> bytes:
    """One batch of output rows as COPY ... (FORMAT csv) input, in `copy_columns` order:
    nulls unquoted and empty (NULL to the server), every string quoted."""
    rows = batch.num_rows
    payload = batch.column(layout.column)
    columns = {
        "partition_key": pa.repeat(pa.scalar(partition_key), rows),
        "id": pc.cast(batch.column("id"), pa.string()),
        "payload": vector_text(payload) if layout.vectors else pc.cast(payload, pa.string()),
        "spec_hash": pa.repeat(pa.scalar(spec_hash), rows),
    }
    if layout.tenants:
        columns["tenant"] = pc.cast(batch.column("tenant"), pa.string())
    table = pa.table(columns)
    sink = io.BytesIO()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False))
    return sink.getvalue()
