"""Shared parts of the batch API tests: a live service on loopback, SDK clients, batch lines
and chunk markers written through the real storage layer."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import uvicorn

from dagster_gpuinfer.batch_api.app import create_app
from dagster_gpuinfer.batch_api.service import BatchService
from dagster_gpuinfer.storage import (
    ChunkMarker,
    chunk_dir,
    chunk_part_name,
    filesystem_for,
    partition_dir,
    table_to_parquet_bytes,
    write_chunk_marker,
    write_file_entry,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_service(
    service: BatchService, *, reconcile_interval: float | None = None
) -> Iterator[str]:
    """uvicorn serving `service` on 127.0.0.1 in a thread; yields the SDK's base_url."""
    port = free_port()
    config = uvicorn.Config(
        create_app(service, reconcile_interval=reconcile_interval),
        host="127.0.0.1",
        port=port,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the batch API did not start on 127.0.0.1")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def client(base_url: str, key: str):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def request_lines(n: int, *, model: str, url: str = "/v1/embeddings", start: int = 0) -> bytes:
    lines = []
    for i in range(start, start + n):
        if url == "/v1/embeddings":
            body = {"model": model, "input": f"A short note about rivers, number {i}."}
        else:
            body = {"model": model, "messages": [{"role": "user", "content": f"Say {i}"}]}
        lines.append(
            json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


def output_line(custom_id: str) -> str:
    return json.dumps(
        {
            "id": f"batch_req_{custom_id}",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": custom_id, "body": {"data": []}},
            "error": None,
        }
    )


def write_chunk(service: BatchService, pipeline: str, batch_id: str, index: int, ids, bad=()):
    """Commit one chunk of a batch's partition as the worker does: its part file (OpenAI
    output lines), its quarantined rows, then its marker (the storage package's own calls)."""
    import pyarrow as pa

    from dagster_gpuinfer.storage import ERRORS_SCHEMA

    output = service.files.output_spec(pipeline)
    fs, path = filesystem_for(partition_dir(output, batch_id), service.files.storage)
    spec_hash = "0123456789abcdef"
    data = ("\n".join(output_line(i) for i in ids) + "\n").encode()
    name = chunk_part_name(spec_hash, index, "attempt0", ".jsonl")
    part = write_file_entry(fs, path, name, data, len(ids))
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
            chunk_dir(path, spec_hash),
            f"errors-{index:05d}-attempt0.parquet",
            table_to_parquet_bytes(table),
            len(bad),
        )
    marker = ChunkMarker(
        index=index,
        spec_hash=spec_hash,
        rows_in=len(ids) + len(bad),
        rows_out=len(ids),
        rows_errored=len(bad),
        prompt_tokens=7 * len(ids),
        generated_tokens=3 * len(ids),
        part=part,
        errors=errors,
    )
    write_chunk_marker(fs, path, marker)
    return fs, path, marker


def jsonl_ids(data: bytes) -> list[str]:
    return [json.loads(line)["custom_id"] for line in data.splitlines() if line.strip()]


class Receiver:
    """A webhook endpoint on 127.0.0.1: keeps every request, verifies each with the openai
    SDK (`webhooks.unwrap`, the secret of the path's tenant), answers 500 to the first try
    of each `webhook-id` and 200 to later ones that verify, 400 to one that does not."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = secrets  # path ("/acme") -> the secret its tenant's events carry
        self.requests: list[tuple[str, dict[str, str], bytes, int]] = []
        self.lock = threading.Lock()
        # Built here, in the test's thread: the SDK imports httpx lazily, and an import in
        # the server's thread racing the sender's loop saw a half-initialized module.
        self.webhooks = openai.OpenAI(api_key="not-used", base_url="http://127.0.0.1:9/v1").webhooks
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {name.lower(): value for name, value in self.headers.items()}
                status = receiver.answer(self.path, headers, body)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def answer(self, path: str, headers: dict[str, str], body: bytes) -> int:
        try:
            self.webhooks.unwrap(body, headers, secret=self.secrets[path])
        except openai.InvalidWebhookSignatureError:
            status = 400
        else:
            with self.lock:
                tried = any(
                    h["webhook-id"] == headers["webhook-id"] for _, h, _, _ in self.requests
                )
            status = 200 if tried else 500
        with self.lock:
            self.requests.append((path, headers, body, status))
        return status

    def taken(self) -> list[tuple[str, dict[str, str], bytes]]:
        """The requests answered 200, as (path, headers, body)."""
        with self.lock:
            return [(p, h, b) for p, h, b, status in self.requests if status == 200]

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
