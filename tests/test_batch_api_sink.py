"""A batch API route's sink: each completed batch's results replaced whole, under the batch
id, in a real PostgreSQL with pgvector (deploy/local/test-pgvector.sh, as the pipeline sink
tests) or a Delta table on local disk or the loopback S3, when the service finalizes it.

No engine: a batch's partition is written as the worker writes it (chunk part files of
OpenAI output lines, quarantined rows, chunk markers, then the `_SUCCESS` manifest) through
the storage layer's own calls; the batch is created and read back with the openai SDK.
"""

from __future__ import annotations

import json

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_api_support import client, jsonl_ids, live_service, request_lines
from support import fresh_postgres_database, pg_query

from dagster_gpuinfer.batch_api.files import FileBytes
from dagster_gpuinfer.batch_api.routing import Route, RoutingTable, load_routing_table
from dagster_gpuinfer.batch_api.service import BatchService
from dagster_gpuinfer.batch_api.store import BatchStore
from dagster_gpuinfer.batch_api.tags import BATCH_ID_TAG
from dagster_gpuinfer.sinks import DeltaSink, PgVectorSink
from dagster_gpuinfer.sinks.batch_output import check_rows, line_results
from dagster_gpuinfer.sinks.pgvector import sink_layout
from dagster_gpuinfer.sinks.pgvector_write import SinkError
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage import (
    ERRORS_SCHEMA,
    ChunkMarker,
    Manifest,
    chunk_dir,
    chunk_part_name,
    commit_partition,
    filesystem_for,
    partition_dir,
    table_to_parquet_bytes,
    write_chunk_marker,
    write_file_entry,
)
from dagster_gpuinfer.storage.delta import storage_options

URL_ENV = "GPUINFER_ROUTE_SINK_TEST_DB_URL"
DIM = 8
SPEC_HASH = "feedc0de00000000"


@pytest.fixture
def database(monkeypatch):
    """A fresh database on the pgvector server; its URL in URL_ENV, as a deployment puts it
    in the batch API service's environment."""
    with fresh_postgres_database("route_sink", pgvector=True) as db_url:
        monkeypatch.setenv(URL_ENV, db_url)
        yield db_url


def query(url: str, statement: str, params=()) -> list[tuple]:
    return pg_query(url, statement, params)


def pg_sink(**changes) -> PgVectorSink:
    return PgVectorSink(**{"url_env": URL_ENV, "table": "batch_vectors", **changes})


def routes(embed_sink=None, chat_sink=None) -> RoutingTable:
    return RoutingTable(
        routes=[
            {
                "model": "mini",
                "endpoint": "/v1/embeddings",
                "pipeline": "batch_embed",
                "model_path": "/models/not-loaded-here",
                "sink": embed_sink,
            },
            {
                "model": "tiny",
                "endpoint": "/v1/chat/completions",
                "pipeline": "batch_chat",
                "model_path": "/models/not-loaded-here-either",
                "sink": chat_sink,
            },
        ]
    )


def make_service(tmp_path, instance, table: RoutingTable, *, files=None, **options):
    return BatchService(
        store=BatchStore(f"sqlite:///{tmp_path}/store.sqlite"),
        files=files or FileBytes(str(tmp_path / "files")),
        routes=table,
        instance=instance,
        **options,
    )


def vector(custom_id: str) -> list[float]:
    """A float32-exact vector of the line, the same every time."""
    seed = sum(custom_id.encode())
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32).tolist()


def embedding_line(custom_id: str) -> dict:
    body = {
        "object": "list",
        "model": "mini",
        "data": [{"object": "embedding", "index": 0, "embedding": vector(custom_id)}],
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    return {"custom_id": custom_id, "body": body}


def chat_line(custom_id: str, *answers: str) -> dict:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        for i, text in enumerate(answers)
    ]
    return {"custom_id": custom_id, "body": {"object": "chat.completion", "choices": choices}}


def write_batch_chunk(service, pipeline, batch_id, index, lines, bad=(), attempt="attempt0"):
    """One chunk of the batch's partition as the worker commits it: its part file (OpenAI
    output lines), its quarantined rows, then its marker."""
    fs, path = filesystem_for(
        partition_dir(service.files.output_spec(pipeline), batch_id), service.files.storage
    )
    data = "".join(
        json.dumps(
            {
                "id": f"batch_req_{line['custom_id']}",
                "custom_id": line["custom_id"],
                "response": {"status_code": 200, "request_id": "r", "body": line["body"]},
                "error": None,
            }
        )
        + "\n"
        for line in lines
    ).encode()
    name = chunk_part_name(SPEC_HASH, index, attempt, ".jsonl")
    part = write_file_entry(fs, path, name, data, len(lines))
    errors = None
    if bad:
        table = pa.Table.from_pylist(
            [
                {"id": i, "source": "in", "row": n, "error_type": "too_long", "message": "x"}
                for n, i in enumerate(bad)
            ],
            schema=ERRORS_SCHEMA,
        )
        errors = write_file_entry(
            fs,
            chunk_dir(path, SPEC_HASH),
            f"errors-{index:05d}-{attempt}.parquet",
            table_to_parquet_bytes(table),
            len(bad),
        )
    marker = ChunkMarker(
        index=index,
        spec_hash=SPEC_HASH,
        rows_in=len(lines) + len(bad),
        rows_out=len(lines),
        rows_errored=len(bad),
        part=part,
        errors=errors,
    )
    write_chunk_marker(fs, path, marker)
    return fs, path, marker


def commit_batch(fs, path, batch_id, markers, task="embed", storage=None) -> Manifest:
    """The `_SUCCESS` manifest over the chunks' part files and quarantined rows."""
    manifest = Manifest(
        partition_key=batch_id,
        spec_hash=SPEC_HASH,
        model="m",
        task=task,
        output_format="openai_batch",
        rows_in=sum(m.rows_in for m in markers),
        rows_out=sum(m.rows_out for m in markers),
        rows_errored=sum(m.rows_errored for m in markers),
        parts=[m.part for m in markers],
        errors=markers[0].part,
    )
    tables = []
    for m in markers:
        if m.errors is not None:
            with fs.open_input_file(f"{chunk_dir(path, SPEC_HASH)}/{m.errors.name}") as handle:
                tables.append(pq.read_table(handle))
    errors = b"".join(
        json.dumps({"custom_id": row["id"], "error": {"code": "too_long"}}).encode() + b"\n"
        for table in tables
        for row in table.to_pylist()
    )
    commit_partition(fs, path, manifest, tables, storage, openai_errors=errors or None)
    return manifest


def create_batch(sdk, n: int, *, model="mini", url="/v1/embeddings"):
    uploaded = sdk.files.create(
        file=("in.jsonl", request_lines(n, model=model, url=url)), purpose="batch"
    )
    return sdk.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h")


def pg_rows(url: str, batch_id: str) -> dict[str, tuple[list[float], str]]:
    rows = query(
        url,
        "SELECT id, embedding::text, tenant FROM batch_vectors WHERE partition_key = %s",
        [batch_id],
    )
    return {
        row_id: (np.array(text.strip("[]").split(","), dtype=np.float32).tolist(), tenant)
        for row_id, text, tenant in rows
    }


class DiesBeforeCompleting:
    """The store of a service that dies right after the sink write, before the batch's row
    says completed: the final update raises, as a killed process would leave it."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def update_batch(self, batch_id, **values):
        if values.get("status") == "completed":
            raise KeyboardInterrupt("the service was killed")
        return self.store.update_batch(batch_id, **values)


def test_a_completed_embeddings_batch_lands_once_across_a_retried_run_and_a_restart(
    tmp_path, instance, database
):
    # Two rows a COPY: the batch's five rows go in three, in one transaction.
    service = make_service(tmp_path, instance, routes(embed_sink=pg_sink(batch_rows=2)))
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        batch = create_batch(sdk, 6)
        ids = [f"req-{i}" for i in range(6)]
        # The first run's attempt commits a chunk, then fails; Dagster retries the run.
        _, _, first = write_batch_chunk(
            service, "batch_embed", batch.id, 0, [embedding_line(i) for i in ids[:2]]
        )

        @dg.op
        def lose_the_worker():
            raise RuntimeError("the worker pod was evicted")

        @dg.job(tags={BATCH_ID_TAG: batch.id, "dagster/will_retry": "true"})
        def first_attempt():
            lose_the_worker()

        assert not first_attempt.execute_in_process(instance=instance, raise_on_error=False).success
        service.reconcile_all()
        assert sdk.batches.retrieve(batch.id).status == "in_progress"
        assert query(database, "SELECT to_regclass('batch_vectors') IS NULL") == [(True,)]
        # The retry resumes: the next chunk (one line quarantined) and the commit.
        fs, path, second = write_batch_chunk(
            service,
            "batch_embed",
            batch.id,
            1,
            [embedding_line(i) for i in ids[2:5]],
            bad=["req-5"],
            attempt="attempt1",
        )
        commit_batch(fs, path, batch.id, [first, second])

        # The service dies after the sink write, before the row says completed.
        dying = make_service(tmp_path, instance, service.routes)
        dying.store = DiesBeforeCompleting(dying.store)
        with pytest.raises(KeyboardInterrupt):
            dying.reconcile_all()
        assert sdk.batches.retrieve(batch.id).status == "finalizing"
        assert set(pg_rows(database, batch.id)) == set(ids[:5])
        # A restarted service finalizes it again: the same rows, not beside them.
        service.reconcile_all()
        service.reconcile_all()
        done = sdk.batches.retrieve(batch.id)
        output = sdk.files.content(done.output_file_id).read()

    assert done.status == "completed" and done.errors is None
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    rows = pg_rows(database, batch.id)
    assert rows == {i: (vector(i), "acme") for i in ids[:5]}  # the quarantined req-5 is not
    assert query(database, "SELECT count(*), count(DISTINCT id) FROM batch_vectors") == [(5, 5)]
    assert query(
        database, "SELECT partition_key, spec_hash, rows FROM batch_vectors_partitions"
    ) == [(batch.id, SPEC_HASH, 5)]
    # The sink and the published output file hold the same lines.
    assert sorted(jsonl_ids(output)) == sorted(rows)
    # Nearest neighbour over the sink: each vector is its own.
    [(nearest,)] = query(
        database,
        "SELECT id FROM batch_vectors ORDER BY embedding <=> %s::vector LIMIT 1",
        [str(vector("req-3"))],
    )
    assert nearest == "req-3"


def test_two_tenants_batches_share_the_table_each_under_its_own_id(tmp_path, instance, database):
    service = make_service(tmp_path, instance, routes(embed_sink=pg_sink()))
    with live_service(service) as api:
        batches = {}
        for tenant in ("acme", "globex"):
            sdk = client(api, service.store.create_key(tenant).token)
            batch = create_batch(sdk, 2)
            fs, path, marker = write_batch_chunk(
                service, "batch_embed", batch.id, 0, [embedding_line(f"req-{i}") for i in (0, 1)]
            )
            commit_batch(fs, path, batch.id, [marker])
            batches[tenant] = batch.id
        service.reconcile_all()
    got = query(database, "SELECT partition_key, id, tenant FROM batch_vectors ORDER BY 1, 2")
    assert sorted(got) == sorted(
        (batch_id, f"req-{i}", tenant) for tenant, batch_id in batches.items() for i in (0, 1)
    )


def test_an_unreachable_sink_keeps_the_batch_finalizing_with_the_error_then_completes(
    tmp_path, instance, database, monkeypatch
):
    monkeypatch.setenv(URL_ENV, "postgresql://nobody@127.0.0.1:9/none")  # nothing listens
    service = make_service(tmp_path, instance, routes(embed_sink=pg_sink(connect_timeout=2)))
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        batch = create_batch(sdk, 3)
        fs, path, marker = write_batch_chunk(
            service, "batch_embed", batch.id, 0, [embedding_line(f"req-{i}") for i in range(3)]
        )
        commit_batch(fs, path, batch.id, [marker])
        service.reconcile_all()
        waiting = sdk.batches.retrieve(batch.id)
        assert waiting.status == "finalizing"
        [error] = waiting.errors.data
        assert error.code == "sink_unavailable" and error.param == "sink"
        assert "cannot connect" in error.message and "tries again" in error.message
        assert URL_ENV in error.message and "nobody" not in error.message  # never the URL
        # The output is there while the sink is retried.
        assert jsonl_ids(sdk.files.content(waiting.output_file_id).read()) == [
            "req-0",
            "req-1",
            "req-2",
        ]
        monkeypatch.setenv(URL_ENV, database)  # the server is back
        service.reconcile_all()
        done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.errors is None
    assert set(pg_rows(database, batch.id)) == {"req-0", "req-1", "req-2"}


def test_a_sink_failing_past_its_retry_time_fails_the_batch_and_keeps_the_output(
    tmp_path, instance, monkeypatch
):
    monkeypatch.setenv(URL_ENV, "postgresql://nobody@127.0.0.1:9/none")
    service = make_service(
        tmp_path, instance, routes(embed_sink=pg_sink(connect_timeout=2)), sink_retry_seconds=0
    )
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        batch = create_batch(sdk, 2)
        fs, path, marker = write_batch_chunk(
            service, "batch_embed", batch.id, 0, [embedding_line(f"req-{i}") for i in range(2)]
        )
        commit_batch(fs, path, batch.id, [marker])
        service.reconcile_all()
        failed = sdk.batches.retrieve(batch.id)
        assert failed.status == "failed" and failed.failed_at is not None
        assert [e.code for e in failed.errors.data] == ["sink_unavailable"]
        assert failed.request_counts.completed == 2
        assert jsonl_ids(sdk.files.content(failed.output_file_id).read()) == ["req-0", "req-1"]


def test_a_table_the_sink_cannot_take_fails_the_batch_at_once_and_keeps_the_output(
    tmp_path, instance, database
):
    # A pipeline's sink table of the same name: no tenant column.
    query(
        database,
        "CREATE EXTENSION vector; CREATE TABLE batch_vectors (partition_key text, id text, "
        f"embedding vector({DIM}), spec_hash text, PRIMARY KEY (partition_key, id)); SELECT 1",
    )
    service = make_service(tmp_path, instance, routes(embed_sink=pg_sink()))
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        batch = create_batch(sdk, 2)
        fs, path, marker = write_batch_chunk(
            service, "batch_embed", batch.id, 0, [embedding_line(f"req-{i}") for i in range(2)]
        )
        commit_batch(fs, path, batch.id, [marker])
        service.reconcile_all()
        failed = sdk.batches.retrieve(batch.id)
        assert failed.status == "failed"
        [error] = failed.errors.data
        assert error.code == "sink_refused" and "pgvector:batch_vectors" in error.message
        assert "has no tenant column" in error.message
        assert "will not be written" in error.message
        assert jsonl_ids(sdk.files.content(failed.output_file_id).read()) == ["req-0", "req-1"]


def read_delta(uri: str, storage: StorageOptions | None = None):
    import polars as pl

    return pl.read_delta(uri, storage_options=storage_options(uri, storage)).sort("id")


def test_a_chat_batch_lands_in_a_delta_table_one_row_per_choice(tmp_path, instance):
    table = str(tmp_path / "lake" / "chat")
    service = make_service(
        tmp_path, instance, routes(chat_sink={"kind": "delta", "uri": table, "batch_rows": 2})
    )
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        batch = create_batch(sdk, 3, model="tiny", url="/v1/chat/completions")
        lines = [chat_line("req-0", "zero"), chat_line("req-1", "one", "uno")]
        fs, path, marker = write_batch_chunk(service, "batch_chat", batch.id, 0, lines, ["req-2"])
        commit_batch(fs, path, batch.id, [marker], task="chat")
        service.reconcile_all()
        # A second finalize of the same batch (a restarted service) overwrites, never adds.
        service._finalize(service.store.get_batch(batch.id), "completed")
        done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed"
    frame = read_delta(table)
    assert frame.select("partition_key", "id", "text", "tenant", "spec_hash").rows() == [
        (batch.id, "req-0", "zero", "acme", SPEC_HASH),
        (batch.id, "req-1#0", "one", "acme", SPEC_HASH),
        (batch.id, "req-1#1", "uno", "acme", SPEC_HASH),
    ]


def test_an_embeddings_batch_lands_in_a_delta_table_on_the_loopback_s3(
    tmp_path, instance, s3_server
):
    storage = StorageOptions(
        endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
    )
    files = FileBytes(f"s3://{s3_server.new_bucket('batches')}/api", storage)
    table = f"s3://{s3_server.new_bucket('lake')}/tables/batch_vectors"
    service = make_service(tmp_path, instance, routes(embed_sink=DeltaSink(uri=table)), files=files)
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        batch = create_batch(sdk, 4)
        ids = [f"req-{i}" for i in range(4)]
        fs, path, marker = write_batch_chunk(
            service, "batch_embed", batch.id, 0, [embedding_line(i) for i in ids]
        )
        commit_batch(fs, path, batch.id, [marker], storage=storage)
        service.reconcile_all()
        assert sdk.batches.retrieve(batch.id).status == "completed"
    frame = read_delta(table, storage)  # the sink's storage: the service's S3 settings
    assert frame["id"].to_list() == ids
    assert frame["embedding"].to_list() == [vector(i) for i in ids]
    assert set(frame["partition_key"].to_list()) == {batch.id}


def test_a_route_names_its_sink_in_yaml_as_a_pipeline_does(tmp_path):
    path = tmp_path / "routes.yaml"
    path.write_text(
        "routes:\n"
        "  - {model: mini, endpoint: /v1/embeddings, pipeline: batch_embed, model_path: /m,\n"
        "     sink: {kind: pgvector, url_env: EMBEDDINGS_DB_URL, table: batch_vectors}}\n"
        "  - {model: tiny, endpoint: /v1/chat/completions, pipeline: batch_chat,\n"
        "     model_path: /m2, sink: {kind: delta, uri: 's3://lake/chat'}}\n"
    )
    table = load_routing_table(str(path))
    assert table.routes[0].sink == PgVectorSink(url_env="EMBEDDINGS_DB_URL", table="batch_vectors")
    assert table.routes[1].sink == DeltaSink(uri="s3://lake/chat")

    def route(**changes):
        fields = {"model": "m", "endpoint": "/v1/embeddings", "pipeline": "p", "model_path": "/m"}
        return Route.model_validate({**fields, **changes})

    with pytest.raises(ValueError, match="not task 'score'"):
        route(endpoint="/v1/rerank", sink={"kind": "delta", "uri": "/tmp/t"})
    with pytest.raises(ValueError, match="url_env names the environment variable"):
        route(sink={"url_env": "postgresql://u:secret@db/x", "table": "t"})
    with pytest.raises(ValueError, match="sink: expected the settings of a sink"):
        route(sink="pgvector")


def test_output_lines_become_rows_and_two_rows_with_one_id_are_refused():
    layout = sink_layout("chat", tenants=True)
    lines = [
        {"custom_id": "a", "response": {"status_code": 200, "body": chat_line("a", "x")["body"]}},
        {
            "custom_id": "b",
            "response": {"status_code": 200, "body": chat_line("b", "y", "z")["body"]},
        },
    ]
    output = "\n".join(json.dumps(line) for line in lines).encode()
    assert list(line_results(output, layout, batch_id="batch_1")) == [
        ("a", "x"),
        ("b#0", "y"),
        ("b#1", "z"),
    ]
    assert check_rows(output, layout, batch_id="batch_1") == (3, None)
    clash = output + b"\n" + json.dumps({**lines[0], "custom_id": "b#1"}).encode()
    with pytest.raises(SinkError, match="two rows would have the id 'b#1'") as refused:
        check_rows(clash, layout, batch_id="batch_1")
    assert not refused.value.retryable


def test_serve_refuses_to_start_while_a_sinks_url_variable_is_unset(tmp_path, monkeypatch):
    from dagster_gpuinfer.batch_api.__main__ import build_service

    path = tmp_path / "routes.yaml"
    path.write_text(
        "- {model: mini, endpoint: /v1/embeddings, pipeline: batch_embed, model_path: /m,\n"
        "   sink: {url_env: UNSET_ROUTE_SINK_URL, table: batch_vectors}}\n"
    )
    monkeypatch.delenv("UNSET_ROUTE_SINK_URL", raising=False)
    with pytest.raises(ValueError, match="UNSET_ROUTE_SINK_URL \\(route 'mini'\\)"):
        build_service(str(path), f"sqlite:///{tmp_path}/s.sqlite", str(tmp_path / "files"))
