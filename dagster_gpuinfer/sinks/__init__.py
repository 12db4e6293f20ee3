"""Sinks: where committed partitions go besides their files, each replaced whole per
partition so that retries never duplicate rows.

`PgVectorSink` (PostgreSQL, pgvector for embeddings) and `DeltaSink` (a Delta Lake table on
local disk or S3) are configuration, not code: pass one to `inference_assets(sink=...)`.
Importing this package loads no database driver and no deltalake.
"""

from __future__ import annotations

from dagster_gpuinfer.sinks.delta import DeltaSink as DeltaSink
from dagster_gpuinfer.sinks.pgvector import PgVectorSink as PgVectorSink
from dagster_gpuinfer.sinks.pgvector import sink_layout as sink_layout

__all__ = ["DeltaSink", "PgVectorSink", "sink_layout"]
