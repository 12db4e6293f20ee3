"""The PostgreSQL + pgvector sink: each committed partition replaced whole, in one
transaction, on a real server with the pgvector extension.

`make test` starts a throwaway server (deploy/local/test-pgvector.sh, PostgreSQL with
pgvector from the pinned pgserver wheel) and passes its URL in GPUINFER_TEST_PGVECTOR_URL;
without it the server tests are skipped, saying so. Each test gets its own database.

No engine runs: partitions are committed by hand as a worker leaves them (part files and
`_SUCCESS`), so a Dagster run reuses them without starting a worker and goes straight to
the sink, as it does after a worker reports its commits.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support import (
    commit_by_hand,
    commit_rows,
    embed_pipeline,
    embedding_rows,
    failure_message,
    fresh_postgres_database,
    materialize_partitions,
    partition_metadata,
    pg_query,
    write_text_shard,
)

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec, InputSpec
from dagster_gpuinfer.resource import InvalidInferenceSpec
from dagster_gpuinfer.sinks import PgVectorSink
from dagster_gpuinfer.sinks.materialize import write_partitions
from dagster_gpuinfer.sinks.pgvector import copy_csv, sink_layout
from dagster_gpuinfer.sinks.pgvector_write import (
    SinkError,
    connect,
    ensure_table,
    replace_partition,
)

KEYS = ["p0", "p1"]
DIM = 16
URL_ENV = "GPUINFER_SINK_TEST_DB_URL"


@pytest.fixture
def database(monkeypatch):
    """A fresh database on the pgvector server; its URL is in URL_ENV, as a deployment
    would put it in the code location's environment."""
    with fresh_postgres_database("sink", pgvector=True) as db_url:
        monkeypatch.setenv(URL_ENV, db_url)
        yield db_url


def _query(url: str, statement: str, params=()) -> list[tuple]:
    return pg_query(url, statement, params)


def _sink(**changes) -> PgVectorSink:
    return PgVectorSink(**{"url_env": URL_ENV, "table": "doc_embeddings", **changes})


def _pipeline(root: Path, sink: PgVectorSink | None = None, **changes):
    return embed_pipeline(root, KEYS, sink=sink or _sink(), **changes)


def _embeddings(key: str, rows: int, *, seed: int = 0, nan_at: int | None = None) -> pa.Table:
    return embedding_rows(key, rows, DIM, seed=seed, nan_at=nan_at)


@pytest.fixture
def root(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path


def _sink_rows(url: str, key: str) -> dict[str, list[float]]:
    rows = _query(
        url,
        "SELECT id, embedding::text FROM doc_embeddings WHERE partition_key = %s ORDER BY id",
        [key],
    )
    # pgvector prints each float32 in its shortest text; read back as float32, it is exact
    return {
        row_id: np.array(text.strip("[]").split(","), dtype=np.float32).tolist()
        for row_id, text in rows
    }


def _as_dict(table: pa.Table) -> dict[str, list[float]]:
    return dict(zip(table["id"].to_pylist(), table["embedding"].to_pylist(), strict=True))


def test_a_materialization_writes_exactly_the_committed_rows(root, database, instance):
    pipeline = _pipeline(root)
    parts = {}
    for key in KEYS:
        write_text_shard(root, key, 7)
        parts[key] = (_embeddings(key, 4), _embeddings(key, 7).slice(4))
        commit_rows(pipeline, key, *parts[key])

    result = materialize_partitions(
        pipeline, KEYS, resource=GpuInferenceResource(), instance=instance
    )

    assert result.success
    for key in KEYS:
        expected = _as_dict(pa.concat_tables(parts[key]))
        assert _sink_rows(database, key) == expected  # float32 values, bit for bit
        metadata = partition_metadata(instance, pipeline.output_asset.key, key)
        assert metadata["sink_rows"] == 7
        assert metadata["sink"] == "pgvector:doc_embeddings"
    recorded = _query(
        database,
        "SELECT partition_key, spec_hash, input_version, rows FROM doc_embeddings_partitions "
        "ORDER BY partition_key",
    )
    spec_hash = InferenceSpec.model_validate(pipeline.spec).spec_hash()
    assert [(key, h, n) for key, h, _, n in recorded] == [(k, spec_hash, 7) for k in KEYS]
    assert all(version for *_, version, _ in recorded)
    assert _query(
        database,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = 'doc_embeddings'::regclass AND attname = 'embedding'",
    ) == [(f"vector({DIM})",)]


def test_a_rematerialization_after_the_shard_changed_replaces_the_partition(
    root, database, instance
):
    pipeline = _pipeline(root)
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
    result = materialize_partitions(
        pipeline, ["p0"], resource=GpuInferenceResource(), instance=instance
    )

    assert result.success
    assert _sink_rows(database, "p0") == _as_dict(fresh)  # no leftovers, new vectors
    assert len(_sink_rows(database, "p1")) == 6  # the other partition untouched
    counts = _query(
        database, "SELECT count(*), count(DISTINCT (partition_key, id)) FROM doc_embeddings"
    )
    assert counts == [(9, 9)]


def test_a_bad_row_in_the_middle_of_the_write_leaves_the_previous_state(root, database, instance):
    pipeline = _pipeline(root, sink=_sink(batch_rows=2))
    write_text_shard(root, "p0", 5)
    commit_rows(pipeline, "p0", _embeddings("p0", 5))
    assert materialize_partitions(
        pipeline, ["p0"], resource=GpuInferenceResource(), instance=instance
    ).success
    before = _sink_rows(database, "p0")

    time.sleep(0.01)
    write_text_shard(root, "p0", 6)
    # Batches of two rows: the first two are sent before the server refuses a NaN.
    commit_rows(pipeline, "p0", _embeddings("p0", 6, seed=2, nan_at=3))
    result = materialize_partitions(
        pipeline,
        ["p0"],
        resource=GpuInferenceResource(),
        instance=instance,
        raise_on_error=False,
    )

    assert not result.success
    message = failure_message(result)
    assert "refused the rows" in message and "NaN" in message
    assert "rolled back" in message
    assert _sink_rows(database, "p0") == before
    assert _query(database, "SELECT rows FROM doc_embeddings_partitions") == [(5,)]


def _manifest_and_spec(root: Path, rows: int, **changes):
    pipeline = _pipeline(root, **changes)
    write_text_shard(root, "p0", rows)
    manifest = commit_rows(pipeline, "p0", _embeddings("p0", rows))
    return InferenceSpec.model_validate(pipeline.spec), manifest


def test_a_killed_connection_in_the_middle_of_the_write_leaves_the_previous_state(root, database):
    import psycopg2

    sink = _sink()
    spec, manifest = _manifest_and_spec(root, 4)
    write_partitions(sink, spec, {"p0": manifest})
    before = _sink_rows(database, "p0")

    conn = connect(sink)
    layout = sink_layout("embed")
    new_rows = _embeddings("p0", 4, seed=3)

    def batches_then_kill():
        yield new_rows.to_batches(max_chunksize=2)[0]  # sent: the DELETE and two rows done
        with psycopg2.connect(database) as admin, admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [conn.get_backend_pid()])
        admin.close()
        yield new_rows.to_batches(max_chunksize=2)[1]

    with pytest.raises(SinkError, match="connection .* failed mid-write") as failed:
        replace_partition(conn, sink, layout, manifest.model_copy(), batches_then_kill())

    assert failed.value.retryable
    assert _sink_rows(database, "p0") == before


def test_two_concurrent_writers_of_one_partition_end_with_one_copy(root, database):
    sink = _sink(batch_rows=10)
    spec, manifest = _manifest_and_spec(root, 60)
    layout = sink_layout("embed")
    conn = connect(sink)
    ensure_table(conn, sink, layout, DIM)
    conn.close()
    start = threading.Barrier(2)
    outcomes: list[object] = []

    def slow(batches):
        for batch in batches:
            time.sleep(0.02)  # the two transactions overlap
            yield batch

    def writer():
        own = connect(sink)
        start.wait()
        try:
            rows = _embeddings("p0", 60).to_batches(max_chunksize=10)
            outcomes.append(replace_partition(own, sink, layout, manifest, slow(rows)).rows)
        except Exception as exc:  # noqa: BLE001 - the test reports it below
            outcomes.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert outcomes == [60, 60]
    assert _query(database, "SELECT count(*), count(DISTINCT id) FROM doc_embeddings") == [(60, 60)]


def test_an_older_commit_never_replaces_a_newer_one_in_the_sink(root, database):
    sink = _sink()
    spec, older = _manifest_and_spec(root, 3)
    time.sleep(0.01)
    write_text_shard(root, "p0", 2)
    newer = commit_by_hand(spec, "p0", parts=[_embeddings("p0", 2, seed=5)])
    assert write_partitions(sink, spec, {"p0": newer})["p0"].rows == 2

    conn = connect(sink)
    late = replace_partition(conn, sink, sink_layout("embed"), older, iter([]))
    conn.close()

    assert late.superseded and late.rows == 2
    assert len(_sink_rows(database, "p0")) == 2


def test_a_nearest_neighbour_query_finds_each_rows_own_embedding_first(root, database):
    rows = 300
    spec, manifest = _manifest_and_spec(root, rows)
    write_partitions(_sink(), spec, {"p0": manifest})
    table = _embeddings("p0", rows)
    import psycopg2

    with psycopg2.connect(database) as conn, conn.cursor() as cur:
        cur.execute("SET enable_seqscan = off")  # through the HNSW index
        cur.execute(
            "EXPLAIN SELECT id FROM doc_embeddings ORDER BY embedding <=> %s LIMIT 3",
            ["[" + ",".join(["1"] * DIM) + "]"],
        )
        plan = " ".join(line for (line,) in cur.fetchall())
        assert "doc_embeddings_embedding_hnsw" in plan
        for index in (0, 17, 123, 299):
            vector = table["embedding"][index].as_py()
            cur.execute(
                "SELECT id, embedding <=> %s::vector FROM doc_embeddings "
                "ORDER BY embedding <=> %s::vector LIMIT 3",
                [str(vector), str(vector)],
            )
            found = cur.fetchall()
            assert found[0][0] == f"p0-{index}"
            assert math.isclose(found[0][1], 0.0, abs_tol=1e-6)
    conn.close()


def test_generated_text_goes_to_a_text_column(root, database):
    pipeline = _pipeline(root, sink=_sink(table="completions"), task="generate")
    write_text_shard(root, "p0", 2)
    output = pa.table(
        {"id": ["p0-0", "p0-1"], "text": ['say "hi",\nthen go', ""], "finish_reason": ["stop"] * 2}
    )
    manifest = commit_rows(pipeline, "p0", output)
    spec = InferenceSpec.model_validate(pipeline.spec)

    assert write_partitions(_sink(table="completions"), spec, {"p0": manifest})["p0"].rows == 2
    assert _query(database, "SELECT id, text FROM completions ORDER BY id") == [
        ("p0-0", 'say "hi",\nthen go'),
        ("p0-1", ""),
    ]


# --------------------------------------------------------------------------- no server


def test_the_sink_takes_a_variable_name_never_a_url():
    with pytest.raises(ValueError, match="names the environment variable"):
        PgVectorSink(url_env="postgresql://u:secret@db/x", table="t")
    with pytest.raises(ValueError, match="plain lower-case name"):
        PgVectorSink(url_env="DB_URL", table="t; DROP TABLE x")


def test_the_pipeline_refuses_a_sink_its_outputs_cannot_feed(root):
    with pytest.raises(InvalidInferenceSpec, match="not task 'score'"):
        _pipeline(root, task="score", input=InputSpec(uri="x/{partition_key}.jsonl"))
    with pytest.raises(InvalidInferenceSpec, match="output_format='parquet'"):
        _pipeline(root, output_format="openai_batch")


def test_the_asset_names_the_sink_and_its_variable_but_no_url(root, monkeypatch):
    monkeypatch.setenv(URL_ENV, "postgresql://user:hunter2@db.internal/prod")
    pipeline = _pipeline(root, sink={"url_env": URL_ENV, "table": "doc_embeddings"})
    metadata = pipeline.output_asset.specs_by_key[pipeline.output_asset.key].metadata
    shown = metadata["gpuinfer/sink"].value
    assert shown["url_env"] == URL_ENV and shown["table"] == "doc_embeddings"
    assert "hunter2" not in repr(metadata)


def test_an_unset_url_variable_fails_with_what_to_set(monkeypatch):
    monkeypatch.delenv(URL_ENV, raising=False)
    with pytest.raises(SinkError, match=f"environment variable {URL_ENV}") as failed:
        connect(_sink())
    assert not failed.value.retryable


def test_copy_rows_quote_text_and_keep_float32_values():
    table = _embeddings("k", 3)
    data = copy_csv(
        table.to_batches()[0], sink_layout("embed"), partition_key='a,"b"', spec_hash="h"
    )
    lines = data.decode().splitlines()
    assert len(lines) == 3 and lines[0].startswith('"a,""b""","k-0","[')
    first = lines[0].split('"[')[1].split(']"')[0]
    values = np.array([float(x) for x in first.split(",")], dtype=np.float32)
    assert values.tolist() == table["embedding"][0].as_py()


def test_the_control_plane_loads_no_database_driver_until_a_sink_writes():
    import subprocess
    import sys

    code = (
        "import sys\nimport dagster_gpuinfer.asset_factory, dagster_gpuinfer.sinks\n"
        "from dagster_gpuinfer import PgVectorSink\n"
        "print(any(m.split('.')[0] == 'psycopg2' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_a_yaml_pipeline_sets_the_sink_as_configuration(root):
    from dagster_gpuinfer.components.inference_pipeline import InferencePipelineComponent

    component = InferencePipelineComponent.resolve_from_yaml(
        f"""
name: emb
model: {root / "model"}
task: embed
input: {{uri: "{root / "in"}/{{partition_key}}.parquet"}}
output_root: {root / "out"}
partitioning: {{type: static, keys: [p0]}}
sink: {{url_env: {URL_ENV}, table: doc_embeddings, distance: l2}}
"""
    )
    asset = component.build_pipeline().output_asset
    shown = asset.specs_by_key[asset.key].metadata["gpuinfer/sink"].value
    assert shown["table"] == "doc_embeddings" and shown["distance"] == "l2"
