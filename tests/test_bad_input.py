"""A bad shard or spec fails fast, before any model loads for it, with a message naming the
problem; it is not retried, and nothing half-written is left as committed output. A bad shard
fails its own partition only: the run's other partitions are committed and materialized."""

from __future__ import annotations

import os

import dagster as dg
import pytest
from support import (
    cpu_resource,
    failure_message,
    materialize_partitions,
    model_loads,
    partition_metadata,
    step_attempts,
    write_parquet,
)

from dagster_gpuinfer import InputSpec, inference_assets


def pipeline(tmp_path, model, **overrides):
    kwargs = dict(
        name="emb",
        model=model,
        task="embed",
        input=InputSpec(uri=str(tmp_path / "in" / "{partition_key}.parquet")),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["s0", "s1"]),
        retry_policy=dg.RetryPolicy(max_retries=2),
    )
    kwargs.update(overrides)
    return inference_assets(**kwargs)


def committed_files(tmp_path):
    out = tmp_path / "out"
    return sorted(
        os.path.relpath(os.path.join(d, f), out) for d, _, files in os.walk(out) for f in files
    )


def run_failing(tmp_path, instance, model, keys=("s0", "s1"), **overrides):
    load_log = tmp_path / "loads.log"
    result = materialize_partitions(
        pipeline(tmp_path, model, **overrides),
        list(keys),
        resource=cpu_resource(load_log),
        instance=instance,
        raise_on_error=False,
    )
    assert not result.success
    assert step_attempts(result) == 1, "a user error must not be retried"
    assert not load_log.exists(), "no model may load before the inputs are checked"
    assert committed_files(tmp_path) == []
    return failure_message(result)


def test_missing_text_column_fails_naming_the_column(tmp_path, instance, minilm_dir):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "body": ["no text column"]})
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a"], "body": ["no text column"]})
    message = run_failing(tmp_path, instance, minilm_dir)
    assert "s1.parquet has no column 'text'" in message
    assert "input.text_column" in message and "Not retried" in message


def test_missing_input_file_fails_naming_the_file(tmp_path, instance, minilm_dir):
    message = run_failing(tmp_path, instance, minilm_dir)
    assert "s1.parquet of partition 's1' does not exist" in message
    assert "s0.parquet of partition 's0' does not exist" in message


@pytest.mark.engine
def test_a_bad_shard_fails_its_own_partition_and_the_run_commits_the_others(
    tmp_path, instance, minilm_dir
):
    """One run of three partitions (as a backfill's multi-partition run): the middle shard
    lacks its text column. The other two are embedded, committed and materialized; the step
    fails naming the bad one and is not retried; a re-run of the failed partition alone,
    once its file is fixed, completes the asset without redoing the others."""
    keys = ["s0", "s1", "s2"]
    for key in ("s0", "s2"):
        write_parquet(tmp_path / "in" / f"{key}.parquet", {"id": ["a", "b"], "text": ["x", "y"]})
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a"], "body": ["no text column"]})
    load_log = tmp_path / "loads.log"
    pipe = pipeline(tmp_path, minilm_dir, partitions_def=dg.StaticPartitionsDefinition(keys))
    result = materialize_partitions(
        pipe, keys, resource=cpu_resource(load_log), instance=instance, raise_on_error=False
    )
    assert not result.success and step_attempts(result) == 1
    message = failure_message(result)
    assert "1 of 3 partitions could not be processed" in message
    assert "partition 's1': bad_shard:" in message and "has no column 'text'" in message
    assert model_loads(load_log) == 1
    key = pipe.output_asset.key
    assert instance.get_materialized_partitions(key) == {"s0", "s2"}
    for done in ("s0", "s2"):
        assert partition_metadata(instance, key, done)["rows_out"] == 2
    assert sorted(p.name for p in (tmp_path / "out").rglob("_SUCCESS")) == ["_SUCCESS"] * 2
    assert not any("s1" in str(p) for p in (tmp_path / "out").rglob("_SUCCESS"))

    # The user fixes the shard and re-runs the failed partition only.
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a"], "text": ["fixed"]})
    again = materialize_partitions(pipe, ["s1"], resource=cpu_resource(load_log), instance=instance)
    assert again.success
    assert instance.get_materialized_partitions(key) == {"s0", "s1", "s2"}
    assert model_loads(load_log) == 2


def test_missing_model_directory_fails_naming_the_path(tmp_path, instance):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "text": ["fine"]})
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a"], "text": ["fine"]})
    missing = str(tmp_path / "models" / "nope")
    message = run_failing(tmp_path, instance, missing)
    assert f"model directory {missing!r} does not exist" in message


def test_model_directory_without_config_fails_naming_the_path(tmp_path, instance):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "text": ["fine"]})
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a"], "text": ["fine"]})
    (tmp_path / "models" / "empty").mkdir(parents=True)
    message = run_failing(tmp_path, instance, str(tmp_path / "models" / "empty"))
    assert "has no config.json" in message


def test_invalid_run_config_fails_in_the_control_plane_naming_the_field(
    tmp_path, instance, minilm_dir
):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "text": ["fine"]})
    result = materialize_partitions(
        pipeline(tmp_path, minilm_dir),
        ["s0", "s0"],
        resource=cpu_resource(),
        instance=instance,
        raise_on_error=False,
        run_config={"ops": {"emb": {"config": {"chunk_size": 0}}}},
    )
    assert not result.success and step_attempts(result) == 1
    assert "chunk_size: Input should be greater than or equal to 1" in failure_message(result)
    assert committed_files(tmp_path) == []


def test_unknown_task_never_reaches_a_worker():
    import re

    from dagster_gpuinfer.task_table import TASKS

    names = [f"'{name}'" for name in TASKS]  # every task in the table, in its order
    expected = re.escape(f"task: Input should be {', '.join(names[:-1])} or {names[-1]}")
    expected += re.escape(" (got 'summarize')")
    with pytest.raises(ValueError, match=expected):
        inference_assets(
            name="x",
            model="/m",
            task="summarize",  # type: ignore[arg-type]
            input={"uri": "/d/{partition_key}.parquet"},
            output_root="/o",
            partitions_def=dg.StaticPartitionsDefinition(["a"]),
        )


def test_worker_command_line_reports_a_bad_shard_as_a_failed_partition(tmp_path):
    """`python -m dagster_gpuinfer.worker --spec FILE` runs a spec by hand, outside Dagster."""
    import json
    import subprocess
    import sys

    spec = {
        "model": str(tmp_path),  # exists; the missing shard is found first
        "task": "embed",
        "input": {"uri": str(tmp_path / "{partition_key}.parquet")},
        "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
        "partition_keys": ["missing"],
    }
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "dagster_gpuinfer.worker", "--spec", str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    messages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed, summary = messages
    assert failed["type"] == "partition_failed" and failed["partition_key"] == "missing"
    assert failed["error_type"] == "bad_shard"
    assert "missing.parquet of partition 'missing' does not exist" in failed["message"]
    # No shard could run, so no model was loaded (the model directory here is no model).
    assert summary["type"] == "run"
    assert summary["partitions_failed"] == 1 and summary["model_loads"] == 0
