"""The arrival sensor: new files become dynamic partitions, once each, page by page, and
large files split into row or byte ranges that the worker's readers cover exactly."""

from __future__ import annotations

import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster._core.execution.backfill import BulkActionsFilter

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec, InputSpec, inference_assets
from dagster_gpuinfer.arrivals import (
    SplitLargeFiles,
    WatchedFiles,
    byte_ranges,
    row_group_ranges,
)
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.rows.readers import ShardReader

_names = itertools.count()


def make_pipeline(uri: str, partitions_name: str | None = None):
    """An embedding pipeline over `uri`; each test gets its own dynamic partitions (the
    instance is shared by the module) unless it names them."""
    return inference_assets(
        name="arrived_embeddings",
        model="/models/never-loaded",
        task="embed",
        input=InputSpec(uri=uri, id_column="id"),
        output_root="/tmp/unused-output",
        partitions_def=dg.DynamicPartitionsDefinition(
            name=partitions_name or f"arrived_files_{next(_names)}"
        ),
    )


def write_jsonl(path: Path, ids: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "text": f"text of {i}"}) + "\n" for i in ids))


class SensorDriver:
    """Evaluates a sensor and applies its partition requests as the sensor daemon does."""

    def __init__(self, pipeline, instance: dg.DagsterInstance, gpu=None, **sensor_kwargs):
        self.sensor = arrival_sensor(pipeline, **sensor_kwargs)
        self.partitions_name = pipeline.output_asset.partitions_def.name
        self.instance = instance
        self.gpu = gpu or GpuInferenceResource()
        self.cursor: str | None = None
        self.logged: list[str] = []

    def tick(self) -> dg.SensorResult:
        context = dg.build_sensor_context(
            instance=self.instance, cursor=self.cursor, resources={"gpu": self.gpu}
        )
        result = self.sensor(context)
        assert isinstance(result, dg.SensorResult)
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(
                request.partitions_def_name, request.partition_keys
            )
        self.cursor = result.cursor
        return result

    def registered(self) -> list[str]:
        return list(self.instance.get_dynamic_partitions(self.partitions_name))


def added_keys(result: dg.SensorResult) -> list[str]:
    return [k for r in result.dynamic_partitions_requests or [] for k in r.partition_keys]


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


# --------------------------------------------------------------------------- file keys


def test_file_names_map_to_partition_keys_by_template_suffix_and_glob():
    watched = WatchedFiles("s3://bkt/in/{partition_key}.jsonl", glob="2026-*")
    assert watched.prefix == "s3://bkt/in/"
    assert watched.file_key("2026-11-29.jsonl") == "2026-11-29"
    assert watched.file_key("2026-11/part-1.jsonl") == "2026-11/part-1"
    assert watched.file_key("2025-01-01.jsonl") is None  # glob
    assert watched.file_key("2026-11-29.parquet") is None  # suffix
    assert watched.file_key("2026-11/_SUCCESS.jsonl") is None  # marker names
    assert watched.file_key("2026-11/.part-1.jsonl.tmp.jsonl") is None  # temporary names
    assert watched.file_key(".jsonl") is None  # nothing left for the key


def test_a_name_prefix_in_the_template_selects_files_within_a_folder(tmp_path, instance):
    inbox = tmp_path / "inbox"
    write_jsonl(inbox / "docs-1.jsonl", ["1"])
    write_jsonl(inbox / "docs-2.jsonl", ["2"])
    write_jsonl(inbox / "other-3.jsonl", ["3"])
    driver = SensorDriver(make_pipeline(f"{inbox}/docs-{{partition_key}}.jsonl"), instance)
    assert added_keys(driver.tick()) == ["1", "2"]


def test_template_without_exactly_one_placeholder_cannot_be_watched():
    with pytest.raises(ValueError, match="exactly once"):
        WatchedFiles("s3://bkt/{partition_key}/{partition_key}.jsonl")
    with pytest.raises(ValueError, match="only the file suffix"):
        WatchedFiles("s3://bkt/{partition_key}/{model}.jsonl")


def test_sensor_refuses_a_pipeline_without_dynamic_partitions(tmp_path):
    pipeline = inference_assets(
        name="static_docs",
        model="/models/x",
        task="embed",
        input=InputSpec(uri=f"{tmp_path}/{{partition_key}}.jsonl"),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["a"]),
    )
    with pytest.raises(
        ValueError, match="DynamicPartitionsDefinition.*static_docs has StaticPartitionsDefinition"
    ):
        arrival_sensor(pipeline)


# --------------------------------------------------------------------------- ticks


def test_each_new_file_is_registered_once_and_processed_by_one_backfill(tmp_path, instance):
    inbox = tmp_path / "inbox"
    for name in ("a", "b", "sub/c"):
        write_jsonl(inbox / f"{name}.jsonl", [f"{name}-0"])
    (inbox / "notes.txt").write_text("not an input")
    pipeline = make_pipeline(f"{inbox}/{{partition_key}}.jsonl")
    driver = SensorDriver(pipeline, instance)

    first = driver.tick()
    assert added_keys(first) == ["a", "b", "sub/c"]
    [request] = first.run_requests
    subset = request.asset_graph_subset
    assert subset is not None, "launch='backfill' asks the daemon for a backfill"
    assert set(subset.get_partitions_subset(pipeline.output_asset.key).get_partition_keys()) == {
        "a",
        "b",
        "sub/c",
    }

    second = driver.tick()
    assert added_keys(second) == [] and not second.run_requests
    assert "0 new" in second.skip_reason.skip_message

    write_jsonl(inbox / "d.jsonl", ["d-0"])
    third = driver.tick()
    assert added_keys(third) == ["d"]
    assert sorted(driver.registered()) == ["a", "b", "d", "sub/c"]


def test_ticks_page_through_more_files_than_one_tick_takes(tmp_path, instance):
    inbox = tmp_path / "inbox"
    names = [f"f-{i:03d}" for i in range(25)]
    for name in names:
        write_jsonl(inbox / f"{name}.jsonl", [name])
    driver = SensorDriver(
        make_pipeline(f"{inbox}/{{partition_key}}.jsonl"), instance, max_new_files_per_tick=10
    )
    per_tick = [added_keys(driver.tick()) for _ in range(4)]
    assert [len(keys) for keys in per_tick] == [10, 10, 5, 0]
    assert [k for keys in per_tick for k in keys] == names
    assert sorted(driver.registered()) == names


def test_file_landing_behind_the_listing_position_is_found_on_the_next_pass(tmp_path, instance):
    inbox = tmp_path / "inbox"
    for name in ("b", "d", "f"):
        write_jsonl(inbox / f"{name}.jsonl", [name])
    driver = SensorDriver(
        make_pipeline(f"{inbox}/{{partition_key}}.jsonl"), instance, max_new_files_per_tick=2
    )
    assert added_keys(driver.tick()) == ["b", "d"]
    # Land during the listing: "a" sorts behind the cursor, "e" ahead of it.
    write_jsonl(inbox / "a.jsonl", ["a"])
    write_jsonl(inbox / "e.jsonl", ["e"])
    assert added_keys(driver.tick()) == ["e", "f"]
    assert added_keys(driver.tick()) == ["a"]  # the listing started over from the beginning
    assert added_keys(driver.tick()) == []
    assert sorted(driver.registered()) == ["a", "b", "d", "e", "f"]


def test_restarted_sensor_resumes_from_its_cursor_and_a_lost_cursor_adds_nothing_twice(
    tmp_path, instance
):
    inbox = tmp_path / "inbox"
    for i in range(6):
        write_jsonl(inbox / f"f{i}.jsonl", [str(i)])
    uri = f"{inbox}/{{partition_key}}.jsonl"
    name = "restart_files"
    first = SensorDriver(make_pipeline(uri, name), instance, max_new_files_per_tick=4)
    assert added_keys(first.tick()) == ["f0", "f1", "f2", "f3"]

    # A new code server process: new definitions, the cursor from the instance.
    restarted = SensorDriver(make_pipeline(uri, name), instance, max_new_files_per_tick=4)
    restarted.cursor = first.cursor
    assert json.loads(restarted.cursor)["start_after"] == "f3.jsonl"
    assert added_keys(restarted.tick()) == ["f4", "f5"]

    # A lost or unreadable cursor lists from the start again but registers nothing twice.
    reset = SensorDriver(make_pipeline(uri, name), instance)
    reset.cursor = "{not json"
    result = reset.tick()
    assert added_keys(result) == [] and not result.run_requests
    assert sorted(reset.registered()) == [f"f{i}" for i in range(6)]


def test_runs_mode_requests_one_run_per_partition_with_a_run_key(tmp_path, instance):
    inbox = tmp_path / "inbox"
    for name in ("x", "y"):
        write_jsonl(inbox / f"{name}.jsonl", [name])
    pipeline = make_pipeline(f"{inbox}/{{partition_key}}.jsonl")
    result = SensorDriver(pipeline, instance, launch="runs").tick()
    assert [(r.partition_key, r.run_key, r.asset_selection) for r in result.run_requests] == [
        ("x", "arrived_embeddings_arrivals:x", [pipeline.output_asset.key]),
        ("y", "arrived_embeddings_arrivals:y", [pipeline.output_asset.key]),
    ]


def test_files_whose_names_dagster_cannot_key_are_skipped_not_fatal(tmp_path, instance):
    inbox = tmp_path / "inbox"
    write_jsonl(inbox / "ok.jsonl", ["ok"])
    write_jsonl(inbox / "wait...what.jsonl", ["bad"])
    driver = SensorDriver(make_pipeline(f"{inbox}/{{partition_key}}.jsonl"), instance)
    assert added_keys(driver.tick()) == ["ok"]
    assert driver.registered() == ["ok"]


def test_sensor_pages_through_an_s3_prefix_on_the_loopback_server(s3_server, instance):
    bucket = s3_server.new_bucket("arrivals")
    names = [f"batch/{i:05d}" for i in range(600)]
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda n: s3_server.client.put_object(
                    Bucket=bucket, Key=f"in/{n}.jsonl", Body=b"{}\n"
                ),
                names,
            )
        )
    s3_server.client.put_object(Bucket=bucket, Key="in/batch/_SUCCESS", Body=b"")
    s3_server.client.put_object(Bucket=bucket, Key="elsewhere/z.jsonl", Body=b"{}\n")
    gpu = GpuInferenceResource(
        s3_endpoint_url=s3_server.endpoint_url, s3_region=s3_server.region, s3_allow_http=True
    )
    driver = SensorDriver(
        make_pipeline(f"s3://{bucket}/in/{{partition_key}}.jsonl"),
        instance,
        gpu,
        max_new_files_per_tick=250,
    )
    per_tick = [added_keys(driver.tick()) for _ in range(4)]
    assert [len(keys) for keys in per_tick] == [250, 250, 100, 0]
    assert sorted(driver.registered()) == names


# --------------------------------------------------------------------------- splitting


def test_range_planners_cover_the_file_without_gaps_or_overlap():
    assert byte_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert byte_ranges(8, 4) == [(0, 4), (4, 8)]
    assert row_group_ranges([100] * 10, 250) == [(0, 300), (300, 600), (600, 900), (900, 1000)]
    assert row_group_ranges([500, 10], 100) == [(0, 500), (500, 510)]


def spec_for(uri: str, storage=None, **kwargs) -> InferenceSpec:
    return InferenceSpec(
        model="/models/never-loaded",
        task="embed",
        input=InputSpec(uri=uri, id_column="id"),
        output={"root": "/tmp/unused", "asset_name": "x"},
        storage=storage or {},
        **kwargs,
    )


def read_ids(spec: InferenceSpec, key: str, chunk_size: int = 7) -> list[str]:
    reader = ShardReader(spec, key)
    reader.preflight()
    ids = []
    for chunk in reader.chunks(chunk_size):
        assert not chunk.errors, [e.message for e in chunk.errors]
        ids.extend(row_id for _, row_id, _ in chunk.rows)
    return ids


@pytest.fixture(params=["local", "s3"])
def landing(request, tmp_path):
    """Where files land: a local directory or a bucket on the loopback S3 server."""
    if request.param == "local":
        root = tmp_path / "land"
        root.mkdir()

        def put(name: str, data: bytes) -> None:
            (root / name).write_bytes(data)

        return str(root), put, None, None
    s3 = request.getfixturevalue("s3_server")
    bucket = s3.new_bucket("split")
    gpu = GpuInferenceResource(
        s3_endpoint_url=s3.endpoint_url, s3_region=s3.region, s3_allow_http=True
    )

    def put_s3(name: str, data: bytes) -> None:
        s3.client.put_object(Bucket=bucket, Key=f"land/{name}", Body=data)

    return f"s3://{bucket}/land", put_s3, gpu, gpu.storage_options()


def test_large_jsonl_file_splits_into_byte_ranges_that_read_every_line_once(landing, instance):
    root, put, gpu, storage = landing
    ids = [f"row-{i:04d}" + "x" * (i % 37) for i in range(400)]  # lines of varied length
    lines = [json.dumps({"id": i, "text": f"text {i}"}) for i in ids]
    lines.insert(100, "")  # a blank line is not a row
    data = ("\n".join(lines) + "\n").encode()
    put("big.jsonl", data)
    put("small.jsonl", b'{"id": "s-0", "text": "t"}\n')
    pipeline = make_pipeline(f"{root}/{{partition_key}}.jsonl")
    split = SplitLargeFiles(min_bytes=4096, jsonl_bytes_per_partition=3000)
    keys = added_keys(SensorDriver(pipeline, instance, gpu, split=split).tick())
    assert keys[-1] == "small"
    big_keys = keys[:-1]
    assert big_keys == [f"big@bytes={a}-{b}" for a, b in byte_ranges(len(data), 3000)]
    assert len(big_keys) > 5

    spec = spec_for(f"{root}/{{partition_key}}.jsonl", storage)
    read = [read_ids(spec, key) for key in big_keys]
    assert [i for part in read for i in part] == ids
    assert all(part for part in read)


def test_large_parquet_file_splits_into_row_group_ranges_read_exactly(landing, instance):
    root, put, gpu, storage = landing
    ids = [f"doc-{i:04d}" for i in range(1000)]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": ids, "text": [f"t{i}" for i in ids]}), sink, row_group_size=100)
    put("big.parquet", sink.getvalue().to_pybytes())
    pipeline = make_pipeline(f"{root}/{{partition_key}}.parquet")
    split = SplitLargeFiles(min_bytes=1, parquet_rows_per_partition=250)
    keys = added_keys(SensorDriver(pipeline, instance, gpu, split=split).tick())
    assert keys == ["big@rows=0-300", "big@rows=300-600", "big@rows=600-900", "big@rows=900-1000"]
    spec = spec_for(f"{root}/{{partition_key}}.parquet", storage)
    assert [len(read_ids(spec, key, chunk_size=64)) for key in keys] == [300, 300, 300, 100]
    assert [i for key in keys for i in read_ids(spec, key, chunk_size=64)] == ids
    # A range that does not follow row groups is read exactly too.
    assert read_ids(spec, "big@rows=150-420", chunk_size=64) == ids[150:420]


def test_jsonl_row_range_reads_those_lines_with_file_row_numbers(tmp_path):
    ids = [f"r{i}" for i in range(50)]
    write_jsonl(tmp_path / "f.jsonl", ids)
    spec = spec_for(f"{tmp_path}/{{partition_key}}.jsonl")
    reader = ShardReader(spec, "f@rows=10-20")
    rows = [row for chunk in reader.chunks(4) for row in chunk.rows]
    assert [row_id for _, row_id, _ in rows] == ids[10:20]
    assert [number for number, _, _ in rows] == list(range(10, 20))


def test_a_range_beyond_the_file_fails_the_shard_with_what_to_do(tmp_path):
    write_jsonl(tmp_path / "f.jsonl", ["a", "b"])
    spec = spec_for(f"{tmp_path}/{{partition_key}}.jsonl")
    size = os.path.getsize(tmp_path / "f.jsonl")
    with pytest.raises(
        ShardError, match=f"bytes up to {size + 10} but the file holds {size}.*Register"
    ):
        ShardReader(spec, f"f@bytes=0-{size + 10}").preflight()
    pq.write_table(pa.table({"id": ["a"], "text": ["t"]}), tmp_path / "g.parquet")
    spec = spec_for(f"{tmp_path}/{{partition_key}}.parquet")
    with pytest.raises(ShardError, match="rows up to 5 but the file holds 1"):
        ShardReader(spec, "g@rows=0-5").preflight()


def test_byte_ranges_of_a_parquet_file_are_refused_in_the_spec(tmp_path):
    with pytest.raises(ValueError, match="byte range of a Parquet file"):
        spec_for(f"{tmp_path}/{{partition_key}}.parquet", partition_keys=["g@bytes=0-10"])


# --------------------------------------------------------------------------- real daemon


def test_sensor_daemon_registers_partitions_and_creates_one_backfill(tmp_path, monkeypatch):
    from daemon_workspace import daemon_workspace, tick_sensors

    inbox = tmp_path / "inbox"
    for name in ("p1", "p2", "p3"):
        write_jsonl(inbox / f"{name}.jsonl", [name])
    monkeypatch.setenv("GPUINFER_TEST_INPUT_URI", f"{inbox}/{{partition_key}}.jsonl")
    monkeypatch.setenv("GPUINFER_TEST_OUTPUT_ROOT", str(tmp_path / "out"))
    with dg.instance_for_test() as test_instance, daemon_workspace(test_instance) as workspace:
        tick_sensors(workspace)
        assert sorted(test_instance.get_dynamic_partitions("doc_files")) == ["p1", "p2", "p3"]
        [backfill] = test_instance.get_backfills(filters=BulkActionsFilter())
        subset = backfill.asset_backfill_data.target_subset
        assert set(
            subset.get_partitions_subset(dg.AssetKey("doc_vectors")).get_partition_keys()
        ) == {"p1", "p2", "p3"}
        assert backfill.tags["dagster-gpuinfer/arrival_sensor"] == "doc_vectors_arrivals"


def test_local_listing_skips_hidden_and_underscore_folders_at_any_depth(tmp_path):
    """The folder check slices the path after the root (posixpath.relpath cost more than the
    rest of a 100,000-file listing): folders below the root are still checked, at any
    depth, for a folder prefix and for a name prefix alike."""
    from dagster_gpuinfer.listing import PrefixListing

    for name in [
        "in/a.jsonl",
        "in/2026/b.jsonl",
        "in/2026/_temporary/c.jsonl",
        "in/.staging/d.jsonl",
        "in/x/y/_SUCCESS_dir/e.jsonl",
        "in/x/y/f.jsonl",
        "in-other/g.jsonl",
    ]:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")
    folder = PrefixListing(f"{tmp_path}/in/")
    assert [f.name for f in folder.list_after("")] == ["2026/b.jsonl", "a.jsonl", "x/y/f.jsonl"]
    name_prefix = PrefixListing(f"{tmp_path}/in")  # the root is tmp_path: "in-other" matches
    assert [f.name for f in name_prefix.list_after("")] == [
        "-other/g.jsonl",
        "/2026/b.jsonl",
        "/a.jsonl",
        "/x/y/f.jsonl",
    ]
