"""The Delta Lake sink: each committed partition overwritten whole, in one Delta commit, on
local disk and on the loopback S3; read back with polars and delta-rs.

No engine runs: partitions are committed by hand as a worker leaves them (part files and
`_SUCCESS`), so a Dagster run reuses them without starting a worker and goes straight to
the sink, as it does after a worker reports its commits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from support import (
    commit_by_hand,
    commit_rows,
    embed_pipeline,
    embedding_rows,
    failure_message,
    materialize_partitions,
    partition_metadata,
    write_text_shard,
)

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec
from dagster_gpuinfer.resource import InvalidInferenceSpec
from dagster_gpuinfer.sinks import DeltaSink
from dagster_gpuinfer.sinks.materialize import write_delta_partitions
from dagster_gpuinfer.sinks.pgvector_write import SinkError
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage.delta import open_table, storage_options

KEYS = ["p0", "p1"]
DIM = 8


@pytest.fixture
def root(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path


def _pipeline(root: Path, sink: DeltaSink, keys=KEYS, **changes):
    return embed_pipeline(root, keys, sink=sink, **changes)


def _embeddings(key: str, rows: int, *, seed: int = 0) -> pa.Table:
    return embedding_rows(key, rows, DIM, seed=seed)


def _read(uri: str, storage: StorageOptions | None = None) -> pl.DataFrame:
    return pl.read_delta(uri, storage_options=storage_options(uri, storage))


def _rows_of(frame: pl.DataFrame, key: str) -> dict[str, list[float]]:
    part = frame.filter(pl.col("partition_key") == key)
    return dict(zip(part["id"].to_list(), part["embedding"].to_list(), strict=True))


def _as_dict(*tables: pa.Table) -> dict[str, list[float]]:
    table = pa.concat_tables(tables)
    return dict(zip(table["id"].to_pylist(), table["embedding"].to_pylist(), strict=True))


def test_a_materialization_writes_exactly_the_committed_rows(root, instance):
    uri = str(root / "lake" / "emb")
    pipeline = _pipeline(root, DeltaSink(uri=uri))
    parts = {}
    for key in KEYS:
        write_text_shard(root, key, 7)
        parts[key] = (_embeddings(key, 4), _embeddings(key, 7).slice(4))
        commit_rows(pipeline, key, *parts[key])

    result = materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance
    )

    assert result.success
    frame = _read(uri)
    for key in KEYS:
        assert _rows_of(frame, key) == _as_dict(*parts[key])  # float32 values, bit for bit
        metadata = partition_metadata(instance, pipeline.output_asset.key, key)
        assert metadata["sink_rows"] == 7
        assert metadata["sink"] == f"delta:{uri}"
    spec_hash = InferenceSpec.model_validate(pipeline.spec).spec_hash()
    assert frame["spec_hash"].unique().to_list() == [spec_hash]
    assert frame["input_version"].null_count() == 0
    assert open_table(uri, None).metadata().partition_columns == ["partition_key"]


def test_a_failure_after_a_commit_and_the_retry_leave_each_row_once(root, instance):
    """p0 is committed to the table, then p1 fails (its part file is gone); once p1 is
    committed again, the retried run writes both: every row once, p0 not doubled."""
    uri = str(root / "lake" / "emb")
    pipeline = _pipeline(root, DeltaSink(uri=uri))
    for key in KEYS:
        write_text_shard(root, key, 5)
    commit_rows(pipeline, "p0", _embeddings("p0", 5))
    broken = commit_rows(pipeline, "p1", _embeddings("p1", 5))
    (root / "out" / "emb" / "p1" / broken.parts[0].name).unlink()

    failed = materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance, raise_on_error=False
    )

    assert not failed.success
    assert "is missing" in failure_message(failed)
    after_failure = _read(uri)
    assert sorted(after_failure["id"].to_list()) == [f"p0-{i}" for i in range(5)]

    time.sleep(0.01)
    write_text_shard(root, "p1", 5)  # recomputed from a rewritten shard, as a retry would
    p1 = _embeddings("p1", 5, seed=1)
    commit_rows(pipeline, "p1", p1)
    retried = materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance
    )

    assert retried.success
    frame = _read(uri)
    assert frame.height == 10 and frame.select(["partition_key", "id"]).is_unique().all()
    assert _rows_of(frame, "p1") == _as_dict(p1)
    assert _rows_of(frame, "p0") == _rows_of(after_failure, "p0")


def test_a_rematerialization_replaces_the_partition_without_leftovers(root, instance):
    uri = str(root / "lake" / "emb")
    pipeline = _pipeline(root, DeltaSink(uri=uri))
    for key in KEYS:
        write_text_shard(root, key, 6)
        commit_rows(pipeline, key, _embeddings(key, 6))
    assert materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance
    ).success

    time.sleep(0.01)  # a new mtime for the rewritten shard
    write_text_shard(root, "p0", 3)  # the shard shrank: rows p0-3..p0-5 are gone
    fresh = _embeddings("p0", 3, seed=1)
    commit_rows(pipeline, "p0", fresh)
    assert materialize_partitions(
        pipeline, ["p0"], resource=GpuInferenceResource(), instance=instance
    ).success

    frame = _read(uri)
    assert _rows_of(frame, "p0") == _as_dict(fresh)
    assert len(_rows_of(frame, "p1")) == 6
    assert frame.height == 9


def test_an_older_commit_never_replaces_a_newer_one(root):
    uri = str(root / "lake" / "emb")
    sink = DeltaSink(uri=uri)
    pipeline = _pipeline(root, sink)
    spec = InferenceSpec.model_validate(pipeline.spec)
    write_text_shard(root, "p0", 3)
    older = commit_rows(pipeline, "p0", _embeddings("p0", 3))
    time.sleep(0.01)
    write_text_shard(root, "p0", 2)
    newer = commit_rows(pipeline, "p0", _embeddings("p0", 2, seed=5))
    assert write_delta_partitions(sink, spec, {"p0": newer})["p0"].rows == 2

    late = write_delta_partitions(sink, spec, {"p0": older})["p0"]

    assert late.superseded and late.rows == 2
    assert len(_rows_of(_read(uri), "p0")) == 2


def test_rows_that_disagree_with_the_manifest_commit_nothing(root):
    uri = str(root / "lake" / "emb")
    sink = DeltaSink(uri=uri)
    pipeline = _pipeline(root, sink)
    spec = InferenceSpec.model_validate(pipeline.spec)
    write_text_shard(root, "p0", 4)
    manifest = commit_rows(pipeline, "p0", _embeddings("p0", 4))
    write_delta_partitions(sink, spec, {"p0": manifest})
    version = open_table(uri, None).version()

    lying = manifest.model_copy(update={"rows_out": 5, "committed_at": time.time()})
    with pytest.raises(SinkError, match="rows_out=5") as failed:
        write_delta_partitions(sink, spec, {"p0": lying})

    assert not failed.value.retryable
    assert open_table(uri, None).version() == version
    assert len(_rows_of(_read(uri), "p0")) == 4


def test_two_concurrent_writers_of_one_partition_end_with_one_copy(root):
    from deltalake.exceptions import CommitFailedError

    from dagster_gpuinfer.sinks.delta import overwrite_partition
    from dagster_gpuinfer.sinks.materialize import _retryable_delta_error
    from dagster_gpuinfer.sinks.pgvector import sink_layout

    uri = str(root / "lake" / "emb")
    sink = DeltaSink(uri=uri)
    pipeline = _pipeline(root, sink)
    write_text_shard(root, "p0", 60)
    manifest = commit_rows(pipeline, "p0", _embeddings("p0", 60))
    start = threading.Barrier(2)
    outcomes: list[object] = []

    def slow():
        for batch in _embeddings("p0", 60).to_batches(max_chunksize=10):
            time.sleep(0.03)  # the two writes overlap
            yield batch

    def writer():
        start.wait()
        try:
            outcomes.append(overwrite_partition(sink, None, sink_layout("embed"), manifest, slow()))
        except Exception as exc:  # noqa: BLE001 - the test reports it below
            outcomes.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    written = [o for o in outcomes if not isinstance(o, Exception)]
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert written == [(60, False)]
    # delta-rs refuses the later commit; its message names the conflict it saw, which
    # depends on the interleaving ("concurrent ..." or "Metadata changed since last commit"
    # when the other writer's commit created the table), so the test holds the type.
    assert len(failed) == 1 and isinstance(failed[0], CommitFailedError), failed
    assert _retryable_delta_error(failed[0])  # the step fails retryably and writes it again
    frame = _read(uri)
    assert frame.height == 60 and frame["id"].n_unique() == 60


def test_generated_text_goes_to_a_text_column(root):
    uri = str(root / "lake" / "gen")
    sink = DeltaSink(uri=uri)
    pipeline = _pipeline(root, sink, task="generate")
    spec = InferenceSpec.model_validate(pipeline.spec)
    write_text_shard(root, "p0", 2)
    outputs = pa.table({"id": ["p0-0", "p0-1"], "text": ['it\'s "quoted"', "line\nbreak"]})
    manifest = commit_by_hand(spec, "p0", parts=[outputs])

    write_delta_partitions(sink, spec, {"p0": manifest})

    frame = _read(uri).sort("id")
    assert frame["text"].to_list() == ['it\'s "quoted"', "line\nbreak"]


def test_the_table_on_the_loopback_s3_is_replaced_whole(root, s3_server, instance):
    bucket = s3_server.new_bucket("lake")
    storage = StorageOptions(
        endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
    )
    uri = f"s3://{bucket}/tables/emb"
    pipeline = _pipeline(root, DeltaSink(uri=uri, storage=storage))
    for key in KEYS:
        write_text_shard(root, key, 5)
        commit_rows(pipeline, key, _embeddings(key, 5))
    assert materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance
    ).success

    time.sleep(0.01)
    write_text_shard(root, "p1", 3)
    fresh = _embeddings("p1", 3, seed=2)
    commit_rows(pipeline, "p1", fresh)
    assert materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance
    ).success

    frame = _read(uri, storage)
    assert _rows_of(frame, "p1") == _as_dict(fresh)
    assert len(_rows_of(frame, "p0")) == 5 and frame.height == 8
    log = [k for k in s3_server.keys(bucket, "tables/emb/_delta_log/") if k.endswith(".json")]
    assert len(log) == 5  # the table's creation, then one commit a partition a run (2 x 2)


# The writer the kill test runs in its own process: every partition of a committed pipeline
# sent to the Delta table, one commit each; the test kills it with SIGKILL mid-way.
WRITER = textwrap.dedent(
    """
    import json, sys
    from dagster_gpuinfer.sinks import DeltaSink
    from dagster_gpuinfer.sinks.materialize import write_delta_partitions
    from dagster_gpuinfer.spec import InferenceSpec
    from dagster_gpuinfer.storage import Manifest

    spec = InferenceSpec.model_validate_json(open(sys.argv[1]).read())
    manifests = [Manifest.model_validate(m) for m in json.load(open(sys.argv[2]))]
    sink = DeltaSink(uri=sys.argv[3], batch_rows=2000)
    write_delta_partitions(sink, spec, {m.partition_key: m for m in manifests})
    """
)


def _watch_partitions(uri: str, stop: threading.Event, seen: list[dict[str, int]]) -> None:
    """Read the table with polars until `stop`: each read's rows per partition."""
    while not stop.is_set():
        try:
            frame = _read(uri)
        except Exception:  # noqa: BLE001 - the table does not exist yet
            time.sleep(0.01)
            continue
        counts = frame.group_by("partition_key").len()
        seen.append(dict(zip(counts["partition_key"], counts["len"], strict=True)))


def test_a_writer_killed_mid_way_and_rerun_leaves_every_partition_whole_and_once(root):
    keys = [f"k{i}" for i in range(6)]
    rows = 30_000
    uri = str(root / "lake" / "emb")
    pipeline = _pipeline(root, DeltaSink(uri=uri), keys=keys)
    spec = InferenceSpec.model_validate(pipeline.spec)
    manifests = []
    for key in keys:
        write_text_shard(root, key, rows)
        table = _embeddings(key, rows)
        manifests.append(
            commit_rows(pipeline, key, table.slice(0, rows // 2), table.slice(rows // 2))
        )
    (root / "spec.json").write_text(spec.model_dump_json())
    (root / "manifests.json").write_text(
        "[" + ",".join(m.model_dump_json() for m in manifests) + "]"
    )
    argv = [sys.executable, "-c", WRITER, str(root / "spec.json"), str(root / "manifests.json")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch_partitions, args=(uri, stop, seen))
    watcher.start()
    try:
        writer = subprocess.Popen([*argv, uri], env=env)
        log = root / "lake" / "emb" / "_delta_log"
        deadline = time.monotonic() + 120
        # Version 0 creates the table; 1, 2, 3 are the first three partitions.
        while not (log / f"{3:020d}.json").exists() and writer.poll() is None:
            assert time.monotonic() < deadline, "the writer wrote no third partition in 120 s"
            time.sleep(0.005)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        killed_at = _read(uri).group_by("partition_key").len()
        subprocess.run([*argv, uri], env=env, check=True, timeout=300)
    finally:
        stop.set()
        watcher.join()

    assert writer.returncode == -signal.SIGKILL  # it was killed, not finished
    assert 3 <= killed_at.height < len(keys)  # some partitions written, not all
    assert seen and all(count == rows for read in seen for count in read.values())
    frame = _read(uri)
    assert frame.height == rows * len(keys)
    assert frame.select(["partition_key", "id"]).is_unique().all()
    for key, table in zip(keys, (_embeddings(key, rows) for key in keys), strict=True):
        assert _rows_of(frame, key) == _as_dict(table)


def test_the_pipeline_refuses_a_sink_its_outputs_cannot_feed(root):
    with pytest.raises(InvalidInferenceSpec, match="sink: a sink takes embeddings"):
        _pipeline(root, DeltaSink(uri=str(root / "lake")), task="score")
    with pytest.raises(InvalidInferenceSpec, match="not a table root"):
        _pipeline(root, {"kind": "delta", "uri": str(root / "lake" / "{partition_key}")})


def test_a_yaml_pipeline_sets_the_delta_sink_as_configuration(root):
    from dagster_gpuinfer.components.inference_pipeline import InferencePipelineComponent

    component = InferencePipelineComponent.resolve_from_yaml(
        f"""
name: emb
model: {root / "model"}
task: embed
input: {{uri: "{root / "in"}/{{partition_key}}.parquet"}}
output_root: {root / "out"}
partitioning: {{type: static, keys: [p0]}}
sink: {{kind: delta, uri: "{root / "lake" / "emb"}"}}
"""
    )
    pipeline = component.build_pipeline()
    asset = pipeline.output_asset
    shown = asset.specs_by_key[asset.key].metadata["gpuinfer/sink"].value
    assert shown["kind"] == "delta" and shown["uri"] == str(root / "lake" / "emb")


def test_neither_side_loads_deltalake_until_a_table_is_opened():
    code = (
        "import sys\nimport dagster_gpuinfer.asset_factory, dagster_gpuinfer.sinks\n"
        "import dagster_gpuinfer.worker.rows.readers, dagster_gpuinfer.estimate\n"
        "from dagster_gpuinfer import DeltaSink\n"
        "print('deltalake' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"
