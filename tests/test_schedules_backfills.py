"""Schedules and backfills through Dagster's own daemons, and the downstream automation.

The engine module at the bottom is the issue's "done when", end to end on a loopback S3
server: files dropped into an S3 prefix become partitions (sensor daemon), one backfill
processes them in ceil(N/K) runs with one model load each (backfill daemon, real vLLM on the
CPU), outputs and manifests read back with boto3, and the polars stats downstream are
requested by their automation condition once the upstream partitions updated.
"""

from __future__ import annotations

import io
import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from daemon_workspace import daemon_workspace, tick_backfills, tick_sensors
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus
from dagster._core.storage.dagster_run import DagsterRunStatus, RunsFilter
from dagster._core.storage.tags import BACKFILL_ID_TAG
from dagster_graphql.client.query import LAUNCH_PARTITION_BACKFILL_MUTATION
from dagster_graphql.test.utils import execute_dagster_graphql

from dagster_gpuinfer import Manifest

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"
VECTORS = dg.AssetKey("doc_vectors")
STATS = dg.AssetKey("doc_vectors_stats")


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize(
    ("tick_at", "partition"),
    [
        (datetime(2026, 11, 30, 2, 0, tzinfo=UTC), "2026-11-29"),
        (datetime(2026, 12, 1, 2, 0, tzinfo=UTC), "2026-11-30"),
    ],
)
def test_daily_schedule_requests_the_day_that_just_ended(tick_at, partition):
    from assets.daily import daily_note_embeddings
    from assets.definitions import defs

    schedule = defs.resolve_schedule_def("embed_daily_notes_schedule")
    assert schedule.cron_schedule == "0 2 * * *"
    with dg.instance_for_test() as instance:
        context = dg.build_schedule_context(instance=instance, scheduled_execution_time=tick_at)
        result = schedule.evaluate_tick(context)
    [request] = result.run_requests
    assert request.partition_key == partition
    assert request.tags["dagster/partition"] == partition
    assert defs.resolve_job_def(schedule.job_name).asset_layer.executable_asset_keys == {
        daily_note_embeddings.output_asset.key
    }
    input_uri = daily_note_embeddings.spec["input"]["uri"].replace("{partition_key}", partition)
    assert input_uri.endswith(f"/daily_notes/{partition}.jsonl")


# --------------------------------------------------------------------------- UI backfill


def test_ui_backfill_of_10_partitions_becomes_3_runs_of_at_most_4(tmp_path, monkeypatch):
    """The UI's launchPartitionBackfill mutation, then the real backfill daemon; the run
    launcher records runs instead of executing them (no model is loaded here)."""
    monkeypatch.setenv("GPUINFER_TEST_INPUT_URI", f"{tmp_path}/in/{{partition_key}}.jsonl")
    monkeypatch.setenv("GPUINFER_TEST_OUTPUT_ROOT", str(tmp_path / "out"))
    keys = [f"shard-{i:02d}" for i in range(10)]
    launcher = {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}
    with dg.instance_for_test(overrides={"run_launcher": launcher}) as instance:
        instance.add_dynamic_partitions("doc_files", keys)
        with daemon_workspace(instance) as workspace:
            result = execute_dagster_graphql(
                workspace.create_request_context(),
                LAUNCH_PARTITION_BACKFILL_MUTATION,
                variables={
                    "backfillParams": {
                        "partitionNames": keys,
                        "assetSelection": [{"path": ["doc_vectors"]}],
                    }
                },
            )
            launched = result.data["launchPartitionBackfill"]
            assert launched["__typename"] == "LaunchBackfillSuccess", launched
            tick_backfills(workspace)
            runs = instance.get_runs(
                filters=RunsFilter(tags={BACKFILL_ID_TAG: launched["backfillId"]})
            )
    assert len(runs) == math.ceil(len(keys) / 4) == 3
    ranges = sorted((run.tags[RANGE_START], run.tags[RANGE_END]) for run in runs)
    assert ranges == [("shard-00", "shard-03"), ("shard-04", "shard-07"), ("shard-08", "shard-09")]


# --------------------------------------------------------------------------- end to end


SMALL_FILES = {f"doc-{i}": [f"doc-{i}-{j:02d}" for j in range(8)] for i in range(4)}
BIG_IDS = [f"big-{j:02d}" for j in range(40)]


def jsonl(ids: list[str]) -> bytes:
    topics = ["rivers", "compilers", "bread", "glaciers", "chess"]
    return "".join(
        json.dumps({"id": i, "text": f"A short note about {topics[n % 5]}, number {n}."}) + "\n"
        for n, i in enumerate(ids)
    ).encode()


class Flow:
    """What the end-to-end fixture did, for the tests to examine."""

    instance: dg.DagsterInstance
    defs: dg.Definitions
    bucket: str
    backfill_id: str
    partition_keys: list[str]
    load_log: Path
    automation_cursor: object
    big_ranges: list[str]


@pytest.fixture(scope="module")
def flow(s3_server, tmp_path_factory):
    from assets.models import minilm_path

    tmp = tmp_path_factory.mktemp("e2e")
    bucket = s3_server.new_bucket("e2e")
    for name, ids in SMALL_FILES.items():
        s3_server.client.put_object(Bucket=bucket, Key=f"landing/{name}.jsonl", Body=jsonl(ids))
    big = jsonl(BIG_IDS)
    s3_server.client.put_object(Bucket=bucket, Key="landing/big.jsonl", Body=big)
    env = {
        "GPUINFER_TEST_INPUT_URI": f"s3://{bucket}/landing/{{partition_key}}.jsonl",
        "GPUINFER_TEST_OUTPUT_ROOT": f"s3://{bucket}/outputs",
        "GPUINFER_TEST_MODEL": minilm_path(),
        "GPUINFER_TEST_S3_ENDPOINT": s3_server.endpoint_url,
        # big.jsonl alone is split, into two byte ranges.
        "GPUINFER_TEST_SPLIT_MIN_BYTES": str(len(big) - 1),
        "GPUINFER_TEST_SPLIT_BYTES": str(len(big) // 2 + 1),
        "GPUINFER_MODEL_LOAD_LOG": str(tmp / "model_loads.log"),
        "HF_HUB_OFFLINE": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import daemon_defs

        result = Flow()
        result.defs = daemon_defs.defs.load_fn()
        result.bucket = bucket
        result.load_log = tmp / "model_loads.log"
        with dg.instance_for_test(
            synchronous_run_launcher=True, synchronous_run_coordinator=True
        ) as instance:
            result.instance = instance
            # Before anything arrived: the automation condition has nothing to request.
            before = dg.evaluate_automation_conditions(defs=result.defs, instance=instance)
            assert before.total_requested == 0
            result.automation_cursor = before.cursor
            with daemon_workspace(instance) as workspace:
                tick_sensors(workspace)
                result.partition_keys = list(instance.get_dynamic_partitions("doc_files"))
                [backfill] = instance.get_backfills(filters=BulkActionsFilter())
                result.backfill_id = backfill.backfill_id
                for _ in range(6):  # each launched run executes inside the tick
                    tick_backfills(workspace)
                    if (
                        instance.get_backfill(backfill.backfill_id).status
                        != BulkActionStatus.REQUESTED
                    ):
                        break
                tick_sensors(workspace)  # nothing new has landed since
            yield result
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.engine
def test_files_dropped_in_s3_become_partitions_once(flow):
    big_size = len(jsonl(BIG_IDS))
    half = big_size // 2 + 1
    assert flow.partition_keys == [
        f"big@bytes=0-{half}",
        f"big@bytes={half}-{big_size}",
        "doc-0",
        "doc-1",
        "doc-2",
        "doc-3",
    ]
    assert len(flow.instance.get_backfills(filters=BulkActionsFilter())) == 1


@pytest.mark.engine
def test_backfill_of_6_partitions_ran_as_2_runs_each_loading_the_model_once(flow):
    backfill = flow.instance.get_backfill(flow.backfill_id)
    assert backfill.status == BulkActionStatus.COMPLETED_SUCCESS
    runs = flow.instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: flow.backfill_id}))
    assert len(runs) == math.ceil(6 / 4) == 2
    assert {run.status for run in runs} == {DagsterRunStatus.SUCCESS}
    assert sorted((r.tags[RANGE_START], r.tags[RANGE_END]) for r in runs) == sorted(
        [(flow.partition_keys[0], flow.partition_keys[3]), ("doc-2", "doc-3")]
    )
    loads = flow.load_log.read_text().splitlines()
    assert len(loads) == len(runs) == 2
    assert len({line.split("\t")[0] for line in loads}) == 2  # two worker processes


@pytest.mark.engine
def test_outputs_and_manifests_read_back_from_s3_with_boto3(flow, s3_server):
    from dagster_gpuinfer.storage import partition_dir_name

    for key in flow.partition_keys:
        prefix = f"outputs/doc_vectors/{partition_dir_name(key)}/"
        manifest = Manifest.model_validate_json(s3_server.read(flow.bucket, prefix + "_SUCCESS"))
        assert manifest.partition_key == key
        assert manifest.balanced and manifest.rows_errored == 0
        if key.startswith("doc-"):
            assert manifest.rows_in == len(SMALL_FILES[key])
        tables = [
            pq.read_table(io.BytesIO(s3_server.read(flow.bucket, prefix + part.name)))
            for part in manifest.parts
        ]
        rows = sum(t.num_rows for t in tables)
        assert rows == manifest.rows_out
        for table in tables:
            embedding = table.schema.field("embedding").type
            assert pa.types.is_fixed_size_list(embedding) and embedding.list_size == 384
            assert embedding.value_type == pa.float32()
        errors = pq.read_table(
            io.BytesIO(s3_server.read(flow.bucket, prefix + manifest.errors.name))
        )
        assert errors.num_rows == 0


@pytest.mark.engine
def test_byte_ranges_of_the_split_file_embed_every_row_exactly_once(flow):
    from dagster_gpuinfer import read_partition
    from dagster_gpuinfer.spec import OutputSpec

    gpu = flow.defs.resources["gpu"]
    output = OutputSpec(root=f"s3://{flow.bucket}/outputs", asset_name="doc_vectors")
    ids = [
        i
        for key in flow.partition_keys
        if key.startswith("big@")
        for i in read_partition(output, key, gpu.storage_options()).column("id").to_pylist()
    ]
    assert sorted(ids) == BIG_IDS


@pytest.mark.engine
def test_every_partition_is_materialized_with_passing_checks(flow):
    assert flow.instance.get_materialized_partitions(VECTORS) == set(flow.partition_keys)
    runs = flow.instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: flow.backfill_id}))
    evaluations = [
        record.dagster_event.event_specific_data
        for run in runs
        for record in flow.instance.all_logs(
            run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION
        )
    ]
    assert sorted(e.check_name for e in evaluations) == sorted(["rows_balanced", "error_rate"] * 2)
    assert all(e.passed for e in evaluations)


@pytest.mark.engine
def test_downstream_stats_are_requested_once_upstream_partitions_updated(flow):
    after = dg.evaluate_automation_conditions(
        defs=flow.defs, instance=flow.instance, cursor=flow.automation_cursor
    )
    requested = after.get_requested_partitions(STATS)
    assert requested == set(flow.partition_keys)
    assert not after.get_requested_partitions(VECTORS)  # the upstream is not re-requested

    stats_asset = flow.defs.resolve_assets_def(STATS)
    for key in sorted(requested):  # as the automation daemon's runs would
        result = dg.materialize([stats_asset], partition_key=key, instance=flow.instance)
        metadata = result.asset_materializations_for_node(stats_asset.op.name)[0].metadata
        expected = len(SMALL_FILES[key]) if key.startswith("doc-") else None
        if expected is not None:
            assert metadata["rows"].value == expected
        assert metadata["distinct_ids"].value == metadata["rows"].value
        assert abs(metadata["mean_norm"].value - 1.0) < 1e-3  # MiniLM embeddings are normalized

    settled = dg.evaluate_automation_conditions(
        defs=flow.defs, instance=flow.instance, cursor=after.cursor
    )
    assert settled.total_requested == 0
