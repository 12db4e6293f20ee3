"""A Delta Lake table as the input: each value of its partition column a partition, read
through the same reader (chunks, row ranges, ids) as a Parquet shard, versioned by the
partition's data files so that a new table version of a partition counts as a changed shard
and other partitions stay current. Real tables (deltalake), on disk and the loopback S3.
"""

from __future__ import annotations

import time

import dagster as dg
import deltalake
import pyarrow as pa
import pytest
from support import commit_by_hand

from dagster_gpuinfer import InferenceSpec, InputSpec, inference_assets
from dagster_gpuinfer.asset_factory import observe_shard_versions
from dagster_gpuinfer.resource import InvalidInferenceSpec
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage import committed_manifest, input_version, model_version
from dagster_gpuinfer.storage.delta import partition_values
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.rows.readers import ShardReader


def _rows(day: str, start: int, count: int, prefix: str = "t") -> pa.Table:
    return pa.table(
        {
            "day": [day] * count,
            "doc_id": [f"{day}-{i}" for i in range(start, start + count)],
            "text": [f"{prefix} {day} {i}" for i in range(start, start + count)],
        }
    )


def _append(uri: str, table: pa.Table, storage: dict | None = None) -> None:
    deltalake.write_deltalake(
        uri, table, mode="append", partition_by=["day"], storage_options=storage
    )


def _overwrite(uri: str, day: str, table: pa.Table) -> None:
    deltalake.write_deltalake(
        uri, table, mode="overwrite", predicate=f"day = '{day}'", partition_by=["day"]
    )


def _spec(uri: str, storage: StorageOptions | None = None, **input_fields) -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "embed",
            "input": {
                "uri": uri,
                "format": "delta",
                "partition_column": "day",
                "id_column": "doc_id",
                **input_fields,
            },
            "output": {"root": "out", "asset_name": "a"},  # not written by these tests
            **({"storage": storage.model_dump()} if storage else {}),
        }
    )


@pytest.fixture
def table(tmp_path) -> str:
    """Partition d1 in two data files (two appends: rows 0-4, then 5-9), d2 in one."""
    uri = str(tmp_path / "docs")
    _append(uri, pa.concat_tables([_rows("d1", 0, 5), _rows("d2", 0, 3)]))
    _append(uri, _rows("d1", 5, 5))
    return uri


def _read_all(spec: InferenceSpec, key: str, chunk_size: int) -> list:
    reader = ShardReader(spec, key)
    reader.preflight()
    return list(reader.chunks(chunk_size))


def test_a_partition_is_read_across_its_files_in_exact_chunks(table):
    chunks = _read_all(_spec(table), "d1", 3)

    assert [c.rows_in for c in chunks] == [3, 3, 3, 1]
    rows = [row for chunk in chunks for row in chunk.rows]
    assert [row[0] for row in rows] == list(range(10))
    assert sorted(row[1] for row in rows) == [f"d1-{i}" for i in range(10)]
    assert {row[2].split()[1] for row in rows} == {"d1"}  # no row of d2
    assert chunks[0].source.endswith("docs[day=d1]")


def test_row_ranges_of_a_partition_cover_it_once_across_file_boundaries(table):
    spec = _spec(table)
    whole = [row for chunk in _read_all(spec, "d1", 4) for row in chunk.rows]
    parts = [
        row
        for key in ("d1@rows=0-3", "d1@rows=3-8", "d1@rows=8-10")
        for chunk in _read_all(spec, key, 4)
        for row in chunk.rows
    ]

    assert parts == whole  # same row numbers, ids and texts, in order


def test_rows_without_an_id_column_get_partition_and_row_number(table):
    rows = [r for c in _read_all(_spec(table, id_column=None), "d2", 10) for r in c.rows]
    assert [r[1] for r in rows] == ["d2:0", "d2:1", "d2:2"]


def test_a_missing_partition_or_column_fails_fast_naming_it(table):
    with pytest.raises(ShardError, match="no partition day='d9'"):
        ShardReader(_spec(table), "d9").preflight()
    with pytest.raises(ShardError, match="no column 'body'"):
        ShardReader(_spec(table, text_column="body"), "d1").preflight()
    with pytest.raises(ShardError, match="rows up to 20"):
        ShardReader(_spec(table), "d1@rows=10-20").preflight()
    wrong = _spec(table, partition_column="doc_id")
    with pytest.raises(ShardError, match=r"partitioned by \['day'\], not 'doc_id'"):
        ShardReader(wrong, "d1").preflight()


def test_a_table_input_needs_its_root_and_partition_column():
    with pytest.raises(ValueError, match="needs input.partition_column"):
        InputSpec(uri="s3://lake/docs", format="delta")
    with pytest.raises(ValueError, match="its root, with no"):
        InputSpec(uri="s3://lake/{partition_key}", format="delta", partition_column="day")
    with pytest.raises(ValueError, match="for input.format='delta' only"):
        InputSpec(uri="d/{partition_key}.parquet", partition_column="day")


def test_a_new_table_version_changes_only_the_partitions_it_rewrote(table):
    spec = _spec(table)
    before = {key: input_version(spec, key) for key in ("d1", "d2")}

    _append(table, _rows("d3", 0, 2))  # a new table version; d1 and d2 untouched
    unchanged = {key: input_version(spec, key) for key in ("d1", "d2")}
    _overwrite(table, "d2", _rows("d2", 0, 3, prefix="new"))  # same ids, new texts
    after = {key: input_version(spec, key) for key in ("d1", "d2")}

    assert unchanged == before
    assert after["d1"] == before["d1"]
    assert after["d2"] != before["d2"]
    assert input_version(spec, "d2@rows=0-2") == after["d2"]  # a range takes its partition's
    assert partition_values(table, None, "day") == ["d1", "d2", "d3"]


def test_a_committed_partition_is_reused_until_its_table_partition_changes(table, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    pipeline = inference_assets(
        name="emb",
        model=str(tmp_path / "model"),
        task="embed",
        input=InputSpec(uri=table, format="delta", partition_column="day", id_column="doc_id"),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["d1", "d2"]),
    )
    spec = InferenceSpec.model_validate(pipeline.spec)
    for key in ("d1", "d2"):
        commit_by_hand(spec, key)
    model = model_version(spec)
    assert all(committed_manifest(spec, key, model=model) for key in ("d1", "d2"))
    observed = observe_shard_versions(spec, ["d1", "d2", "d9"])

    time.sleep(0.01)
    _overwrite(table, "d1", _rows("d1", 0, 4, prefix="new"))

    assert committed_manifest(spec, "d1", model=model) is None  # computed again
    assert committed_manifest(spec, "d2", model=model) is not None  # reused
    again = observe_shard_versions(spec, ["d1", "d2", "d9"])
    assert set(observed.data_versions_by_partition) == {"d1", "d2"}  # d9: no version
    assert again.data_versions_by_partition["d2"] == observed.data_versions_by_partition["d2"]
    assert again.data_versions_by_partition["d1"] != observed.data_versions_by_partition["d1"]


def test_a_table_on_the_loopback_s3_is_read_and_versioned(s3_server):
    bucket = s3_server.new_bucket("lake")
    storage = StorageOptions(
        endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
    )
    uri = f"s3://{bucket}/tables/docs"
    options = {"AWS_ENDPOINT_URL": storage.endpoint_url, "AWS_ALLOW_HTTP": "true"}
    _append(uri, _rows("d1", 0, 6), options)
    spec = _spec(uri, storage)

    rows = [r for c in _read_all(spec, "d1", 4) for r in c.rows]

    assert [r[1] for r in rows] == [f"d1-{i}" for i in range(6)]
    assert input_version(spec, "d1").startswith("delta:files=1:")


def test_the_pipeline_refuses_byte_ranges_and_arrival_sensors_on_a_table(table, tmp_path):
    with pytest.raises(ValueError, match="byte range"):
        InferenceSpec.model_validate(
            {**_spec(table).model_dump(), "partition_keys": ["d1@bytes=0-10"]}
        )
    pipeline = inference_assets(
        name="emb",
        model=str(tmp_path),
        task="embed",
        input=InputSpec(uri=table, format="delta", partition_column="day"),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.DynamicPartitionsDefinition(name="days"),
    )
    from dagster_gpuinfer import arrival_sensor

    with pytest.raises(ValueError, match="no files to watch"):
        arrival_sensor(pipeline)
    with pytest.raises(InvalidInferenceSpec, match="partition_column"):
        inference_assets(
            name="emb",
            model=str(tmp_path),
            task="embed",
            input={"uri": table, "format": "delta"},
            output_root=str(tmp_path / "out"),
            partitions_def=dg.StaticPartitionsDefinition(["d1"]),
        )


def test_the_backfill_estimate_counts_a_partitions_rows_from_the_log(table):
    from dagster_gpuinfer.estimate import input_work, work_unit

    spec = _spec(table)

    assert work_unit(spec) == "rows"
    assert input_work(spec, ["d1", "d1@rows=2-6", "d2", "d9"]) == {
        "d1": 10.0,
        "d1@rows=2-6": 4.0,
        "d2": 3.0,
        "d9": None,
    }
