"""The batch API against hostile and careless callers (issue 40's probe): what a request may
cost the server before its key is checked, how much memory an upload or a create may take,
the bounds on every field that reaches the store, the cancel/create race, and the audit
trail of refusals. Servers run on 127.0.0.1 only; memory is the server process's own peak
RSS (`VmHWM`), measured in a subprocess that serves nothing else."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from batch_api_support import client, free_port, live_service, request_lines
from support import fresh_postgres_database
from test_batch_api import ROUTES, make_service, upload

from dagster_gpuinfer.batch_api import service as service_module
from dagster_gpuinfer.batch_api.store import BatchStore

AUDIT_LOGGER = "dagster_gpuinfer.batch_api.audit"
MiB = 1024 * 1024


@pytest.fixture
def service(tmp_path, instance):
    svc = make_service(tmp_path, instance)
    yield svc
    svc.store.close()


@pytest.fixture
def api(service):
    with live_service(service) as base_url:
        yield base_url


def _raw_request(base_url: str, head: str, first_bytes: bytes, *, wait: float = 10.0) -> bytes:
    """Send `head` and only the first bytes of a body it announces as far larger; return
    what the server answers within `wait` seconds (b"" if it waits for the rest)."""
    port = int(base_url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(head.encode() + first_bytes)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            pass
    return answer


def _multipart_head(path: str, length: int, key: str | None) -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
        "Content-Type: multipart/form-data; boundary=xyz\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )


_PART_START = (
    b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
    b"Content-Type: application/jsonl\r\n\r\n"
)


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(service, api):
    """The probe: with no key, 990 parts of 1 MiB took the server to 1,185 MiB and a 1 GiB
    part was spooled to /tmp before the 401. The answer now comes before the body."""
    for key in (None, "sk-gpi-nobody.secret"):
        answer = _raw_request(
            api, _multipart_head("/v1/files", 1 << 30, key), _PART_START + b"x" * 65536
        )
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    json_head = (
        "POST /v1/batches HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {1 << 30}\r\n\r\n"
    )
    answer = _raw_request(api, json_head, b'{"metadata": {"a": "' + b"x" * 65536)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert list(Path(service.files.root).rglob("*")) == []


def test_an_announced_oversize_upload_is_a_413_before_its_body_is_read(service, api):
    key = service.store.create_key("acme").token
    head = _multipart_head("/v1/files", service.max_bytes + 2 * MiB, key)
    answer = _raw_request(api, head, _PART_START + b"x" * 65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"file_too_large" in answer


def test_an_oversize_json_body_is_a_413(service, api):
    key = service.store.create_key("acme").token
    answer = httpx.post(
        f"{api}/batches",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        content=json.dumps(
            {"input_file_id": "f", "endpoint": "/v1/embeddings", "metadata": {"k": "v" * (2 * MiB)}}
        ),
    )
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "request_too_large"


def test_metadata_beyond_openais_bounds_is_a_400_naming_metadata(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(1, model="mini"))
    most = {f"k{i:02d}" + "k" * 61: "v" * 512 for i in range(16)}
    assert all(len(k) == 64 for k in most)
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h", metadata=most
    )
    assert batch.metadata == most
    for metadata, words in (
        ({f"k{i}": "v" for i in range(17)}, "16"),
        ({"k" * 65: "v"}, "64"),
        ({"k": "v" * 513}, "512"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/embeddings",
                completion_window="24h",
                metadata=metadata,
            )
        error = refused.value.body
        assert error["param"] == "metadata" and words in error["message"], error
        assert len(error["message"]) < 400, "the message must not echo a huge key or value"


# ---------------------------------------------------------------- fields that reach the store


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/store.sqlite"
        return
    with fresh_postgres_database("hostile") as url:
        yield url


def test_overlong_filenames_and_windows_are_400s_before_anything_is_written(
    tmp_path, instance, store_url
):
    """On PostgreSQL a 600-character filename was a 500 after the bytes were written (an
    orphaned file); a 17-character or a huge `completion_window` was a 500."""
    svc = make_service(tmp_path, instance, store_url=store_url)
    try:
        with live_service(svc) as base_url:
            sdk = client(base_url, svc.store.create_key("acme").token)
            with pytest.raises(openai.BadRequestError) as refused:
                upload(sdk, request_lines(1, model="mini"), name="n" * 600 + ".jsonl")
            assert refused.value.body["param"] == "file", refused.value.body
            for name in (b"in\x00.jsonl", b"in\x1b[2J.jsonl"):  # raw, as no SDK sends them
                body = _PART_START.replace(b"big.jsonl", name) + b"{}\r\n--xyz--\r\n"
                answer = httpx.post(
                    f"{base_url}/files",
                    content=body,
                    headers={
                        "Authorization": f"Bearer {sdk.api_key}",
                        "Content-Type": "multipart/form-data; boundary=xyz",
                    },
                )
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["param"] == "file"
            assert sdk.files.list().data == []
            assert [p for p in Path(svc.files.root).rglob("*") if p.is_file()] == []
            uploaded = upload(sdk, request_lines(1, model="mini"))
            for window in ("00000000000000024h", "9" * 15 + "h", "25h"):
                with pytest.raises(openai.BadRequestError) as refused:
                    sdk.batches.create(
                        input_file_id=uploaded.id,
                        endpoint="/v1/embeddings",
                        completion_window=window,  # type: ignore[arg-type]
                    )
                assert refused.value.body["param"] == "completion_window"
            assert sdk.batches.list().data == []
    finally:
        svc.store.close()


def test_an_upload_left_unfinished_by_a_dead_request_is_swept_with_its_bytes(service, api):
    """The row is written before the bytes, so bytes a dying request left are found by it."""
    tenant = service.store.authenticate(service.store.create_key("acme").token)
    upload_ = service.begin_upload(tenant, filename="in.jsonl", purpose="batch")
    upload_.write(b"half a line")
    upload_.writer.close()
    path = upload_.record["path"]
    assert os.path.exists(path) and service.store.get_file(upload_.record["id"], "acme")
    service.reconcile_all()  # too recent to be abandoned: kept
    assert os.path.exists(path)
    old = service.store.get_file(upload_.record["id"], "acme")
    service.store.put_file({**old, "created_at": old["created_at"] - 7200})
    service.reconcile_all()
    assert not os.path.exists(path) and service.store.get_file(old["id"], "acme") is None


# ---------------------------------------------------------------- create and cancel


def test_cancel_during_validation_wins_and_the_batch_never_runs(service, api, monkeypatch):
    """Cancel during `validating` was a 500, and create then set `in_progress` anyway."""
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(2, model="mini"))
    validating, release = threading.Event(), threading.Event()
    real = service_module.validate_batch_input

    def slow_validation(*args, **kwargs):
        validating.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(service_module, "validate_batch_input", slow_validation)
    created: list = []
    creator = threading.Thread(
        target=lambda: created.append(
            sdk.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        )
    )
    creator.start()
    assert validating.wait(30)
    (row,) = service.store.batches_in(("validating",))
    cancelled = sdk.batches.cancel(row["id"])
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    release.set()
    creator.join(30)
    assert created and created[0].status == "cancelled"
    assert sdk.batches.retrieve(row["id"]).status == "cancelled"
    assert service.store.batches_in(("in_progress", "validating")) == []
    shard = service.files.input_template.replace("{partition_key}", row["id"])
    assert not os.path.exists(shard)


def test_a_line_nested_100000_deep_fails_the_batch_naming_the_line(service, api):
    sdk = client(api, service.store.create_key("acme").token)
    deep = b'{"custom_id": "deep", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    uploaded = upload(sdk, request_lines(1, model="mini") + deep + b"\n")
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.status == "failed"
    (error,) = batch.errors.data
    assert (error.line, error.code) == (2, "invalid_json_line")
    assert "nested" in error.message and "line 2" in error.message
    assert service.store.batches_in(("validating",)) == []


def test_a_batch_whose_validation_breaks_fails_instead_of_sitting_in_validating(
    service, api, monkeypatch
):
    sdk = client(api, service.store.create_key("acme").token)
    uploaded = upload(sdk, request_lines(1, model="mini"))

    def broken(*args, **kwargs):
        raise MemoryError("out of memory while validating")

    monkeypatch.setattr(service_module, "validate_batch_input", broken)
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.status == "failed"
    assert [e.code for e in batch.errors.data] == ["validation_error"]
    assert service.store.batches_in(("validating",)) == []


# ---------------------------------------------------------------- the audit log


def test_the_audit_log_records_refused_keys_and_failed_creates(service, api, caplog):
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    key = service.store.create_key("acme")
    sdk = client(api, key.token)
    assert httpx.get(f"{api}/batches").status_code == 401
    assert httpx.get(f"{api}/files", headers={"Authorization": "Bearer sk-gpi-abc.x"}).is_error
    with pytest.raises(openai.BadRequestError):
        sdk.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(
            input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"
        )
    bad = upload(sdk, b"{not json\n")
    failed = sdk.batches.create(
        input_file_id=bad.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == AUDIT_LOGGER]
    refused = [line for line in lines if line["action"] == "auth.refused"]
    assert [(r["path"], r["key_id"]) for r in refused] == [
        ("/v1/batches", None),
        ("/v1/files", "abc"),
    ]
    outcomes = [(r["action"], r.get("outcome"), r.get("status")) for r in lines[2:]]
    assert outcomes == [
        ("file.create", "refused", 400),
        ("batch.create", "refused", 404),
        ("file.create", "created", 200),
        ("batch.create", "failed", 200),
    ]
    assert lines[-1]["id"] == failed.id and lines[-1]["tenant"] == "acme"


# ---------------------------------------------------------------- memory, in a subprocess


@contextmanager
def _served_in_subprocess(tmp_path: Path) -> Iterator[tuple[str, int, str]]:
    """`python -m dagster_gpuinfer.batch_api serve` on 127.0.0.1; yields its base url, pid
    and a key. Nothing else runs in that process, so its RSS is the service's own."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(json.dumps({"routes": [r.model_dump() for r in ROUTES.routes]}))
    store_url = f"sqlite:///{tmp_path}/store.sqlite"
    key = BatchStore(store_url).create_key("acme").token
    port = free_port()
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    command = [sys.executable, "-m", "dagster_gpuinfer.batch_api", "--store-url", store_url]
    command += ["serve", "--port", str(port), "--routes", str(routes)]
    command += ["--files-root", str(tmp_path / "files"), "--reconcile-interval", "3600"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the batch API subprocess exited at start"
            assert time.monotonic() < deadline, "the batch API subprocess did not answer"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield f"{base}/v1", process.pid, key
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _reset_peak_rss(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS (`clear_refs` 5); returns it, MiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _rss_mib(pid, "VmRSS")


def _rss_mib(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"/proc/{pid}/status has no {field}")


def _chunked_upload(base_url: str, key: str, size: int) -> httpx.Response:
    """A multipart upload of `size` file bytes sent chunked (no Content-Length), so only
    the server's own bound can stop it."""

    def body() -> Iterator[bytes]:
        yield _PART_START
        line = b'{"custom_id": "x"}' + b" " * 1005 + b"\n"  # 1 KiB
        block = line * 1024
        for _ in range(size // MiB):
            yield block
        yield b"x" * (size % MiB) + b"\r\n--xyz--\r\n"

    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "multipart/form-data; boundary=xyz",
    }
    return httpx.post(f"{base_url}/files", content=body(), headers=headers, timeout=120)


def test_uploads_creates_and_downloads_stream_with_bounded_server_memory(tmp_path):
    """The probe: an upload over the limit was read into memory (200 MiB + 1) before its
    413; a create read the whole file (609 MiB for one legal 198 MB file). A download read
    the whole file too (an output file of embeddings can outgrow the service's 1 GiB)."""
    with _served_in_subprocess(tmp_path) as (base_url, pid, key):
        before = _reset_peak_rss(pid)
        answer = _chunked_upload(base_url, key, 200 * MiB + MiB)
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["code"] == "file_too_large"
        grew = _rss_mib(pid) - before
        assert grew < 48, f"refusing an oversize upload took {grew} MiB"
        assert not list((tmp_path / "files").rglob("file-*"))
        sdk = client(base_url, key)
        text = "rivers " * 200  # about 1.4 KB a line: 48,000 lines are 67 MB
        lines = b"".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": "mini", "input": text},
                }
            ).encode()
            + b"\n"
            for i in range(48_000)
        )
        uploaded = upload(sdk, lines)
        del lines
        before = _reset_peak_rss(pid)
        batch = sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        assert batch.status == "in_progress" and batch.request_counts.total == 48_000
        grew = _rss_mib(pid) - before
        assert grew < 48, f"creating a batch from a {uploaded.bytes >> 20} MiB file took {grew} MiB"
        before = _reset_peak_rss(pid)
        headers = {"Authorization": f"Bearer {key}"}
        url = f"{base_url}/files/{uploaded.id}/content"
        received = 0
        with httpx.stream("GET", url, headers=headers, timeout=120) as answer:
            assert answer.status_code == 200
            assert int(answer.headers["content-length"]) == uploaded.bytes
            for block in answer.iter_bytes():
                received += len(block)
        assert received == uploaded.bytes
        grew = _rss_mib(pid) - before
        assert grew < 48, f"downloading a {uploaded.bytes >> 20} MiB file took {grew} MiB"
