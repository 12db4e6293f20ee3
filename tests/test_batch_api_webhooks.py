"""Batch webhooks, output expiry and the output lines' model, without an engine: the live
batch API on loopback, a real HTTP receiver on loopback that verifies every event with the
openai SDK's `webhooks.unwrap` (and refuses the first try of each, so every event is
retried), batches finished through chunk markers and manifests written by the storage
layer's own calls, as test_batch_api.py drives them."""

from __future__ import annotations

import base64
import json
import time
from collections import Counter

import openai
import pytest
from batch_api_support import (
    Receiver,
    client,
    jsonl_ids,
    live_service,
    request_lines,
    write_chunk,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.webhooks import (
    BatchCancelledWebhookEvent,
    BatchCompletedWebhookEvent,
    BatchExpiredWebhookEvent,
    BatchFailedWebhookEvent,
)
from support import fresh_postgres_database
from test_batch_api import ROUTES, make_service, upload

from dagster_gpuinfer.batch_api.__main__ import build_service
from dagster_gpuinfer.batch_api.pipelines import batch_pipelines
from dagster_gpuinfer.batch_api.webhooks import (
    WebhookSettings,
    load_webhook_settings,
    new_secret,
    signed_headers,
)
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest, commit_partition

EVENT_CLASSES = {
    "batch.completed": BatchCompletedWebhookEvent,
    "batch.cancelled": BatchCancelledWebhookEvent,
    "batch.expired": BatchExpiredWebhookEvent,
    "batch.failed": BatchFailedWebhookEvent,
}


def fast_retries(tenants: dict) -> WebhookSettings:
    return WebhookSettings.model_validate(
        {
            "tenants": tenants,
            "first_retry_seconds": 0.2,
            "max_retry_seconds": 1.0,
            "send_interval_seconds": 0.1,
            "timeout_seconds": 5,
        }
    )


def complete(service, batch_id: str, ids: list[str]) -> None:
    """Commit the batch's partition (one chunk, its manifest) as the worker does."""
    fs, path, marker = write_chunk(service, "batch_embed", batch_id, 0, ids)
    manifest = Manifest(
        partition_key=batch_id,
        spec_hash=marker.spec_hash,
        model="m",
        task="embed",
        output_format="openai_batch",
        rows_in=len(ids),
        rows_out=len(ids),
        rows_errored=0,
        prompt_tokens=7 * len(ids),
        generated_tokens=0,
        parts=[marker.part],
        errors=marker.part,
    )
    commit_partition(fs, path, manifest, [])


def wait_for(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {seconds} s")
        time.sleep(0.1)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """The store on SQLite, and on a fresh database of the test PostgreSQL server (the
    outbox's claim compares a float column: both dialects must round-trip it exactly)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/store.sqlite"
        return
    with fresh_postgres_database("webhooks") as url:
        yield url


def test_each_finished_batch_sends_one_signed_event_delivered_after_a_failed_try(
    tmp_path, instance, monkeypatch, store_url
):
    acme_secret, beta_secret = new_secret(), new_secret()
    monkeypatch.setenv("ACME_WHSEC", acme_secret)
    monkeypatch.setenv("BETA_WHSEC", beta_secret)
    with Receiver({"/acme": acme_secret, "/beta": beta_secret}) as receiver:
        hooks = fast_retries(
            {
                "acme": [{"url": receiver.url("/acme"), "secret_env": "ACME_WHSEC"}],
                "beta": [{"url": receiver.url("/beta"), "secret_env": "BETA_WHSEC"}],
            }
        )
        service = make_service(tmp_path, instance, store_url=store_url)
        service.webhooks = hooks
        with live_service(service) as api:
            sdk = client(api, service.store.create_key("acme").token)
            beta = client(api, service.store.create_key("beta").token)
            batches = drive_four_endings(service, sdk, beta)
            service.reconcile_all()  # passes after the end change nothing and send nothing
            service.reconcile_all()
            wait_for(lambda: len(receiver.taken()) == 5, "five events taken")
            time.sleep(1.5)  # any duplicate delivery would come within the retry backoff
        assert_one_verified_event_each(service, receiver, batches)
        assert_no_secret_stored(service, [acme_secret, beta_secret])
    service.store.close()


def assert_no_secret_stored(service, secrets: list[str]) -> None:
    """The outbox names endpoints; neither the secrets nor their keys are in the store."""
    import sqlalchemy as sa

    from dagster_gpuinfer.batch_api.store import METADATA

    with service.store.engine.connect() as conn:
        stored = "".join(
            repr(row) for table in METADATA.sorted_tables for row in conn.execute(sa.select(table))
        )
    assert "webhook_deliveries" in str(METADATA.tables) and "wh_" in stored
    for secret in secrets:
        assert secret not in stored and secret.removeprefix("whsec_") not in stored


def drive_four_endings(service, sdk, beta) -> dict[str, tuple[str, str]]:
    """Batches of tenant acme that complete, are cancelled, expire and fail validation, and
    one of tenant beta that completes; returns {batch id: (tenant path, event type)}."""
    good = upload(sdk, request_lines(2, model="mini"))

    def create(client_, window="24h", file_id=good.id):
        return client_.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window=window
        )

    completed, cancelled, expiring = create(sdk), create(sdk), create(sdk, window="2s")
    failed = create(sdk, file_id=upload(sdk, b"{not json\n").id)
    assert failed.status == "failed"
    other = create(beta, file_id=upload(beta, request_lines(1, model="mini")).id)
    complete(service, completed.id, ["req-0", "req-1"])
    complete(service, other.id, ["req-0"])
    assert sdk.batches.cancel(cancelled.id).status == "cancelled"
    time.sleep(2.2)
    service.reconcile_all()
    assert sdk.batches.retrieve(completed.id).status == "completed"
    assert sdk.batches.retrieve(expiring.id).status == "expired"
    return {
        completed.id: ("/acme", "batch.completed"),
        cancelled.id: ("/acme", "batch.cancelled"),
        expiring.id: ("/acme", "batch.expired"),
        failed.id: ("/acme", "batch.failed"),
        other.id: ("/beta", "batch.completed"),
    }


def assert_one_verified_event_each(service, receiver, batches) -> None:
    taken = receiver.taken()
    events = {}
    for path, headers, body in taken:
        secret = receiver.secrets[path]
        sdk = openai.OpenAI(api_key="not-used", base_url="http://127.0.0.1:9/v1")
        event = sdk.webhooks.unwrap(body, headers, secret=secret)
        expected_path, expected_type = batches[event.data.id]
        assert (path, event.type, event.object) == (expected_path, expected_type, "event")
        assert isinstance(event, EVENT_CLASSES[event.type])
        record = service.store.get_batch(event.data.id)
        assert event.created_at == record[f"{record['status']}_at"]
        events[event.data.id] = (event.id, headers["webhook-id"])
    # One event per batch, and every one was taken once: by its second try.
    assert sorted(events) == sorted(batches) and len(taken) == len(batches)
    tries = Counter(headers["webhook-id"] for _, headers, _, _ in receiver.requests)
    assert sorted(tries.values()) == [2] * len(batches)
    assert [status for *_, status in receiver.requests].count(500) == len(batches)
    # Another tenant's secret does not verify an event: secrets are per tenant.
    path, headers, body = taken[0]
    wrong = receiver.secrets["/beta" if path == "/acme" else "/acme"]
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9/v1").webhooks.unwrap(
            body, headers, secret=wrong
        )
    for batch_id, (event_id, webhook_id) in events.items():
        [delivery] = service.store.deliveries(batch_id)
        assert (delivery["id"], delivery["event_id"]) == (webhook_id, event_id)
        assert delivery["attempts"] == 2 and delivery["delivered_at"] is not None


def test_an_endpoint_that_never_answers_is_retried_with_backoff_then_given_up(
    tmp_path, instance, monkeypatch, store_url
):
    monkeypatch.setenv("ACME_WHSEC", new_secret())
    hooks = fast_retries(
        {"acme": [{"url": "http://127.0.0.1:9/hooks", "secret_env": "ACME_WHSEC"}]}
    ).model_copy(update={"max_attempts": 4, "first_retry_seconds": 0.3})
    service = make_service(tmp_path, instance, store_url=store_url)
    service.webhooks = hooks
    tenant = service.store.authenticate(service.store.create_key("acme").token)
    source = service.upload(tenant, filename="in.jsonl", purpose="batch", data=b"{bad\n")
    batch = service.create_batch(
        tenant,
        input_file_id=source["id"],
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata=None,
    )
    tried_at = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        [delivery] = service.store.deliveries(batch["id"])
        if delivery["abandoned_at"] is not None:
            break
        if service.store.due_deliveries(time.time()):
            tried_at.append(time.monotonic())
            assert service.deliver_webhooks() == 0
        time.sleep(0.02)
    [delivery] = service.store.deliveries(batch["id"])
    assert delivery["attempts"] == 4 and delivery["abandoned_at"] is not None
    assert "Connection refused" in delivery["last_error"]
    gaps = [later - earlier for earlier, later in zip(tried_at, tried_at[1:], strict=False)]
    # Waits of 0.3 and 0.6 s (doubling), then 1.0 s (the cap, not 1.2), not a tight loop.
    assert [hooks.retry_delay(n) for n in (1, 2, 3, 4)] == [0.3, 0.6, 1.0, 1.0]
    assert len(gaps) == 3
    for gap, wait in zip(gaps, (0.3, 0.6, 1.0), strict=True):
        assert wait <= gap < wait + 2.0  # slack for a loaded machine; never below the wait
    assert service.store.due_deliveries(time.time() + 10**6) == []
    service.store.close()


def test_no_endpoints_no_events_and_a_batch_finishes_as_before(service_plain):
    service = service_plain
    tenant = service.store.authenticate(service.store.create_key("acme").token)
    source = service.upload(tenant, filename="in.jsonl", purpose="batch", data=b"{bad\n")
    batch = service.create_batch(
        tenant,
        input_file_id=source["id"],
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata=None,
    )
    assert batch["status"] == "failed"
    assert service.store.deliveries(batch["id"]) == []


@pytest.fixture
def service_plain(tmp_path, instance):
    service = make_service(tmp_path, instance)
    yield service
    service.store.close()


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=24, max_size=64),
    webhook_id=st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=80
    ),
    body=st.text(max_size=400),
    skew=st.integers(min_value=-250, max_value=250),
)
def test_signatures_verify_with_the_openai_sdk_and_fail_when_anything_changes(
    key, webhook_id, body, skew
):
    secret = "whsec_" + base64.b64encode(key).decode()
    timestamp = int(time.time()) + skew
    payload = body.encode()
    headers = signed_headers(secret, webhook_id, payload, timestamp)
    webhooks = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9/v1").webhooks
    webhooks.verify_signature(payload, headers, secret=secret)
    tampered = [
        (payload + b" ", headers, secret),
        (payload, {**headers, "webhook-id": webhook_id + "x"}, secret),
        (payload, {**headers, "webhook-timestamp": str(timestamp + 1)}, secret),
        (payload, headers, "whsec_" + base64.b64encode(bytes([key[0] ^ 1]) + key[1:]).decode()),
    ]
    for changed_payload, changed_headers, changed_secret in tampered:
        with pytest.raises(openai.InvalidWebhookSignatureError):
            webhooks.verify_signature(changed_payload, changed_headers, secret=changed_secret)


def test_settings_name_secret_variables_and_refuse_secrets_in_the_file(tmp_path, monkeypatch):
    path = tmp_path / "webhooks.yaml"
    path.write_text(
        "tenants:\n  acme:\n    - url: https://hooks.acme.example/b\n"
        "      secret_env: ACME_WHSEC\n      events: [batch.completed]\n"
    )
    monkeypatch.delenv("ACME_WHSEC", raising=False)
    monkeypatch.setenv("GPUINFER_BATCH_WEBHOOKS", str(path))
    hooks = load_webhook_settings()
    assert hooks.endpoints_for("acme", "batch.completed")[0].url.endswith("/b")
    assert hooks.endpoints_for("acme", "batch.failed") == []
    with pytest.raises(ValueError, match=r"\$ACME_WHSEC .*is not set"):
        build_service(None, f"sqlite:///{tmp_path}/s.sqlite", str(tmp_path / "files"))
    monkeypatch.setenv("ACME_WHSEC", "not-a-secret")
    with pytest.raises(ValueError, match="does not start with 'whsec_'"):
        hooks.check_secrets()
    monkeypatch.setenv("ACME_WHSEC", "whsec_" + base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="base64 of 24-64 bytes"):
        hooks.check_secrets()
    path.write_text(
        "tenants:\n  acme:\n    - url: https://hooks.acme.example/b\n"
        "      secret: whsec_AAAA\n      secret_env: ACME_WHSEC\n"
    )
    with pytest.raises(ValueError, match="secret"):
        load_webhook_settings(path)
    path.write_text("tenants:\n  acme:\n    - url: ftp://x\n      secret_env: A\n")
    with pytest.raises(ValueError, match="http"):
        load_webhook_settings(path)


def test_output_files_are_deleted_after_output_expires_after(tmp_path, instance):
    service = make_service(tmp_path, instance, output_expiry_seconds=(1, 3600))
    with live_service(service) as api:
        sdk = client(api, service.store.create_key("acme").token)
        uploaded = upload(sdk, request_lines(2, model="mini"))

        def create(**extra):
            return sdk.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/embeddings",
                completion_window="24h",
                **extra,
            )

        expiring = create(output_expires_after={"anchor": "created_at", "seconds": 2})
        kept = create()
        for batch in (expiring, kept):
            complete(service, batch.id, ["req-0", "req-1"])
        service.reconcile_all()
        done = sdk.batches.retrieve(expiring.id)
        output = sdk.files.retrieve(done.output_file_id)
        assert output.expires_at == output.created_at + 2
        assert jsonl_ids(sdk.files.content(done.output_file_id).read()) == ["req-0", "req-1"]
        stored = service.store.get_file(done.output_file_id, "acme")["path"]
        time.sleep(2.2)
        service.reconcile_all()
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(done.output_file_id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(done.output_file_id)
        with pytest.raises(FileNotFoundError):
            service.files.read(stored)
        # Without output_expires_after the output stays.
        output_of_kept = sdk.batches.retrieve(kept.id).output_file_id
        assert sdk.files.retrieve(output_of_kept).expires_at is None
        assert jsonl_ids(sdk.files.content(output_of_kept).read()) == ["req-0", "req-1"]
        for bad, param in (
            ({"anchor": "created_at", "seconds": 0}, "output_expires_after.seconds"),
            ({"anchor": "created_at", "seconds": 3601}, "output_expires_after.seconds"),
            ({"anchor": "last_active_at", "seconds": 60}, "output_expires_after.anchor"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                create(output_expires_after=bad)
            assert refused.value.body["param"] == param
    service.store.close()


def test_openai_bounds_on_output_expiry_and_metadata(service_plain):
    with live_service(service_plain) as api:
        sdk = client(api, service_plain.store.create_key("acme").token)
        uploaded = upload(sdk, request_lines(1, model="mini"))
        for seconds in (3599, 2592001):
            with pytest.raises(openai.BadRequestError, match="between 3600 and 2592000"):
                sdk.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/embeddings",
                    completion_window="24h",
                    output_expires_after={"anchor": "created_at", "seconds": seconds},
                )
        for metadata in (
            {f"k{i}": "v" for i in range(17)},
            {"k" * 65: "v"},
            {"k": "v" * 513},
        ):
            with pytest.raises(openai.BadRequestError, match="metadata"):
                sdk.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/embeddings",
                    completion_window="24h",
                    metadata=metadata,
                )
        most = {f"{i:x}".rjust(64, "k"): "v" * 512 for i in range(16)}
        batch = sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata=most,
            output_expires_after={"anchor": "created_at", "seconds": 3600},
        )
        assert sdk.batches.retrieve(batch.id).metadata == most


def test_batch_pipelines_name_the_requested_model_in_output_lines(tmp_path):
    """The worker writes `spec.served_model` into each line's body (worker/commit.py); the
    batch pipelines set it to the route's model, the name every line of the batch gave, not
    the weights' path."""
    from dagster_gpuinfer.worker.rows.writers import encode_openai_batch

    pipelines = batch_pipelines(ROUTES, files_root=str(tmp_path / "files"))
    specs = {
        name: InferenceSpec.model_validate(pipeline.spec)
        for name, pipeline in pipelines.pipelines.items()
    }
    for route in ROUTES.routes:
        spec = specs[route.pipeline]
        assert (spec.served_model, spec.model) == (route.model, route.model_path)
    unnamed = specs["batch_embed"].model_copy(update={"served_model_name": None})
    assert unnamed.spec_hash() != specs["batch_embed"].spec_hash()
    assert unnamed.served_model == unnamed.model
    import pyarrow as pa

    table = pa.table(
        {
            "id": ["a"],
            "embedding": pa.array([[0.5, 0.25]], pa.list_(pa.float32(), 2)),
            "prompt_tokens": pa.array([4], pa.int32()),
        }
    )
    line = json.loads(encode_openai_batch("embed", specs["batch_embed"].served_model, "h", table))
    body = line["response"]["body"]
    assert body["model"] == "mini"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
