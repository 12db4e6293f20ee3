"""A committed partition's output rows, as a sink reads them: through its `_SUCCESS`
manifest (the files stay the system of record), in bounded record batches.

Imports pyarrow and the storage layer only: no database driver, no Dagster.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest, display_uri, filesystem_for, partition_dir


class SinkInputError(Exception):
    """The committed files cannot feed the sink (a part file missing, a column absent, its
    rows not what the manifest says): the partition must be recomputed, not re-sent."""


def _part_paths(spec: InferenceSpec, manifest: Manifest) -> tuple[object, list[str]]:
    fs, path = filesystem_for(partition_dir(spec.output, manifest.partition_key), spec.storage)
    names = [part.name for part in manifest.parts]
    not_parquet = [name for name in names if not name.endswith(".parquet")]
    if not_parquet:
        raise SinkInputError(
            f"partition {manifest.partition_key!r}: part file {not_parquet[0]} is not Parquet; "
            "the sink reads Parquet output (output_format='parquet')"
        )
    return fs, [posixpath.join(path, name) for name in names]


def vector_dimension(spec: InferenceSpec, manifest: Manifest, column: str) -> int | None:
    """The length of the fixed-size float vectors in `column` of the partition's first part
    file (the footer only); None when the partition committed no part file."""
    fs, paths = _part_paths(spec, manifest)
    if not paths:
        return None
    with fs.open_input_file(paths[0]) as handle:  # type: ignore[attr-defined]
        schema = pq.read_schema(handle)
    if column not in schema.names:
        raise SinkInputError(
            f"partition {manifest.partition_key!r}: {paths[0]} has no column {column!r} "
            f"(it has {schema.names})"
        )
    kind = schema.field(column).type
    if not pa.types.is_fixed_size_list(kind):
        raise SinkInputError(
            f"partition {manifest.partition_key!r}: column {column!r} of {paths[0]} is {kind}, "
            "not a fixed-size list of floats (an embedding)"
        )
    return kind.list_size


def committed_batches(
    spec: InferenceSpec, manifest: Manifest, columns: Sequence[str], *, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    """The partition's committed rows, `columns` only, at most `batch_rows` a batch, from the
    part files its manifest names (and no other file of the folder).

    Raises:
        SinkInputError: a part file named by the manifest is missing or lacks a column.
    """
    fs, paths = _part_paths(spec, manifest)
    for path in paths:
        try:
            handle = fs.open_input_file(path)  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise SinkInputError(
                f"partition {manifest.partition_key!r}: {display_uri(fs, path)} named by its "
                "manifest is missing (a newer commit may have replaced it); nothing was "
                "written to the sink"
            ) from None
        with handle:
            parquet = pq.ParquetFile(handle)
            missing = [name for name in columns if name not in parquet.schema_arrow.names]
            if missing:
                raise SinkInputError(
                    f"partition {manifest.partition_key!r}: {display_uri(fs, path)} has no "
                    f"column {missing[0]!r}"
                )
            yield from parquet.iter_batches(batch_size=batch_rows, columns=list(columns))
