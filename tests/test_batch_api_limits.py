"""Per-tenant rate limits and quotas (limits.py): each limit answered 429 with `Retry-After`
and OpenAI's error shape, before the body is read where it can be, race-free where the row is
written, shared by two replicas over one store. Every test runs on SQLite and on a fresh
database of the test PostgreSQL server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest
from batch_api_support import client, live_service, request_lines
from support import fresh_postgres_database
from test_batch_api import make_service, upload
from test_batch_api_hostile import _PART_START, _multipart_head, _raw_request

from dagster_gpuinfer.batch_api.__main__ import parser
from dagster_gpuinfer.batch_api.limits import LimitSettings, TenantLimits, load_limit_settings
from dagster_gpuinfer.batch_api.service import ApiError

# A rate no test outlives: a token every 1,000 s, so what a bucket holds is its burst.
SLOW = 0.001


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/store.sqlite"
        return
    with fresh_postgres_database("limits") as url:
        yield url


def limited(tmp_path, instance, store_url, **given):
    """A service whose tenants all get `given` limits (the rest the defaults)."""
    service = make_service(tmp_path, instance, store_url=store_url)
    service.limits = LimitSettings(default=TenantLimits(**given))
    return service


def refusal(response: httpx.Response) -> dict:
    """The error of a 429, after checking the parts every 429 has."""
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_key_over_its_rate_gets_429_with_retry_after_and_its_other_key_does_not(
    tmp_path, instance, store_url
):
    service = limited(tmp_path, instance, store_url, requests_per_second=SLOW, burst=3)
    first, second = (service.store.create_key("acme").token for _ in range(2))
    with live_service(service) as base_url:
        headers = {"Authorization": f"Bearer {first}"}
        answers = [httpx.get(f"{base_url}/batches", headers=headers) for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        error = refusal(answers[3])
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "0.001 requests per second (burst 3)" in error["message"]
        # A token every 1,000 s: the wait is most of that, never the SDK's default guess.
        assert int(answers[3].headers["retry-after"]) > 900
        # The bucket is the key's: the tenant's other key has its own.
        other = httpx.get(f"{base_url}/files", headers={"Authorization": f"Bearer {second}"})
        assert other.status_code == 200
        # The openai SDK raises its RateLimitError, with the message and the header.
        with pytest.raises(openai.RateLimitError, match="Rate limit reached") as raised:
            client(base_url, first).batches.list()
        assert int(raised.value.response.headers["retry-after"]) > 900
    service.store.close()


def test_two_replicas_over_one_store_draw_from_one_bucket(tmp_path, instance, store_url):
    """Two apps, each with its own store connection pool, as two uvicorn processes would
    be: a key's burst of 4 is spent across both, not 4 at each."""
    replicas = [limited(tmp_path, instance, store_url, requests_per_second=SLOW, burst=4)]
    replicas.append(limited(tmp_path, instance, store_url, requests_per_second=SLOW, burst=4))
    assert replicas[0].store is not replicas[1].store
    key = replicas[0].store.create_key("acme").token
    headers = {"Authorization": f"Bearer {key}"}
    with ExitStack() as stack:
        a, b = (stack.enter_context(live_service(replica)) for replica in replicas)
        statuses = [httpx.get(f"{url}/batches", headers=headers).status_code for url in (a, b)]
        statuses += [httpx.get(f"{url}/batches", headers=headers).status_code for url in (a, b)]
        assert statuses == [200, 200, 200, 200]
        assert httpx.get(f"{b}/batches", headers=headers).status_code == 429
        assert httpx.get(f"{a}/batches", headers=headers).status_code == 429
    for replica in replicas:
        replica.store.close()


def test_the_bucket_refills_at_its_rate_up_to_its_burst(tmp_path, instance, store_url):
    """The bucket's arithmetic at given instants (no clock): a token per second, at most 2."""
    store = limited(tmp_path, instance, store_url).store

    def take(at: float) -> float:
        return store.take_token("k1", rate=1.0, burst=2, at=at)

    assert [take(100.0), take(100.0)] == [0.0, 0.0]
    assert take(100.0) == pytest.approx(1.0)  # empty: the next token in a second
    assert take(100.5) == pytest.approx(0.5)
    assert take(101.0) == 0.0  # refilled one
    assert take(50.0) == pytest.approx(1.0)  # a clock behind the bucket refills nothing
    assert [take(1000.0), take(1000.0)] == [0.0, 0.0]  # a long rest refills only the burst
    assert take(1000.0) > 0
    store.close()


def test_files_over_the_tenant_file_quota_are_429_until_one_is_deleted(
    tmp_path, instance, store_url
):
    service = limited(tmp_path, instance, store_url, max_files=2)
    with live_service(service) as base_url:
        sdk = client(base_url, service.store.create_key("acme").token)
        kept = [upload(sdk, request_lines(1, model="mini")) for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as raised:
            upload(sdk, request_lines(1, model="mini"))
        error = refusal(raised.value.response)
        assert (error["type"], error["code"]) == ("insufficient_quota", "file_limit_exceeded")
        assert "holds 2 files, the limit is 2" in error["message"]
        assert "DELETE /v1/files" in error["message"]
        # Another tenant has its own quota; deleting a file makes room.
        other = client(base_url, service.store.create_key("beta").token)
        assert upload(other, request_lines(1, model="mini")).bytes > 0
        sdk.files.delete(kept[0].id)
        assert upload(sdk, request_lines(1, model="mini")).bytes > 0
    service.store.close()


def test_an_upload_over_the_byte_quota_is_429_before_its_body_is_read(
    tmp_path, instance, store_url
):
    """The announced length over the room left: the answer comes with only the first bytes
    sent (`_raw_request` gets nothing if the server waits for the rest)."""
    service = limited(tmp_path, instance, store_url, max_stored_bytes=4096)
    with live_service(service) as base_url:
        key = service.store.create_key("acme").token
        answer = _raw_request(base_url, _multipart_head("/v1/files", 5000, key), _PART_START)
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b"storage_limit_exceeded" in answer and b"retry-after: 30" in answer.lower()
        assert service.store.usage("acme").files == 0
    service.store.close()


def test_an_upload_without_a_length_stops_with_429_once_past_the_room_left(
    tmp_path, instance, store_url
):
    """A chunked upload announces nothing: it is stopped when its bytes pass the quota, and
    neither its row nor its bytes are left."""
    service = limited(tmp_path, instance, store_url, max_stored_bytes=3000)
    with live_service(service) as base_url:
        key = service.store.create_key("acme").token
        first = upload(client(base_url, key), request_lines(10, model="mini"))
        assert first.bytes < 3000

        def body():  # a generator: httpx sends it chunked, with no Content-Length
            yield _PART_START
            yield request_lines(40, model="mini")
            yield b"\r\n--xyz--\r\n"

        answer = httpx.post(
            f"{base_url}/files",
            content=body(),
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": "multipart/form-data; boundary=xyz",
            },
        )
        error = refusal(answer)
        assert error["code"] == "storage_limit_exceeded"
        usage = service.store.usage("acme")
        assert (usage.files, usage.stored_bytes) == (1, first.bytes)
        assert [p.name for p in (tmp_path / "files" / "files").iterdir()] == [first.id]
    service.store.close()


def test_concurrent_uploads_reserve_their_length_and_never_pass_the_byte_quota(
    tmp_path, instance, store_url
):
    """Eight uploads at once, each fitting the empty quota alone: the length each announces
    is reserved where its row is written (and given back to the file's size once it is in),
    so together they never pass the quota."""
    service = limited(tmp_path, instance, store_url, max_stored_bytes=2000)
    key = service.store.create_key("acme").token
    data = request_lines(4, model="mini")
    with live_service(service) as base_url:

        def send(_: int) -> int:
            files = {"file": ("in.jsonl", data, "application/jsonl")}
            headers = {"Authorization": f"Bearer {key}"}
            answer = httpx.post(
                f"{base_url}/files", files=files, data={"purpose": "batch"}, headers=headers
            )
            return answer.status_code

        announced = len(
            httpx.Request(
                "POST",
                base_url,
                files={"file": ("in.jsonl", data, "application/jsonl")},
                data={"purpose": "batch"},
            ).read()
        )
        assert announced < 2000 < 8 * announced
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(send, range(8)))
    # At least as many as fit by their reservations; more only where an upload that had
    # finished gave back what its form's boundaries had reserved. Never past the quota.
    assert statuses.count(200) >= 2000 // announced and 429 in statuses
    assert set(statuses) == {200, 429}
    stored = service.store.usage("acme").stored_bytes
    assert stored == statuses.count(200) * len(data) <= 2000
    service.store.close()


def test_batches_over_the_in_flight_quota_are_429_until_one_finishes(tmp_path, instance, store_url):
    service = limited(tmp_path, instance, store_url, max_batches_in_flight=2)
    with live_service(service) as base_url:
        sdk = client(base_url, service.store.create_key("acme").token)
        source = upload(sdk, request_lines(2, model="mini"))

        def create():
            return sdk.batches.create(
                input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h"
            )

        running = [create(), create()]
        with pytest.raises(openai.RateLimitError) as raised:
            create()
        error = refusal(raised.value.response)
        assert (error["type"], error["code"]) == ("insufficient_quota", "batch_limit_exceeded")
        assert "2 batches in flight, the limit is 2" in error["message"]
        assert sdk.batches.cancel(running[0].id).status == "cancelled"
        assert create().status == "in_progress"
    service.store.close()


def test_concurrent_creates_never_pass_the_in_flight_quota(tmp_path, instance, store_url):
    """Eight creates at once, past the check before the body (service calls, as eight
    replicas' routes would make them): the count under the tenant's lock lets 3 through."""
    service = limited(tmp_path, instance, store_url, max_batches_in_flight=3, max_files=3)
    tenant = service.store.authenticate(service.store.create_key("acme").token)
    source = service.upload(
        tenant, filename="in.jsonl", purpose="batch", data=request_lines(2, model="mini")
    )

    def create(_: int) -> str:
        try:
            return service.create_batch(
                tenant,
                input_file_id=source["id"],
                endpoint="/v1/embeddings",
                completion_window="24h",
                metadata=None,
            )["status"]
        except ApiError as exc:
            return str(exc.status)

    def add_file(_: int) -> str:
        try:
            return service.upload(tenant, filename="f.jsonl", purpose="batch", data=b"{}\n")["id"]
        except ApiError as exc:
            return str(exc.status)

    with ThreadPoolExecutor(8) as pool:
        created = sorted(pool.map(create, range(8)))
        uploaded = list(pool.map(add_file, range(8)))
    assert created == ["429"] * 5 + ["in_progress"] * 3
    assert sorted(uploaded).count("429") == 6  # 3 files: the source and two of these
    assert service.store.usage("acme").files == 3
    service.store.close()


def test_limit_settings_take_per_tenant_differences_from_the_default(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text(
        "default: {requests_per_second: 5, max_files: 10}\ntenants:\n  acme: {max_files: 50}\n"
    )
    settings = load_limit_settings(str(path))
    assert settings.for_tenant("acme") == TenantLimits(requests_per_second=5, max_files=50)
    assert settings.for_tenant("other") == TenantLimits(requests_per_second=5, max_files=10)
    path.write_text("tenants:\n  acme: {max_file: 50}\n")
    with pytest.raises(ValueError, match="max_file"):
        load_limit_settings(str(path))
    args = parser().parse_args(["serve", "--limits", str(path)])
    assert args.limits == str(path)
