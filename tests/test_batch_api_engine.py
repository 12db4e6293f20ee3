"""The batch API end to end: the `openai` SDK against the service (a subprocess on
loopback), a real `dagster-daemon` (sensor, run queue, run launcher, code server) and the
real vLLM CPU engine.

One engine start in `make test`: an embeddings batch whose `request_counts.completed` is
seen rising, across a restart of the service mid-run, to `completed`; the downloaded output
answers every custom_id once, names the requested model, carries usage and matches a
transformers reference, and the service (configured as `serve` reads it, from the
environment) posts one signed `batch.completed` to a receiver on loopback. Cancel mid-run (a
second engine start) is `slow`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import openai
import pytest
from batch_api_support import Receiver, client, free_port, jsonl_ids

from assets.paths import cross_encoder_dir, generation_model_dir
from dagster_gpuinfer.batch_api.store import BatchStore
from dagster_gpuinfer.batch_api.webhooks import new_secret

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parent.parent
MODEL = "all-MiniLM-L6-v2"


def embedding_lines(n: int, *, prefix: str) -> tuple[bytes, list[str]]:
    topics = ["rivers", "compilers", "bread", "glaciers", "chess", "jazz", "tax", "birds"]
    texts = [
        f"A short note about {topics[i % 8]} and {topics[i * 3 % 8]}, number {i}." for i in range(n)
    ]
    lines = [
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": MODEL, "input": text},
            }
        )
        for i, text in enumerate(texts)
    ]
    return ("\n".join(lines) + "\n").encode(), texts


class Stack:
    """The daemon, the service and their environment (one per module)."""

    def __init__(self, tmp: Path, minilm_dir: str) -> None:
        self.tmp = tmp
        home = tmp / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_text(
            "run_coordinator:\n"
            "  module: dagster._core.run_coordinator\n"
            "  class: QueuedRunCoordinator\n"
            "  config:\n"
            "    dequeue_interval_seconds: 1\n"
            "telemetry:\n"
            "  enabled: false\n"
        )
        routes = tmp / "routes.yaml"
        routes.write_text(
            "routes:\n"
            f"  - model: {MODEL}\n"
            "    endpoint: /v1/embeddings\n"
            "    pipeline: batch_embeddings\n"
            f"    model_path: {minilm_dir}\n"
            "    engine: {dtype: float32}\n"
            "    chunk_size: 16\n"
            # Served by the slow test, which makes these models first (the paths are only
            # read when a run starts).
            "  - model: tiny-llama\n"
            "    endpoint: /v1/chat/completions\n"
            "    pipeline: batch_chat\n"
            f"    model_path: {generation_model_dir()}\n"
            "    engine: {max_model_len: 256}\n"
            "    sampling: {temperature: 0.0, max_tokens: 8}\n"
            "  - model: minilm-cross-encoder\n"
            "    endpoint: /v1/rerank\n"
            "    pipeline: batch_rerank\n"
            f"    model_path: {cross_encoder_dir()}\n"
            "    engine: {dtype: float32}\n"
        )
        (tmp / "workspace.yaml").write_text(
            "load_from:\n"
            "  - python_file:\n"
            f"      relative_path: {REPO / 'tests' / 'batch_api_defs.py'}\n"
            f"      working_directory: {REPO}\n"
            "      location_name: batch_api_test\n"
        )
        self.store_url = f"sqlite:///{tmp / 'batch_api.sqlite'}"
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
            "GPUINFER_BATCH_ROUTES": str(routes),
            "GPUINFER_BATCH_STORE_URL": self.store_url,
            "GPUINFER_BATCH_FILES_ROOT": str(tmp / "files"),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.daemon: subprocess.Popen | None = None
        self.api: subprocess.Popen | None = None

    def start_daemon(self) -> None:
        daemon = Path(sys.executable).with_name("dagster-daemon")
        self.daemon = subprocess.Popen(
            [str(daemon), "run", "-w", str(self.tmp / "workspace.yaml")],
            env=self.env,
            cwd=REPO,
            stdout=open(self.tmp / "daemon.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its code server, runs and workers share its group
        )

    def start_api(self) -> None:
        self.api = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dagster_gpuinfer.batch_api",
                "serve",
                "--port",
                str(self.port),
                "--reconcile-interval",
                "0.25",  # GETs only read: the loop is what moves the counts the tests watch
            ],
            env=self.env,
            cwd=REPO,
            stdout=open(self.tmp / "api.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.api.poll() is None, (self.tmp / "api.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.base_url}/batches", timeout=2).status_code == 401:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("the batch API did not answer within 120 s")

    def stop_api(self) -> None:
        if self.api is not None and self.api.poll() is None:
            self.api.terminate()
            self.api.wait(timeout=30)
        self.api = None

    def close(self) -> None:
        self.stop_api()
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait(timeout=30)
        try:  # whatever the daemon's group left behind (runs, workers, engines)
            os.killpg(self.daemon.pid, signal.SIGKILL)
        except (ProcessLookupError, AttributeError, TypeError):
            pass

    def instance(self) -> dg.DagsterInstance:
        from dagster._core.instance.ref import InstanceRef

        return dg.DagsterInstance.from_ref(InstanceRef.from_dir(self.env["DAGSTER_HOME"]))

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.tmp / name).read_text()[-4000:]
            for name in ("daemon.log", "api.log")
            if (self.tmp / name).exists()
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory, minilm_dir):
    tmp = tmp_path_factory.mktemp("batch_api_engine")
    stack = Stack(tmp, minilm_dir)
    # Create the instance's SQLite storages once, here: the daemon and the service starting
    # together on a fresh DAGSTER_HOME would both migrate them ("more than one head", seen).
    instance = stack.instance()
    instance.get_runs(limit=1)
    instance.all_instigator_state()
    instance.dispose()
    # The service's webhooks, set as a deployment sets them: a settings file naming the
    # variable that holds the secret.
    stack.receiver = Receiver({"/acme": new_secret()}).__enter__()
    (tmp / "webhooks.yaml").write_text(
        "tenants:\n  acme:\n"
        f"    - url: {stack.receiver.url('/acme')}\n      secret_env: ACME_WEBHOOK_SECRET\n"
        "first_retry_seconds: 0.5\nsend_interval_seconds: 0.2\n"
    )
    stack.env["GPUINFER_BATCH_WEBHOOKS"] = str(tmp / "webhooks.yaml")
    stack.env["ACME_WEBHOOK_SECRET"] = stack.receiver.secrets["/acme"]
    store = BatchStore(stack.store_url)
    stack.key = store.create_key("acme", kueue_queue="acme-gpu").token
    store.close()
    stack.start_daemon()
    stack.start_api()
    yield stack
    stack.close()
    stack.receiver.__exit__(None, None, None)


def poll(stack: Stack, batch_id: str, until, *, timeout: float = 600, on_value=None):
    sdk = client(stack.base_url, stack.key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = sdk.batches.retrieve(batch_id)
        except openai.APIStatusError as error:  # the service's log says why
            raise AssertionError(f"retrieve {batch_id}: {error}\n{stack.logs()}") from error
        if on_value is not None:
            on_value(batch)
        if until(batch):
            return batch
        time.sleep(0.25)
    raise AssertionError(f"batch {batch_id} did not get there in {timeout} s\n{stack.logs()}")


def finished_run(instance: dg.DagsterInstance, batch_id: str, timeout: float = 120) -> Any:
    """The run tagged with `batch_id`, once it has finished (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        [run] = instance.get_runs(filters=dg.RunsFilter(tags={"gpuinfer/batch_id": batch_id}))
        if run.is_finished or time.monotonic() > deadline:
            return run
        time.sleep(0.5)


def test_embeddings_batch_rises_to_completed_across_a_service_restart(stack, minilm_dir):
    rows = 1200
    data, texts = embedding_lines(rows, prefix="e")
    sdk = client(stack.base_url, stack.key)
    uploaded = sdk.files.create(file=("embed.jsonl", data), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.request_counts.total == rows
    seen: list[int] = []
    midway = poll(
        stack,
        batch.id,
        lambda b: 0 < b.request_counts.completed < rows or b.status != "in_progress",
        on_value=lambda b: seen.append(b.request_counts.completed),
    )
    assert midway.status == "in_progress", f"the run ended before any progress was seen: {seen}"
    # Restart the service mid-run: nothing it held in memory matters.
    stack.stop_api()
    stack.start_api()
    done = poll(
        stack,
        batch.id,
        lambda b: b.status not in ("in_progress", "finalizing"),
        on_value=lambda b: seen.append(b.request_counts.completed),
    )
    assert done.status == "completed", f"{done}\n{stack.logs()}"
    assert seen == sorted(seen), f"request_counts.completed went down: {seen}"
    between = sorted({n for n in seen if 0 < n < rows})
    assert between, f"no progress between 0 and {rows} was seen: {seen}"
    assert (done.request_counts.completed, done.request_counts.failed) == (rows, 0)

    output = sdk.files.content(done.output_file_id).read()
    ids = jsonl_ids(output)
    assert sorted(ids) == sorted(f"e-{i}" for i in range(rows)) and len(set(ids)) == rows
    assert done.error_file_id is None
    by_id = {}
    for line in output.splitlines():
        record = json.loads(line)
        assert record["response"]["status_code"] == 200 and record["error"] is None
        body = record["response"]["body"]
        # The model the lines named (not the weights' folder), and each line's tokens.
        assert body["model"] == MODEL and body["usage"]["prompt_tokens"] > 0
        by_id[record["custom_id"]] = body["data"][0]["embedding"]
    ours = np.array([by_id[f"e-{i}"] for i in range(64)], dtype=np.float32)
    assert np.allclose(ours, reference_embeddings(minilm_dir, texts[:64]), atol=2e-3)

    # The batch is completed once its partition is committed (the manifest); the run that
    # committed it ends a moment later (engine shutdown, the step's events): wait for it.
    run = finished_run(stack.instance(), batch.id)
    assert run.status == dg.DagsterRunStatus.SUCCESS
    assert (run.tags["gpuinfer/tenant"], run.tags["gpuinfer/kueue_queue"]) == ("acme", "acme-gpu")
    assert run.tags["dagster/partition"] == batch.id
    assert_one_completed_event(stack.receiver, batch.id)


def assert_one_completed_event(receiver: Receiver, batch_id: str) -> None:
    """The receiver took one `batch.completed` for the batch, verified by the openai SDK
    (its first try answered 500 and was retried)."""
    deadline = time.monotonic() + 60
    while not any(batch_id.encode() in body for _, _, body in receiver.taken()):
        assert time.monotonic() < deadline, f"no webhook for {batch_id}: {receiver.requests}"
        time.sleep(0.2)
    time.sleep(1.5)  # a duplicate would come within the retry backoff
    events = [
        receiver.webhooks.unwrap(body, headers, secret=receiver.secrets[path])
        for path, headers, body in receiver.taken()
    ]
    mine = [event for event in events if event.data.id == batch_id]
    assert [event.type for event in mine] == ["batch.completed"]


@pytest.mark.slow
def test_cancel_mid_run_terminates_the_run_and_keeps_partial_output(stack):
    rows = 4000
    data, _ = embedding_lines(rows, prefix="c")
    sdk = client(stack.base_url, stack.key)
    uploaded = sdk.files.create(file=("cancel.jsonl", data), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    started = poll(stack, batch.id, lambda b: b.request_counts.completed > 0)
    assert started.status == "in_progress"
    assert sdk.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = poll(stack, batch.id, lambda b: b.status == "cancelled", timeout=300)
    ids = jsonl_ids(sdk.files.content(done.output_file_id).read())
    assert len(ids) == len(set(ids)) == done.request_counts.completed
    assert 0 < len(ids) < rows and set(ids) <= {f"c-{i}" for i in range(rows)}
    assert finished_run(stack.instance(), batch.id).status == dg.DagsterRunStatus.CANCELED


@pytest.mark.slow
def test_chat_and_rerank_batches_answer_every_custom_id_once(stack, tiny_llama_dir):
    from assets.models import make_minilm_classifier

    make_minilm_classifier(cross_encoder_dir(), num_labels=1)
    sdk = client(stack.base_url, stack.key)
    chat = [
        {"model": "tiny-llama", "messages": [{"role": "user", "content": f"Say {i}"}]}
        for i in range(20)
    ]
    chat.append({"model": "tiny-llama", "messages": "not a list"})  # quarantined by the worker
    rerank = [
        {
            "model": "minilm-cross-encoder",
            "query": f"rivers {i}",
            "documents": ["A river flows.", "Bread rises.", f"River number {i}."],
        }
        for i in range(12)
    ]
    for endpoint, bodies in (("/v1/chat/completions", chat), ("/v1/rerank", rerank)):
        lines = [
            json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": endpoint, "body": b})
            for i, b in enumerate(bodies)
        ]
        uploaded = sdk.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
        )
        done = poll(stack, batch.id, lambda b: b.status not in ("in_progress", "finalizing"))
        assert done.status == "completed", f"{endpoint}: {done}\n{stack.logs()}"
        output = sdk.files.content(done.output_file_id).read()
        answered = jsonl_ids(output)
        for line in output.splitlines():
            body = json.loads(line)["response"]["body"]
            assert body["model"] == bodies[0]["model"] and body["usage"]["prompt_tokens"] > 0
        if done.error_file_id:
            answered += jsonl_ids(sdk.files.content(done.error_file_id).read())
        assert sorted(answered) == sorted(f"r-{i}" for i in range(len(bodies))), endpoint
        assert done.request_counts.completed + done.request_counts.failed == len(bodies)
    assert done.request_counts.failed == 0  # every rerank line answered


def reference_embeddings(model_dir: str, texts: list[str]) -> np.ndarray:
    """all-MiniLM-L6-v2 as sentence-transformers computes it: mean pooling, L2 norm."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()
