"""The sink step of a materialization: after the worker reports its commits, the control
plane sends each committed partition to the pipeline's sink, whole, and the partition's
metadata says what the sink holds.

Why here and not in the worker: the files and `_SUCCESS` manifests stay the system of
record, so the sink is a function of a committed partition that any process can replay;
the control plane already holds the run's manifests (reused partitions too, for which no
worker starts), and the database credentials stay with the code location instead of being
handed to every GPU pod (whose network policy need not reach the database).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import dagster as dg
import pyarrow as pa

from dagster_gpuinfer.sinks.delta import DeltaSink, DeltaUnavailable, overwrite_partition
from dagster_gpuinfer.sinks.partition_rows import (
    SinkInputError,
    committed_batches,
    vector_dimension,
)
from dagster_gpuinfer.sinks.pgvector import PgVectorSink, SinkLayout, sink_layout
from dagster_gpuinfer.sinks.pgvector_write import (
    SinkError,
    SinkWrite,
    connect,
    ensure_table,
    first_line,
    replace_partition,
)
from dagster_gpuinfer.spec import InferenceSpec, StorageOptions
from dagster_gpuinfer.storage import Manifest


def _first_dimension(
    spec: InferenceSpec, manifests: Mapping[str, Manifest], layout: SinkLayout
) -> int | None:
    if not layout.vectors:
        return None
    for key in sorted(manifests):
        dimension = vector_dimension(spec, manifests[key], layout.column)
        if dimension is not None:
            return dimension
    return None


def write_partitions(
    sink: PgVectorSink,
    spec: InferenceSpec,
    manifests: Mapping[str, Manifest],
    *,
    connection: Callable[[PgVectorSink], Any] = connect,
) -> dict[str, SinkWrite]:
    """Replace each committed partition in the sink (one transaction each), in key order.

    Raises:
        SinkError: a partition could not be written (it and the ones after it keep what the
            sink held; the ones before it are written).
    """
    layout = sink_layout(spec.task)
    try:
        dimension = _first_dimension(spec, manifests, layout)
    except SinkInputError as exc:
        raise SinkError(str(exc), retryable=False) from None
    conn = connection(sink)
    try:
        ready = ensure_table(conn, sink, layout, dimension)
        writes = {}
        for key in sorted(manifests):
            manifest = manifests[key]
            if not ready:  # no table and no rows to create it from: nothing to replace
                writes[key] = SinkWrite(partition_key=key, rows=0)
                continue
            batches = committed_batches(
                spec, manifest, ["id", layout.column], batch_rows=sink.batch_rows
            )
            try:
                writes[key] = replace_partition(conn, sink, layout, manifest, batches)
            except SinkInputError as exc:
                raise SinkError(str(exc), retryable=False) from None
        return writes
    finally:
        conn.close()


def delta_write(
    sink: DeltaSink,
    storage: StorageOptions | None,
    layout: SinkLayout,
    manifest: Manifest,
    batches: Iterable[pa.RecordBatch],
) -> SinkWrite:
    """Overwrite one partition in the Delta table (one commit), delta-rs's errors as
    `SinkError`s.

    Raises:
        SinkError: the partition could not be written; the table holds it as it was.
    """
    key = manifest.partition_key
    try:
        rows, superseded = overwrite_partition(sink, storage, layout, manifest, batches)
    except (SinkInputError, DeltaUnavailable, ValueError) as exc:
        raise SinkError(
            f"partition {key!r}: {exc}; nothing of it was committed to {sink.describe()}",
            retryable=False,
        ) from None
    except Exception as exc:  # delta-rs: storage, a conflicting commit, the schema
        raise SinkError(
            f"partition {key!r}: writing to {sink.describe()} failed "
            f"({type(exc).__name__}: {first_line(exc)[:500]}); the table holds the partition "
            "as it was",
            retryable=_retryable_delta_error(exc),
        ) from None
    return SinkWrite(partition_key=key, rows=rows, superseded=superseded)


def write_delta_partitions(
    sink: DeltaSink, spec: InferenceSpec, manifests: Mapping[str, Manifest]
) -> dict[str, SinkWrite]:
    """Overwrite each committed partition in the Delta table (one commit each), in key order.

    Raises:
        SinkError: a partition could not be written (it and the ones after it keep what the
            table held; the ones before it are written).
    """
    layout = sink_layout(spec.task)
    writes = {}
    for key in sorted(manifests):
        batches = committed_batches(
            spec, manifests[key], ["id", layout.column], batch_rows=sink.batch_rows
        )
        writes[key] = delta_write(sink, spec.storage, layout, manifests[key], batches)
    return writes


def _retryable_delta_error(exc: Exception) -> bool:
    """Storage and conflicting commits may pass on a retry; a schema the table refuses not."""
    from deltalake.exceptions import SchemaMismatchError

    return not isinstance(exc, SchemaMismatchError | TypeError)


def sink_partitions(
    sink: PgVectorSink | DeltaSink | None,
    spec: InferenceSpec,
    manifests: Mapping[str, Manifest],
) -> dict[str, dict[str, Any]]:
    """Send the run's committed partitions to `sink`; each partition's sink metadata
    (`sink`, `sink_rows`: the rows the sink holds for it). Nothing without a sink.

    Raises:
        dagster.Failure: the sink failed; retried by the asset's retry policy when the
            server or the connection failed (the retry reuses the committed files and
            replaces the partitions again), not when the rows or the configuration must change.
    """
    if sink is None or not manifests:
        return {}
    try:
        if isinstance(sink, DeltaSink):
            writes = write_delta_partitions(sink, spec, manifests)
        else:
            writes = write_partitions(sink, spec, manifests)
    except SinkError as exc:
        raise dg.Failure(
            description=f"{exc} The partitions' files are committed; "
            + (
                "a retry sends them again."
                if exc.retryable
                else "fix the cause, then re-materialize to send them."
            ),
            allow_retries=exc.retryable,
        ) from None
    return {
        key: {
            "sink": sink.describe(),
            "sink_rows": write.rows,
            **({"sink_superseded_by_newer_commit": True} if write.superseded else {}),
        }
        for key, write in writes.items()
    }
