"""A batch API route with a pgvector sink, end to end: the `openai` SDK against the service
(a subprocess), a real `dagster-daemon` and the real vLLM CPU engine, and the sink on the
PostgreSQL with pgvector of deploy/local/test-pgvector.sh.

One engine start: an embeddings batch through a route whose sink is pgvector, the service
restarted mid-run; once completed, the database holds one row per custom_id of the output
file, under the batch id and the tenant, with the output file's vectors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from batch_api_support import client, jsonl_ids
from support import fresh_postgres_database, pg_query
from test_batch_api_engine import MODEL, Stack, embedding_lines, finished_run, poll

from dagster_gpuinfer.batch_api.store import BatchStore

pytestmark = pytest.mark.engine

URL_ENV = "BATCH_VECTORS_DB_URL"


@pytest.fixture(scope="module")
def database():
    with fresh_postgres_database("route_sink", pgvector=True) as url:
        yield url


def query(url: str, statement: str, params=()) -> list[tuple]:
    return pg_query(url, statement, params)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, minilm_dir, database):
    tmp = tmp_path_factory.mktemp("batch_api_sink_engine")
    stack = Stack(tmp, minilm_dir)
    # One route, with a sink: the same settings a pipeline's `sink:` takes.
    (tmp / "routes.yaml").write_text(
        "routes:\n"
        f"  - model: {MODEL}\n"
        "    endpoint: /v1/embeddings\n"
        "    pipeline: batch_embeddings\n"
        f"    model_path: {minilm_dir}\n"
        "    engine: {dtype: float32}\n"
        "    chunk_size: 16\n"
        f"    sink: {{kind: pgvector, url_env: {URL_ENV}, table: batch_vectors}}\n"
    )
    stack.env[URL_ENV] = database  # the service's environment: it writes the sink
    instance = stack.instance()
    instance.get_runs(limit=1)
    instance.all_instigator_state()
    instance.dispose()
    store = BatchStore(stack.store_url)
    stack.key = store.create_key("acme", kueue_queue="acme-gpu").token
    store.close()
    stack.start_daemon()
    stack.start_api()
    yield stack
    stack.close()


def test_an_engine_batch_through_a_route_with_a_sink_lands_once(stack, database):
    rows = 400
    data, _ = embedding_lines(rows, prefix="s")
    sdk = client(stack.base_url, stack.key)
    uploaded = sdk.files.create(file=("embed.jsonl", data), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    poll(stack, batch.id, lambda b: b.request_counts.completed > 0 or b.status != "in_progress")
    # Restart the service mid-run (or, on a fast machine, mid-finalize).
    stack.stop_api()
    stack.start_api()
    done = poll(stack, batch.id, lambda b: b.status not in ("in_progress", "finalizing"))
    assert done.status == "completed" and done.errors is None, f"{done}\n{stack.logs()}"
    output = sdk.files.content(done.output_file_id).read()
    expected = {
        record["custom_id"]: record["response"]["body"]["data"][0]["embedding"]
        for record in map(json.loads, output.splitlines())
    }
    assert sorted(jsonl_ids(output)) == sorted(f"s-{i}" for i in range(rows))

    got = query(
        database,
        "SELECT id, embedding::text, tenant FROM batch_vectors WHERE partition_key = %s",
        [batch.id],
    )
    assert len(got) == rows and {row_id for row_id, *_ in got} == set(expected)
    assert {tenant for *_, tenant in got} == {"acme"}
    for row_id, text, _ in got:
        held = np.array(text.strip("[]").split(","), dtype=np.float32)
        assert np.array_equal(held, np.array(expected[row_id], dtype=np.float32)), row_id
    assert query(database, "SELECT count(*) FROM batch_vectors") == [(rows,)]
    assert query(database, "SELECT partition_key, rows FROM batch_vectors_partitions") == [
        (batch.id, rows)
    ]
    assert query(
        database,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = 'batch_vectors'::regclass AND attname = 'embedding'",
    ) == [("vector(384)",)]
    run = finished_run(stack.instance(), batch.id)
    assert run.tags["gpuinfer/tenant"] == "acme"
