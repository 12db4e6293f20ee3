"""The worker's Pipes messages (`dagster_gpuinfer.messages`): what one side writes, the
other reads."""

from __future__ import annotations

import pydantic
import pytest

from dagster_gpuinfer.messages import (
    Fatal,
    PartitionCommitted,
    PartitionFailed,
    RunFinished,
    parse_message,
    to_payload,
)
from dagster_gpuinfer.storage import FileEntry, Manifest

ENTRY = FileEntry(name="part-0.parquet", rows=3, bytes=10, sha256="0" * 64)
MANIFEST = Manifest(
    partition_key="p",
    spec_hash="h",
    model="m",
    task="embed",
    output_format="parquet",
    rows_in=3,
    rows_out=3,
    rows_errored=0,
    parts=[ENTRY],
    errors=ENTRY,
)


@pytest.mark.parametrize(
    "message",
    [
        PartitionCommitted(computed=True, manifest=MANIFEST),
        PartitionFailed(error_type="bad_shard", message="missing", partition_key="p"),
        Fatal(error_type="bad_spec", message="no model"),
        RunFinished(partitions=2, model_loads=1, wall_seconds=3.5),
    ],
)
def test_every_message_reads_back_as_written(message):
    assert parse_message(to_payload(message)) == message


def test_run_summary_keeps_fields_the_model_does_not_declare():
    payload = {"type": "run", "model_loads": 1, "timings": {"engine_build_seconds": 2.0}}
    summary = parse_message(payload).summary()
    assert summary["timings"] == {"engine_build_seconds": 2.0}
    assert summary["model_loads"] == 1 and "type" not in summary


def test_unknown_messages_are_skipped_and_malformed_ones_refused():
    assert parse_message({"type": "metrics", "gpu_utilization": 0.9}) is None
    assert parse_message("not a message") is None
    with pytest.raises(pydantic.ValidationError, match="manifest"):
        parse_message({"type": "partition", "computed": True})
