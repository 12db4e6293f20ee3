"""A Delta table on the loopback S3 drives a partitioned embeddings pipeline end to end, with
the real vLLM CPU engine, into a Delta sink: each value of the table's `day` column is a
partition; a bad row is quarantined by the same row guards as a file's; a new table version
that rewrites one day recomputes that day only, and the sink holds every row once.
"""

from __future__ import annotations

import dagster as dg
import deltalake
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from support import cpu_resource, materialize_partitions, model_loads, partition_metadata

from dagster_gpuinfer import (
    DeltaSink,
    InputSpec,
    OutputSpec,
    inference_assets,
    read_errors,
    read_partition,
)

pytestmark = pytest.mark.engine

DAYS = ["2026-12-01", "2026-12-02"]
ROWS = 12


def _day(day: str, rows: int, variant: str, null_at: int | None = None) -> pa.Table:
    texts = [f"Report {variant} for {day}: item {i} shipped on time." for i in range(rows)]
    if null_at is not None:
        texts[null_at] = None
    return pa.table(
        {"day": [day] * rows, "doc_id": [f"{day}/{i}" for i in range(rows)], "text": texts}
    )


@pytest.fixture(scope="module")
def delta_runs(tmp_path_factory, minilm_dir, s3_server):
    root = tmp_path_factory.mktemp("delta")
    bucket = s3_server.new_bucket("lake")
    source = f"s3://{bucket}/docs"
    options = {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ALLOW_HTTP": "true"}

    def write(table: pa.Table, **how) -> None:
        deltalake.write_deltalake(
            source, table, partition_by=["day"], storage_options=options, **how
        )

    write(pa.concat_tables([_day(DAYS[0], ROWS, "a", null_at=5), _day(DAYS[1], ROWS, "a")]))
    sink_uri = str(root / "lake" / "doc_embeddings")
    pipeline = inference_assets(
        name="doc_embeddings",
        model=minilm_dir,
        task="embed",
        input=InputSpec(uri=source, format="delta", partition_column="day", id_column="doc_id"),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(DAYS),
        engine={"dtype": "float32"},
        chunk_size=5,
        sink=DeltaSink(uri=sink_uri),
    )
    output = OutputSpec(**pipeline.spec["output"])
    load_log = root / "loads.log"
    runs = {}
    with dg.instance_for_test() as instance:

        def materialize(name: str) -> None:
            resource = cpu_resource(
                load_log,
                s3_endpoint_url=s3_server.endpoint_url,
                s3_region=s3_server.region,
                s3_allow_http=True,
            )
            result = materialize_partitions(pipeline, DAYS, resource=resource, instance=instance)
            runs[name] = {
                "result": result,
                "loads": model_loads(load_log),
                "metadata": {
                    day: partition_metadata(instance, pipeline.output_asset.key, day)
                    for day in DAYS
                },
                "tables": {day: read_partition(output, day) for day in DAYS},
                "sink": pl.read_delta(sink_uri),
            }

        materialize("first")
        # A new table version: the second day rewritten (8 rows, new texts); the first untouched.
        write(_day(DAYS[1], 8, "b"), mode="overwrite", predicate=f"day = '{DAYS[1]}'")
        materialize("second")
        runs["errors"] = read_errors(output, DAYS[0])
        yield runs


def _sink_vectors(frame: pl.DataFrame, day: str) -> dict[str, list[float]]:
    part = frame.filter(pl.col("partition_key") == day)
    return dict(zip(part["id"].to_list(), part["embedding"].to_list(), strict=True))


def test_a_delta_table_drives_the_pipeline_and_a_new_version_recomputes_one_day(delta_runs):
    first, second = delta_runs["first"], delta_runs["second"]
    assert first["result"].success and second["result"].success
    day0, day1 = first["metadata"][DAYS[0]], first["metadata"][DAYS[1]]
    # The null text is quarantined by the row guards, as in a file; the shard does not fail.
    assert (day0["rows_in"], day0["rows_out"], day0["rows_errored"]) == (ROWS, ROWS - 1, 1)
    errors = delta_runs["errors"].to_pylist()
    assert [e["row"] for e in errors] == [5]
    assert f"docs[day={DAYS[0]}]" in errors[0]["source"]
    assert (day1["rows_in"], day1["rows_out"]) == (ROWS, ROWS)
    assert day0["input_version"].startswith("delta:files=1:")

    # Second run: one engine start, the rewritten day computed, the other reused.
    assert second["loads"] == first["loads"] + 1
    again0, again1 = second["metadata"][DAYS[0]], second["metadata"][DAYS[1]]
    assert again0["computed_in_this_run"] is False
    assert again0["input_version"] == day0["input_version"]
    assert again1["computed_in_this_run"] is True
    assert again1["input_version"] != day1["input_version"]
    assert second["tables"][DAYS[1]].column("id").to_pylist() == [
        f"{DAYS[1]}/{i}" for i in range(8)
    ]

    # The sink: each row once, its vectors the Parquet output's, bit for bit.
    sink = second["sink"]
    assert sink.height == ROWS - 1 + 8
    assert sink.select(["partition_key", "id"]).is_unique().all()
    for day in DAYS:
        table = second["tables"][day]
        parquet = dict(
            zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True)
        )
        assert _sink_vectors(sink, day) == parquet
    vectors = np.array(sink["embedding"].to_list())
    assert vectors.shape == (ROWS - 1 + 8, 384)  # MiniLM's real embeddings
