"""Sinks: where committed partitions go besides their files, each replaced whole per
partition so that retries never duplicate rows.

`PgVectorSink` (PostgreSQL, pgvector for embeddings) is configuration, not code: pass it to
`inference_assets(sink=...)`. Importing this package loads no database driver.
"""

from __future__ import annotations

from dagster_gpuinfer.sinks.pgvector import PgVectorSink as PgVectorSink
from dagster_gpuinfer.sinks.pgvector import sink_layout as sink_layout

__all__ = ["PgVectorSink", "sink_layout"]
