"""The backfill estimate: input sizes from real Parquet footers and JSONL files, speeds from
committed manifests, the formula, the sensor's observation in a Dagster instance and the
command line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster as dg
import pytest
from support import commit_by_hand, write_jsonl, write_parquet

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.estimate import (
    DEFAULT_BYTES_PER_SECOND,
    DEFAULT_MODEL_LOAD_SECONDS,
    DEFAULT_RUN_START_SECONDS,
    backfill_estimate_sensor,
    estimate_asset,
    estimate_backfill,
    input_work,
    makespan,
)
from dagster_gpuinfer.spec import InferenceSpec

ROWS = {"s0": 100, "s1": 300, "s2": 200, "s3": 400, "s4": 50, "s5": 250}


def parquet_pipeline(root: Path, *, per_run: int = 2, pool: str | None = None):
    for key, rows in ROWS.items():
        write_parquet(
            root / "in" / f"{key}.parquet",
            {"id": [f"{key}-{i}" for i in range(rows)], "text": ["x"] * rows},
            row_group_size=64,
        )
    return inference_assets(
        name="docs",
        model=str(root / "model"),
        task="embed",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(list(ROWS)),
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=per_run),
        tensor_parallel_size=2,
        pool=pool,
    )


def commit(spec: InferenceSpec, key: str, *, rows: int, wall_seconds: float, load: float) -> None:
    """A committed partition as the worker leaves it (rows counted, no part files)."""
    Path(spec.model).mkdir(parents=True, exist_ok=True)
    commit_by_hand(
        spec,
        key,
        rows_in=rows,
        rows_out=rows,
        wall_seconds=wall_seconds,
        model_load_seconds=load,
    )


def spec_of(pipeline) -> InferenceSpec:
    return InferenceSpec.model_validate({**pipeline.spec, "partition_keys": list(ROWS)})


def test_parquet_work_comes_from_footers_and_row_ranges(tmp_path):
    pipeline = parquet_pipeline(tmp_path)
    spec = spec_of(pipeline)
    work = input_work(spec, ["s1", "s3@rows=100-250", "s3@rows=350-500", "gone"])
    assert work == {"s1": 300.0, "s3@rows=100-250": 150.0, "s3@rows=350-500": 50.0, "gone": None}


def test_jsonl_work_is_bytes_and_row_ranges_share_the_file(tmp_path):
    path = write_jsonl(
        tmp_path / "in" / "big.jsonl", [{"id": i, "text": "y" * 50} for i in range(100)]
    )
    size = path.stat().st_size
    spec = InferenceSpec.model_validate(
        {
            "model": "m",
            "task": "embed",
            "input": {"uri": str(tmp_path / "in" / "{partition_key}.jsonl")},
            "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
            "partition_keys": ["big@rows=0-60", "big@rows=60-100", "big@bytes=0-1000"],
        }
    )
    work = input_work(spec, spec.partition_keys)
    assert work["big@rows=0-60"] == pytest.approx(size * 0.6)
    assert work["big@rows=60-100"] == pytest.approx(size * 0.4)
    assert work["big@bytes=0-1000"] == 1000.0
    estimate = estimate_backfill(spec, spec.partition_keys, asset="a", partitions_per_run=None)
    assert estimate.work_unit == "bytes"
    assert estimate.speed_source.startswith("default")
    assert estimate.speed_per_pod_second == DEFAULT_BYTES_PER_SECOND
    assert estimate.model_load_seconds == DEFAULT_MODEL_LOAD_SECONDS


def test_estimate_uses_the_speed_and_load_measured_on_committed_partitions(tmp_path):
    pipeline = parquet_pipeline(tmp_path, per_run=2)
    spec = spec_of(pipeline)
    # 100 + 300 rows in 10 + 30 s: 10 rows per pod-second; loads 50 s and 70 s
    commit(spec, "s0", rows=100, wall_seconds=10.0, load=50.0)
    commit(spec, "s1", rows=300, wall_seconds=30.0, load=70.0)
    estimate = estimate_backfill(spec, list(ROWS), asset="docs", partitions_per_run=2, pool_slots=1)
    assert (estimate.partitions_committed, estimate.partitions_pending) == (2, 4)
    assert estimate.pending_work == 200 + 400 + 50 + 250
    assert estimate.speed_per_pod_second == pytest.approx(10.0)
    assert estimate.model_load_seconds == 60.0
    overhead = DEFAULT_RUN_START_SECONDS + 60.0
    # runs: [s2, s3] = 60 s of work, [s4, s5] = 30 s
    assert estimate.run_seconds == pytest.approx([overhead + 60.0, overhead + 30.0])
    assert estimate.gpu_hours == pytest.approx((2 * overhead + 90.0) * 2 / 3600)  # TP=2
    assert estimate.wall_seconds == pytest.approx(2 * overhead + 90.0)
    two_pods = estimate_backfill(spec, list(ROWS), asset="docs", partitions_per_run=2, pool_slots=2)
    assert two_pods.wall_seconds == pytest.approx(overhead + 60.0)
    assert two_pods.gpu_hours == pytest.approx(estimate.gpu_hours)
    assert "4 of 6 partitions pending" in estimate.summary()


def test_partitions_that_will_copy_rows_are_counted_in_full_and_named(tmp_path):
    pipeline = parquet_pipeline(tmp_path, per_run=2)
    spec = spec_of(pipeline)
    commit(spec, "s0", rows=100, wall_seconds=10.0, load=50.0)
    commit(spec, "s1", rows=300, wall_seconds=30.0, load=70.0)
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a", "b"], "text": ["x", "y"]})
    estimate = estimate_backfill(spec, list(ROWS), asset="docs", partitions_per_run=2)
    assert (estimate.partitions_pending, estimate.partitions_reusable) == (5, 1)
    assert estimate.pending_work == 2 + 200 + 400 + 50 + 250  # s1's new rows, all counted
    assert "1 of them have an earlier output" in estimate.summary()
    assert estimate.metadata()["estimate_partitions_reusable"] == 1
    # A partition that copied rows is left out of the speed: its time covers part of it.
    commit_by_hand(spec, "s2", rows_in=200, rows_out=200, rows_reused=190, wall_seconds=1.0)
    again = estimate_backfill(spec, list(ROWS), asset="docs", partitions_per_run=2)
    assert again.speed_per_pod_second == pytest.approx(10.0)
    off = InferenceSpec.model_validate({**spec.model_dump(), "row_reuse": "off"})
    assert (
        estimate_backfill(off, list(ROWS), asset="docs", partitions_per_run=2).partitions_reusable
        == 0
    )


def test_makespan_spreads_runs_in_order_over_the_slot_free_first():
    assert makespan([5, 4, 3, 3, 3], 2) == 10  # 5+3 | 4+3+3
    assert makespan([5, 4, 3], 10) == 5
    assert makespan([], 3) == 0


def test_sensor_records_the_estimate_on_the_output_asset(tmp_path):
    pipeline = parquet_pipeline(tmp_path, per_run=3, pool="gpu")
    spec = spec_of(pipeline)
    commit(spec, "s0", rows=100, wall_seconds=20.0, load=30.0)
    sensor = backfill_estimate_sensor(pipeline)
    resource = GpuInferenceResource()
    with dg.instance_for_test() as instance:
        instance.event_log_storage.set_concurrency_slots("gpu", 2)
        context = dg.build_sensor_context(instance=instance, resources={"gpu": resource})
        result = sensor(context)
        observations = result.asset_events
        assert len(observations) == 1
        metadata = {k: v.value for k, v in observations[0].metadata.items()}
        assert observations[0].asset_key == pipeline.output_asset.key
        assert metadata["estimate_pending_partitions"] == 5
        assert metadata["estimate_rows_per_pod_second"] == 5.0
        assert metadata["estimate_pool_slots"] == 2  # the instance's limit of pool "gpu"
        assert metadata["estimate_runs"] == 2
        # unchanged: no new observation
        again = sensor(
            dg.build_sensor_context(
                instance=instance, resources={"gpu": resource}, cursor=result.cursor
            )
        )
        assert not again.asset_events
        estimate = estimate_asset(pipeline.output_asset, resource=resource, instance=instance)
        assert metadata["estimate_gpu_hours"] == round(estimate.gpu_hours, 3)


def test_command_line_prints_the_estimate_of_a_code_locations_asset(tmp_path):
    root = tmp_path / "data"
    parquet_pipeline(root)  # writes the inputs
    (tmp_path / "my_location.py").write_text(
        textwrap.dedent(f"""
        import dagster as dg
        from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets

        pipeline = inference_assets(
            name="docs", model={str(root / "model")!r}, task="embed",
            input=InputSpec(uri={str(root / "in" / "{partition_key}.parquet")!r}),
            output_root={str(root / "out")!r},
            partitions_def=dg.StaticPartitionsDefinition({list(ROWS)!r}),
            backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=2),
        )
        defs = dg.Definitions(assets=pipeline.assets, resources={{"gpu": GpuInferenceResource()}})
    """)
    )
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dagster_gpuinfer.estimate",
            "docs",
            "-m",
            "my_location",
            "--pool-slots",
            "3",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "docs: 6 of 6 partitions pending, 1,300 rows" in done.stdout
    assert "3 pod(s) at a time" in done.stdout
    assert "default: nothing committed yet" in done.stdout
