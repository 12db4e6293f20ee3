"""Sinks: where committed partitions go besides their files, each replaced whole per
partition so that retries never duplicate rows.

`PgVectorSink` (PostgreSQL, pgvector for embeddings) and `DeltaSink` (a Delta Lake table on
local disk or S3) are configuration, not code: pass one to `inference_assets(sink=...)`, or
name one in a batch API route (`sink:` in the routing table, the same fields).
Importing this package loads no database driver and no deltalake.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster_gpuinfer.sinks.delta import DeltaSink as DeltaSink
from dagster_gpuinfer.sinks.pgvector import PgVectorSink as PgVectorSink
from dagster_gpuinfer.sinks.pgvector import sink_layout as sink_layout

Sink = PgVectorSink | DeltaSink


def sink_settings(sink: Sink | Mapping[str, Any]) -> Sink:
    """The sink's settings as their model: a mapping's `kind` picks it (pgvector if unset).

    Raises:
        ValueError: (pydantic's ValidationError) a field is missing or wrong.
    """
    if isinstance(sink, PgVectorSink | DeltaSink):
        return sink
    if not isinstance(sink, Mapping):
        raise ValueError(
            f"sink: expected the settings of a sink (kind: pgvector or delta, and its fields), "
            f"not {type(sink).__name__}"
        )
    if sink.get("kind", "pgvector") == "delta":
        return DeltaSink.model_validate(sink)
    return PgVectorSink.model_validate(sink)


__all__ = ["DeltaSink", "PgVectorSink", "Sink", "sink_layout", "sink_settings"]
