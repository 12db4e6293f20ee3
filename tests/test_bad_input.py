"""A bad shard or spec fails fast, before any model loads, with a message naming the problem;
it is not retried, and nothing half-written is left as committed output."""

from __future__ import annotations

import os

import dagster as dg
import pytest
from support import cpu_resource, failure_message, materialize_partitions, step_attempts, write_parquet

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
        pipeline(tmp_path, model, **overrides), list(keys),
        resource=cpu_resource(load_log), instance=instance, raise_on_error=False,
    )
    assert not result.success
    assert step_attempts(result) == 1, "a user error must not be retried"
    assert not load_log.exists(), "no model may load before the inputs are checked"
    assert committed_files(tmp_path) == []
    return failure_message(result)


def test_missing_text_column_fails_naming_the_column(tmp_path, instance, minilm_dir):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "text": ["fine"]})
    write_parquet(tmp_path / "in" / "s1.parquet", {"id": ["a"], "body": ["no text column"]})
    message = run_failing(tmp_path, instance, minilm_dir)
    assert "s1.parquet has no column 'text'" in message
    assert "input.text_column" in message and "Not retried" in message


def test_missing_input_file_fails_naming_the_file(tmp_path, instance, minilm_dir):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "text": ["fine"]})
    message = run_failing(tmp_path, instance, minilm_dir)
    assert "s1.parquet of partition 's1' does not exist" in message


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


def test_invalid_run_config_fails_in_the_control_plane_naming_the_field(tmp_path, instance, minilm_dir):
    write_parquet(tmp_path / "in" / "s0.parquet", {"id": ["a"], "text": ["fine"]})
    result = materialize_partitions(
        pipeline(tmp_path, minilm_dir), ["s0", "s0"], resource=cpu_resource(), instance=instance,
        raise_on_error=False, run_config={"ops": {"emb": {"config": {"chunk_size": 0}}}},
    )
    assert not result.success and step_attempts(result) == 1
    assert "chunk_size: Input should be greater than or equal to 1" in failure_message(result)
    assert committed_files(tmp_path) == []


def test_unknown_task_never_reaches_a_worker():
    with pytest.raises(ValueError, match=r"task: Input should be 'embed', 'generate' or 'chat'"):
        inference_assets(
            name="x", model="/m", task="summarize",  # type: ignore[arg-type]
            input={"uri": "/d/{partition_key}.parquet"}, output_root="/o",
            partitions_def=dg.StaticPartitionsDefinition(["a"]),
        )
