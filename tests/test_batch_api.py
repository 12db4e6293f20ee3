"""The OpenAI Batch API service without an engine: the official `openai` SDK against the
live service on loopback, over a real Dagster instance, a real SQLite (and one PostgreSQL)
store and chunk markers written by the storage layer's own calls."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import dagster as dg
import openai
import pytest
from batch_api_support import client, jsonl_ids, live_service, request_lines, write_chunk
from support import fresh_postgres_database

from dagster_gpuinfer import GpuInferenceResource
from dagster_gpuinfer.batch_api.__main__ import main as cli_main
from dagster_gpuinfer.batch_api.files import FileBytes
from dagster_gpuinfer.batch_api.pipelines import batch_pipelines
from dagster_gpuinfer.batch_api.routing import RoutingTable, load_routing_table
from dagster_gpuinfer.batch_api.service import BatchService
from dagster_gpuinfer.batch_api.store import BatchStore
from dagster_gpuinfer.batch_api.tags import BATCH_ID_TAG, QUEUE_TAG, TENANT_TAG
from dagster_gpuinfer.storage import Manifest, commit_partition

ROUTES = RoutingTable(
    routes=[
        {
            "model": "mini",
            "endpoint": "/v1/embeddings",
            "pipeline": "batch_embed",
            "model_path": "/models/not-loaded-here",
        },
        {
            "model": "tiny",
            "endpoint": "/v1/chat/completions",
            "pipeline": "batch_chat",
            "model_path": "/models/not-loaded-here-either",
        },
    ]
)


def make_service(tmp_path, instance, store_url=None, **limits) -> BatchService:
    return BatchService(
        store=BatchStore(store_url or f"sqlite:///{tmp_path}/store.sqlite"),
        files=FileBytes(str(tmp_path / "files")),
        routes=ROUTES,
        instance=instance,
        **limits,
    )


@pytest.fixture
def service(tmp_path, instance):
    svc = make_service(tmp_path, instance)
    yield svc
    svc.store.close()


@pytest.fixture
def api(service):
    with live_service(service) as base_url:
        yield base_url


def upload(sdk, data: bytes, name: str = "in.jsonl"):
    return sdk.files.create(file=(name, data), purpose="batch")


def test_sdk_uploads_creates_and_pages_batches_with_after(service, api):
    key = service.store.create_key("acme").token
    sdk = client(api, key)
    uploaded = upload(sdk, request_lines(3, model="mini"))
    assert uploaded.purpose == "batch" and uploaded.bytes == len(request_lines(3, model="mini"))
    assert sdk.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert sdk.files.content(uploaded.id).read() == request_lines(3, model="mini")
    created = [
        sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"n": str(i)},
        )
        for i in range(5)
    ]
    assert {b.status for b in created} == {"in_progress"}
    assert created[0].request_counts.total == 3 and created[0].model == "mini"
    first = sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == [created[4].id, created[3].id]
    assert first.has_more
    second = sdk.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == [created[2].id, created[1].id]
    last = sdk.batches.list(limit=2, after=second.data[-1].id)
    assert [b.id for b in last.data] == [created[0].id] and not last.has_more
    # The SDK's auto-pagination follows `after` to the end: every batch once.
    assert [b.id for b in sdk.batches.list(limit=2)] == [b.id for b in reversed(created)]
    assert sdk.batches.retrieve(created[1].id).metadata == {"n": "1"}
    # The batch's input was copied to its own shard: deleting the upload does not touch it.
    assert sdk.files.delete(uploaded.id).deleted
    shard = service.files.input_template.replace("{partition_key}", created[0].id)
    assert service.files.read(shard) == request_lines(3, model="mini")


def test_malformed_file_fails_validation_naming_each_line(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    good = json.loads(request_lines(1, model="mini"))
    lines = [
        json.dumps(good),  # line 1: fine
        "{not json",  # line 2
        json.dumps({**good, "custom_id": None}),  # line 3
        json.dumps(good),  # line 4: duplicate custom_id
        json.dumps({**good, "custom_id": "u", "url": "/v1/chat/completions"}),  # line 5
        json.dumps({**good, "custom_id": "m", "body": {"model": "gpt-6", "input": "x"}}),  # 6
    ]
    uploaded = upload(sdk, "\n".join(lines).encode())
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    found = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "mismatched_endpoint", "url"),
        (6, "model_not_found", "body.model"),
    ]
    assert "line 6" in batch.errors.data[-1].message and "mini" in batch.errors.data[-1].message
    # Nothing was queued: no input shard, and the sensor has nothing to run.
    shard = service.files.input_template.replace("{partition_key}", batch.id)
    assert not os.path.exists(shard)


def test_limits_on_requests_and_bytes(tmp_path, instance):
    limited = make_service(tmp_path, instance, max_requests=3, max_bytes=2000)
    with live_service(limited) as base_url:
        sdk = client(base_url, limited.store.create_key("acme").token)
        many = upload(sdk, request_lines(4, model="mini"))
        batch = sdk.batches.create(
            input_file_id=many.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        assert batch.status == "failed"
        assert [(e.code, e.line) for e in batch.errors.data] == [("too_many_requests", 4)]
        with pytest.raises(openai.APIStatusError) as too_big:
            upload(sdk, request_lines(40, model="mini"))
        assert too_big.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            sdk.post("/batches", body={"endpoint": "/v1/embeddings"}, cast_to=object)
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            ok = upload(sdk, request_lines(1, model="mini"))
            sdk.batches.create(
                input_file_id=ok.id, endpoint="/v1/moderations", completion_window="24h"
            )
    limited.store.close()


def test_every_endpoint_answers_401_for_bad_keys_and_404_across_tenants(service, api):
    a = client(api, service.store.create_key("tenant-a").token)
    b_key = service.store.create_key("tenant-b")
    b = client(api, b_key.token)
    uploaded = upload(a, request_lines(2, model="mini"))
    batch = a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    calls = {
        "files.create": lambda c: upload(c, request_lines(1, model="mini")),
        "files.list": lambda c: c.files.list().data,
        "files.retrieve": lambda c: c.files.retrieve(uploaded.id),
        "files.content": lambda c: c.files.content(uploaded.id).read(),
        "files.delete": lambda c: c.files.delete(uploaded.id),
        "batches.create": lambda c: c.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        ),
        "batches.retrieve": lambda c: c.batches.retrieve(batch.id),
        "batches.cancel": lambda c: c.batches.cancel(batch.id),
        "batches.list": lambda c: c.batches.list().data,
    }
    revoked = service.store.create_key("tenant-a")
    assert service.store.revoke_key(revoked.key_id)
    forged = b_key.token[:-4] + "AAAA"
    for token in ("", "sk-nonsense", forged, revoked.token):
        for name, call in calls.items():
            with pytest.raises(openai.AuthenticationError):
                call(client(api, token) if token else _no_key_client(api))
                pytest.fail(f"{name} answered without a valid key ({token[:10]!r})")
    owned_elsewhere = {
        "files.retrieve",
        "files.content",
        "files.delete",
        "batches.create",
        "batches.retrieve",
        "batches.cancel",
    }
    for name in owned_elsewhere:
        with pytest.raises(openai.NotFoundError):
            calls[name](b)
            pytest.fail(f"{name} let tenant-b reach tenant-a's object")
    assert calls["files.list"](b) == [] and calls["batches.list"](b) == []
    # tenant-a still has everything tenant-b tried to touch.
    assert a.batches.retrieve(batch.id).status == "in_progress"
    assert a.files.retrieve(uploaded.id).id == uploaded.id


def _no_key_client(base_url):
    import httpx

    class NoKey:
        """The SDK always sends a key; a bare HTTP client sends none."""

        def __getattr__(self, _):
            raise openai.AuthenticationError("no key", response=_response(), body=None)

    def _response():
        return httpx.Response(401, request=httpx.Request("GET", base_url))

    answer = httpx.get(f"{base_url}/batches")
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    return _Wrapped(NoKey())


class _Wrapped:
    def __init__(self, inner):
        self.files = inner
        self.batches = inner


def test_request_counts_rise_with_chunk_markers_and_completion_serves_the_files(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(6, model="mini"))
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.request_counts.completed == 0 and batch.usage.total_tokens == 0
    fs, path, first = write_chunk(service, "batch_embed", batch.id, 0, ["req-0", "req-1"])
    service.reconcile_all()  # a pass of the service's reconcile loop (GETs only read)
    running = sdk.batches.retrieve(batch.id)
    assert running.request_counts.completed == 2
    assert (running.usage.input_tokens, running.usage.output_tokens) == (14, 6)
    assert running.usage.total_tokens == 20
    _, _, second = write_chunk(
        service, "batch_embed", batch.id, 1, ["req-2", "req-3", "req-4"], bad=["req-5"]
    )
    service.reconcile_all()
    now = sdk.batches.retrieve(batch.id)
    assert (now.status, now.request_counts.completed, now.request_counts.failed) == (
        "in_progress",
        5,
        1,
    )
    manifest = Manifest(
        partition_key=batch.id,
        spec_hash=first.spec_hash,
        model="m",
        task="embed",
        output_format="openai_batch",
        rows_in=6,
        rows_out=5,
        rows_errored=1,
        prompt_tokens=35,
        generated_tokens=15,
        parts=[first.part, second.part],
        errors=first.part,
    )
    import pyarrow.parquet as pq

    errors = pq.read_table(f"{path}/_chunks/{first.spec_hash}/{second.errors.name}")
    commit_partition(fs, path, manifest, [errors], openai_errors=b'{"custom_id": "req-5"}\n')
    service.reconcile_all()
    done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (
        35,
        15,
        50,
    )
    output = sdk.files.content(done.output_file_id).read()
    assert jsonl_ids(output) == ["req-0", "req-1", "req-2", "req-3", "req-4"]
    assert jsonl_ids(sdk.files.content(done.error_file_id).read()) == ["req-5"]
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_cancel_keeps_committed_chunks_as_partial_output(service, api, caplog):
    caplog.set_level(logging.INFO, logger="dagster_gpuinfer.batch_api.audit")
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(6, model="mini"))
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    write_chunk(service, "batch_embed", batch.id, 0, ["req-0", "req-1"], bad=["req-2"])
    cancelled = sdk.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelling_at is not None
    assert (cancelled.request_counts.completed, cancelled.request_counts.failed) == (2, 1)
    assert jsonl_ids(sdk.files.content(cancelled.output_file_id).read()) == ["req-0", "req-1"]
    error_lines = sdk.files.content(cancelled.error_file_id).read().splitlines()
    assert [json.loads(line)["error"]["code"] for line in error_lines] == ["too_long"]
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)
    actions = [json.loads(r.getMessage()) for r in caplog.records]
    assert [(a["action"], a["tenant"]) for a in actions] == [
        ("file.create", "acme"),
        ("batch.create", "acme"),
        ("batch.cancel", "acme"),
    ]
    assert actions[2]["id"] == batch.id


def test_batch_expires_after_its_window_with_partial_output(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(4, model="mini"))
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="2s"
    )
    assert batch.expires_at == batch.created_at + 2
    write_chunk(service, "batch_embed", batch.id, 0, ["req-0"])
    assert sdk.batches.retrieve(batch.id).status == "in_progress"
    time.sleep(2.2)
    service.reconcile_all()  # the service's own loop, run once here
    expired = sdk.batches.retrieve(batch.id)
    assert expired.status == "expired" and expired.expired_at is not None
    assert jsonl_ids(sdk.files.content(expired.output_file_id).read()) == ["req-0"]
    assert expired.error_file_id is None


def test_sensor_requests_one_run_per_batch_tagged_with_tenant_and_queue(service, tmp_path):
    key = service.store.create_key("acme", kueue_queue="acme-gpu")
    tenant = service.store.authenticate(key.token)
    source = service.upload(
        tenant,
        filename="in.jsonl",
        purpose="batch",
        data=request_lines(2, model="tiny", url="/v1/chat/completions"),
    )
    batch = service.create_batch(
        tenant,
        input_file_id=source["id"],
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )
    failed = service.create_batch(
        tenant,
        input_file_id=source["id"],
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata=None,
    )
    assert failed["status"] == "failed"
    pipelines = batch_pipelines(
        ROUTES, files_root=str(tmp_path / "files"), store_url=service.store.url
    )
    defs = dg.Definitions.merge(
        pipelines.defs, dg.Definitions(resources={"gpu": GpuInferenceResource()})
    )
    instance = service.instance
    context = dg.build_sensor_context(instance=instance, definitions=defs)
    result = pipelines.sensor(context)  # the sensor's own result, as the daemon gets it
    [request] = result.run_requests
    assert request.run_key == batch["id"] and request.partition_key == batch["id"]
    assert request.job_name == "batch_chat_job"
    assert request.tags[BATCH_ID_TAG] == batch["id"]
    assert (request.tags[TENANT_TAG], request.tags[QUEUE_TAG]) == ("acme", "acme-gpu")
    [partitions] = result.dynamic_partitions_requests
    assert (partitions.partitions_def_name, list(partitions.partition_keys)) == (
        "batch_chat_batches",
        [batch["id"]],
    )
    # Once the partition exists, the same batch is requested under the same run key: the
    # daemon launches it once.
    instance.add_dynamic_partitions("batch_chat_batches", [batch["id"]])
    again = pipelines.sensor(context)
    assert [r.run_key for r in again.run_requests] == [batch["id"]]
    assert not again.dynamic_partitions_requests
    job = defs.resolve_job_def("batch_chat_job")
    spec = pipelines.pipelines["batch_chat"].spec
    assert spec["input"]["format"] == "openai_batch" and spec["output"]["format"] == "openai_batch"
    assert job.partitions_def.name == "batch_chat_batches"


def test_run_queue_tag_sets_the_worker_pods_kueue_queue():
    from dagster_gpuinfer.k8s.config import K8sLauncherConfig, WorkerPlacement
    from dagster_gpuinfer.resource import RUN_QUEUE_TAG, config_for_run_queue

    assert RUN_QUEUE_TAG == QUEUE_TAG
    config = K8sLauncherConfig(
        image="worker:1", namespace="gpu", placement=WorkerPlacement(kueue_queue="shared")
    )
    assert config_for_run_queue(config, {}).placement.kueue_queue == "shared"
    tenant = config_for_run_queue(config, {QUEUE_TAG: "acme-gpu"})
    assert tenant.placement.kueue_queue == "acme-gpu" and tenant.image == "worker:1"


def test_keys_cli_creates_lists_and_revokes(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/keys.sqlite"
    assert (
        cli_main(["--store-url", url, "keys", "create", "--tenant", "acme", "--queue", "q1"]) == 0
    )
    created = json.loads(capsys.readouterr().out)
    store = BatchStore(url)
    who = store.authenticate(created["api_key"])
    assert (who.name, who.kueue_queue, who.key_id) == ("acme", "q1", created["key_id"])
    assert cli_main(["--store-url", url, "keys", "list"]) == 0
    [listed] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert listed["key_id"] == created["key_id"] and "digest" not in listed
    assert created["api_key"].split(".")[1] not in open(
        f"{tmp_path}/keys.sqlite", "rb"
    ).read().decode("latin-1")
    assert cli_main(["--store-url", url, "keys", "revoke", created["key_id"]]) == 0
    assert store.authenticate(created["api_key"]) is None
    assert cli_main(["--store-url", url, "keys", "revoke", created["key_id"]]) == 1
    store.close()


def test_routing_table_loads_from_yaml_and_refuses_duplicates(tmp_path):
    path = tmp_path / "routes.yaml"
    path.write_text(
        "routes:\n"
        "  - {model: a, endpoint: /v1/embeddings, pipeline: p_a, model_path: /m/a}\n"
        "  - {model: b, endpoint: /v1/rerank, pipeline: p_b, model_path: /m/b}\n"
    )
    table = load_routing_table(str(path))
    assert table.route_for("b", "/v1/rerank").task == "score"
    assert load_routing_table("assets.batch_pipelines:ROUTES").route_for(
        "tiny-llama", "/v1/chat/completions"
    )
    path.write_text(
        "- {model: a, endpoint: /v1/embeddings, pipeline: p_a, model_path: /m/a}\n"
        "- {model: a, endpoint: /v1/embeddings, pipeline: p_b, model_path: /m/b}\n"
    )
    with pytest.raises(ValueError, match="lists model 'a' on /v1/embeddings twice"):
        load_routing_table(str(path))
    with pytest.raises(ValueError, match="not served by the worker"):
        RoutingTable(
            routes=[{"model": "a", "endpoint": "/v1/x", "pipeline": "p", "model_path": "/m"}]
        )


def test_a_route_serves_chat_lines_with_images_through_the_vision_chat_task(tmp_path, instance):
    """/v1/chat/completions is chat's unless a route names `task: vision_chat`: its batch
    pipeline then reads the lines' image_url parts under the route's image limits."""
    path = tmp_path / "routes.yaml"
    path.write_text(
        "routes:\n"
        "  - {model: text, endpoint: /v1/chat/completions, pipeline: p_text, model_path: /m/t}\n"
        "  - model: seeing\n"
        "    endpoint: /v1/chat/completions\n"
        "    pipeline: p_seeing\n"
        "    model_path: /m/vlm\n"
        "    task: vision_chat\n"
        "    images: {max_image_pixels: 1000000, allowed_url_hosts: [images.example.com]}\n"
    )
    table = load_routing_table(str(path))
    assert [r.task for r in table.routes] == ["chat", "vision_chat"]
    built = batch_pipelines(table, files_root=str(tmp_path / "files"))
    spec = built.pipelines["p_seeing"].spec
    assert spec["task"] == "vision_chat"
    assert spec["input"]["images"]["max_image_pixels"] == 1_000_000
    assert spec["input"]["images"]["allowed_url_hosts"] == ["images.example.com"]
    assert built.pipelines["p_text"].spec["task"] == "chat"
    svc = BatchService(
        store=BatchStore(f"sqlite:///{tmp_path}/store.sqlite"),
        files=FileBytes(str(tmp_path / "files")),
        routes=table,
        instance=instance,
    )
    with live_service(svc) as base_url:
        sdk = client(base_url, svc.store.create_key("acme").token)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        line = {
            "custom_id": "c-0",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "seeing",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}
                ],
            },
        }
        uploaded = upload(sdk, (json.dumps(line) + "\n").encode())
        batch = sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "in_progress"
        assert svc.store.get_batch(batch.id)["pipeline"] == "p_seeing"
    svc.store.close()
    base = {"model": "a", "endpoint": "/v1/chat/completions", "pipeline": "p", "model_path": "/m"}
    for bad, message in [
        ({"task": "embed"}, r"task 'embed' does not serve /v1/chat/completions"),
        ({"images": {"max_image_pixels": 10}}, "`images` is for image tasks"),
        ({"task": "vision_chat", "images": {"max_pixels": 10}}, "images.max_pixels"),
    ]:
        with pytest.raises(ValueError, match=message):
            RoutingTable(routes=[{**base, **bad}])


def test_postgres_as_the_store(tmp_path, instance):
    with fresh_postgres_database("batch") as url:
        svc = make_service(tmp_path, instance, store_url=url)
        with live_service(svc) as base_url:
            sdk = client(base_url, svc.store.create_key("acme").token)
            uploaded = upload(sdk, request_lines(3, model="mini"))
            ids = [
                sdk.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
                ).id
                for _ in range(3)
            ]
            page = sdk.batches.list(limit=2)
            assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
            write_chunk(svc, "batch_embed", ids[0], 0, ["req-0", "req-1"])
            svc.reconcile_all()
            assert sdk.batches.retrieve(ids[0]).request_counts.completed == 2
            assert sdk.batches.cancel(ids[0]).status == "cancelled"
        _finalizers_race_to_publish_one_file(svc.store)
        svc.store.close()


def _finalizers_race_to_publish_one_file(store) -> None:
    """Eight finalizers publish one output file at once (a poll, the reconcile loop, other
    replicas): every one succeeds and one row is left, holding one of their records."""
    record = {
        "id": "file-race-output",
        "tenant": "acme",
        "purpose": "batch_output",
        "filename": "race_output.jsonl",
        "created_at": 1,
        "status": "processed",
        "path": "/nowhere",
    }
    start = threading.Barrier(8)

    def publish(size: int) -> None:
        start.wait()
        store.put_file({**record, "bytes": size})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(publish, range(8)))  # re-raises a finalizer's error
    files, _ = store.list_files("acme")
    [row] = [f for f in files if f["id"] == record["id"]]
    assert row["bytes"] in range(8) and row["filename"] == record["filename"]


def test_health_answers_without_a_key(api):
    import httpx

    answer = httpx.get(api.removesuffix("/v1") + "/health", timeout=10)
    assert answer.status_code == 200 and answer.json() == {"status": "ok"}


def test_the_service_and_the_batch_pipelines_import_no_torch_or_vllm():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dagster_gpuinfer.batch_api.app, dagster_gpuinfer.batch_api.__main__\n"
        "import dagster_gpuinfer.batch_api.pipelines, assets.batch_pipelines\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("torch", "vllm", "transformers"))
    assert not heavy, f"the batch API imported {heavy[:5]}"


def test_a_failed_run_fails_the_batch_with_its_committed_rows_as_partial_output(service, api):
    """A real run in the instance, tagged with the batch id, that fails (retries spent)."""
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(4, model="mini"))
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    write_chunk(service, "batch_embed", batch.id, 0, ["req-0", "req-1"])

    @dg.op
    def lose_the_worker():
        raise RuntimeError("the worker pod was evicted")

    @dg.job(tags={BATCH_ID_TAG: batch.id})
    def batch_run():
        lose_the_worker()

    result = batch_run.execute_in_process(instance=service.instance, raise_on_error=False)
    assert not result.success
    service.reconcile_all()
    failed = sdk.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.failed_at is not None
    [error] = failed.errors.data
    assert error.code == "run_failed" and result.run_id in error.message
    assert jsonl_ids(sdk.files.content(failed.output_file_id).read()) == ["req-0", "req-1"]
    assert failed.request_counts.completed == 2


def test_a_batch_left_validating_by_a_dead_service_fails_instead_of_hanging(service, api):
    key = service.store.create_key("acme")
    sdk = client(api, key.token)
    uploaded = upload(sdk, request_lines(1, model="mini"))
    long_ago = int(time.time()) - 3600
    service.store.add_batch(
        {
            "id": "batch_interrupted",
            "tenant": "acme",
            "endpoint": "/v1/embeddings",
            "input_file_id": uploaded.id,
            "completion_window": "24h",
            "status": "validating",
            "created_at": long_ago,
            "expires_at": long_ago + 86400,
        }
    )
    service.reconcile_all()
    batch = sdk.batches.retrieve("batch_interrupted")
    assert batch.status == "failed"
    assert [e.code for e in batch.errors.data] == ["validation_interrupted"]


def test_a_store_created_by_an_older_version_gains_the_new_columns(tmp_path):
    """`create_all` adds tables, not columns: a database from before `usage` gets the
    token columns added, keeps its rows, and serves them (usage null until counted)."""
    import sqlalchemy as sa

    from dagster_gpuinfer.batch_api.store import BATCHES, BatchStore

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    old = sa.MetaData()
    columns = [c.copy() for c in BATCHES.columns if c.name not in ("input_tokens", "output_tokens")]
    sa.Table(BATCHES.name, old, *columns)
    engine = sa.create_engine(url)
    old.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {BATCHES.name} (id, tenant, endpoint, input_file_id, "
                "completion_window, status, total, completed, failed) "
                "VALUES ('batch_old', 'acme', '/v1/embeddings', 'file-1', '24h', 'completed', "
                "2, 2, 0)"
            )
        )
    engine.dispose()
    store = BatchStore(url)
    names = {c["name"] for c in sa.inspect(store.engine).get_columns(BATCHES.name)}
    assert {"input_tokens", "output_tokens"} <= names
    record = store.get_batch("batch_old")
    assert record["completed"] == 2 and record["input_tokens"] is None
    assert store.update_batch("batch_old", input_tokens=5, output_tokens=1)
    assert store.get_batch("batch_old")["input_tokens"] == 5
    BatchStore(url).close()  # a second open is a no-op


def test_openapi_has_a_response_schema_for_every_route(service):
    """/openapi.json is the contract: every route answers a declared model (or, for file
    content, declared bytes), every error the routers document is OpenAI's shape, and no
    route documents FastAPI's 422, which this app answers as OpenAI's 400."""
    from fastapi.testclient import TestClient

    from dagster_gpuinfer.batch_api.app import create_app

    document = TestClient(create_app(service, reconcile_interval=None)).get("/openapi.json").json()
    components = document["components"]["schemas"]
    routes = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    assert routes == {
        ("POST", "/v1/files"),
        ("GET", "/v1/files"),
        ("GET", "/v1/files/{file_id}"),
        ("GET", "/v1/files/{file_id}/content"),
        ("DELETE", "/v1/files/{file_id}"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches"),
        ("GET", "/v1/batches/{batch_id}"),
        ("POST", "/v1/batches/{batch_id}/cancel"),
        ("GET", "/health"),
    }
    for (method, path), operation in (
        ((m.upper(), p), op) for p, ops in document["paths"].items() for m, op in ops.items()
    ):
        answers = operation["responses"]
        [(media, content)] = answers["200"]["content"].items()
        if media == "application/json":
            assert content["schema"]["$ref"].rsplit("/", 1)[-1] in components, (method, path)
        else:
            assert (media, content["schema"]) == (
                "application/jsonl",
                {"type": "string", "format": "binary"},
            )
        assert "422" not in answers, (method, path)
        if path != "/health":
            assert operation["security"] == [{"HTTPBearer": []}]
            for status in ("400", "401", "404"):
                error = answers[status]["content"]["application/json"]["schema"]["$ref"]
                assert error.endswith("/ErrorResponse"), (method, path, status)
    # The objects are the SDK's: every field it reads is in the schema.
    assert set(components["Batch"]["properties"]) == set(openai.types.Batch.model_fields)
    sdk_file = openai.types.FileObject.model_fields
    required = {name for name, field in sdk_file.items() if field.is_required()}
    assert required <= set(components["FileObject"]["properties"]) <= set(sdk_file)
    limits = {
        path: next(p for p in document["paths"][path]["get"]["parameters"] if p["name"] == "limit")
        for path in ("/v1/batches", "/v1/files")
    }
    assert {
        path: (p["schema"]["minimum"], p["schema"]["maximum"]) for path, p in limits.items()
    } == {
        "/v1/batches": (1, 100),
        "/v1/files": (1, 10_000),
    }


def test_limit_out_of_bounds_is_a_400_naming_limit(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    for call in (
        lambda: sdk.batches.list(limit=0),
        lambda: sdk.batches.list(limit=101),
        lambda: sdk.files.list(limit=0),
        lambda: sdk.files.list(limit=10_001),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == "limit" and refused.value.code == "invalid_request"
    assert sdk.batches.list(limit=100).data == [] and sdk.files.list(limit=10_000).data == []


def test_files_list_pages_with_after_limit_and_has_more(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    other = client(api, service.store.create_key("globex").token)
    ids = [upload(sdk, request_lines(1, model="mini"), f"in-{i}.jsonl").id for i in range(5)]
    upload(other, request_lines(1, model="mini"))
    first = sdk.files.list(limit=2)
    assert [f.id for f in first.data] == [ids[4], ids[3]] and first.has_more
    assert (first.first_id, first.last_id) == (ids[4], ids[3])
    second = sdk.files.list(limit=2, after=first.last_id)
    assert [f.id for f in second.data] == [ids[2], ids[1]] and second.has_more
    last = sdk.files.list(limit=2, after=second.last_id)
    assert [f.id for f in last.data] == [ids[0]] and not last.has_more
    # The SDK's auto-pagination follows `after` to the end, in either order.
    assert [f.id for f in sdk.files.list(limit=2)] == ids[::-1]
    assert [f.id for f in sdk.files.list(limit=2, order="asc")] == ids
    assert [f.id for f in sdk.files.list(purpose="batch_output")] == []
    assert len(other.files.list().data) == 1


def test_gets_of_a_batch_whose_run_finished_write_nothing(service, api, tmp_path):
    """A batch's run failed after committing a chunk: GETs of the batch, the lists and its
    files run only SELECTs (besides taking their key's rate-limit token, limits.py), leave
    the files root and the row as they were, and the batch stays in_progress until a pass
    of the reconcile loop, which finalizes it."""
    import sqlalchemy as sa

    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(4, model="mini"))
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    write_chunk(service, "batch_embed", batch.id, 0, ["req-0", "req-1"])

    @dg.job(tags={BATCH_ID_TAG: batch.id})
    def batch_run():
        _lose_the_worker()

    assert not batch_run.execute_in_process(instance=service.instance, raise_on_error=False).success
    statements: list[str] = []

    def record(_conn, _cursor, statement, *_):
        verb = statement.split(None, 1)[0].upper()
        if not (verb == "INSERT" and "INTO gpuinfer_batch_rate_buckets " in statement):
            statements.append(verb)

    def files_root() -> dict[str, tuple[int, int]]:
        return {
            str(path): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in (tmp_path / "files").rglob("*")
        }

    row, tree = service.store.get_batch(batch.id), files_root()
    sa.event.listen(service.store.engine, "before_cursor_execute", record)
    try:
        for _ in range(2):
            assert sdk.batches.retrieve(batch.id).status == "in_progress"
            assert [b.id for b in sdk.batches.list().data] == [batch.id]
            assert [f.id for f in sdk.files.list().data] == [uploaded.id]
            assert sdk.files.retrieve(uploaded.id).id == uploaded.id
            assert sdk.files.content(uploaded.id).read() == request_lines(4, model="mini")
    finally:
        sa.event.remove(service.store.engine, "before_cursor_execute", record)
    assert statements and set(statements) == {"SELECT"}
    assert service.store.get_batch(batch.id) == row and files_root() == tree
    service.reconcile_all()  # the loop, not a GET, finalizes it
    failed = sdk.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.output_file_id is not None
    assert files_root() != tree


@dg.op
def _lose_the_worker():
    raise RuntimeError("the worker pod was evicted")


def test_a_run_requested_before_its_batch_was_cancelled_is_stopped(service, tmp_path):
    """The sensor reads a batch in progress; the batch is cancelled before its run exists
    (finalized as cancelled: nothing to stop yet); then the daemon creates the run the sensor
    requested. The reconcile loop stops that run, and leaves the run of a live batch alone."""
    tenant = service.store.authenticate(service.store.create_key("acme").token)
    source = service.upload(
        tenant, filename="in.jsonl", purpose="batch", data=request_lines(2, model="mini")
    )

    def create() -> dict:
        return service.create_batch(
            tenant,
            input_file_id=source["id"],
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata=None,
        )

    doomed, live = create(), create()
    pipelines = batch_pipelines(
        ROUTES, files_root=str(tmp_path / "files"), store_url=service.store.url
    )
    defs = dg.Definitions.merge(
        pipelines.defs, dg.Definitions(resources={"gpu": GpuInferenceResource()})
    )
    context = dg.build_sensor_context(instance=service.instance, definitions=defs)
    requests = {r.run_key: r for r in pipelines.sensor(context).run_requests}
    assert set(requests) == {doomed["id"], live["id"]}
    assert service.cancel(tenant, doomed["id"])["status"] == "cancelled"
    runs = {}
    for batch_id, request in requests.items():  # the daemon launches what was requested
        run = dg.DagsterRun(
            job_name=request.job_name,
            run_id=str(uuid.uuid4()),
            tags={**request.tags, "dagster/partition": batch_id},
            status=dg.DagsterRunStatus.NOT_STARTED,
        )
        runs[batch_id] = service.instance.add_run(run).run_id
    service.reconcile_all()  # a pass of the service's reconcile loop
    status = {b: service.instance.get_run_by_id(r).status for b, r in runs.items()}
    # No process runs these records, so the launcher can only mark the stop as asked for.
    assert status == {
        doomed["id"]: dg.DagsterRunStatus.CANCELING,
        live["id"]: dg.DagsterRunStatus.NOT_STARTED,
    }
    assert service.batch(tenant, doomed["id"])["status"] == "cancelled"
    assert service.batch(tenant, live["id"])["status"] == "in_progress"


def test_serve_refuses_a_reconcile_interval_that_would_never_move_batches(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--reconcile-interval", "0"])
    assert "batches move only through the reconcile loop" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["local", "s3"])
def test_file_bytes_stream_a_file_in_reads_of_bounded_size(tmp_path, s3_server, where):
    from dagster_gpuinfer.batch_api.files import READ_BYTES
    from dagster_gpuinfer.spec import StorageOptions

    if where == "local":
        files = FileBytes(str(tmp_path / "files"))
    else:
        storage = StorageOptions(
            endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
        )
        files = FileBytes(f"s3://{s3_server.new_bucket('stream')}/api", storage)
    data = os.urandom(2 * READ_BYTES + 123)
    files.write(files.file_uri("file-a"), data)
    size, chunks = files.stream(files.file_uri("file-a"))
    blocks = list(chunks)
    assert size == len(data) and b"".join(blocks) == data
    assert max(len(block) for block in blocks) <= READ_BYTES
    with pytest.raises(OSError):  # gone from the storage: raised before a byte is sent
        files.stream(files.file_uri("file-gone"))
