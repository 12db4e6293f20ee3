"""(b) of the pools section: OpenAI batches through the batch API on an engine pool.

A real stack, as tests/test_batch_api_engine.py runs it: `dagster-daemon` (the batch
sensor, the queued run coordinator, one run process per batch) over
`bench/pool_batches_defs.py`, the batch API service (`python -m dagster_gpuinfer.batch_api
serve`) on loopback, and the `openai` SDK submitting. Two routes name the same model folder:
`minilm-pool` (`launch: pool`, on the section's lease queue, at most 2 workers) and
`minilm-run` (a worker per run, as today).

Measured: one batch of B x L lines on `minilm-run` (one run, one engine build), then B
batches of L lines created together on `minilm-pool` (files uploaded before the clock
starts): from the first create to the last batch seen completed, the engine builds (load
log), and every batch completed with each custom_id answered once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.context import REPO_ROOT
from bench.workloads import embed_texts
from dagster_gpuinfer.worker.loop.engine import LOAD_LOG_ENV

if TYPE_CHECKING:
    from bench.pools import PoolBench, PoolWatch

POOL_MODEL = "minilm-pool"
RUN_MODEL = "minilm-run"
FINISHED = ("completed", "failed", "expired", "cancelled")


class BatchStack:
    """The daemon, the batch API service and their environment, under `root`."""

    def __init__(self, bench: PoolBench, root: Path, *, max_concurrent_runs: int) -> None:
        self.root = root
        self.home = root / "dagster_home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.max_concurrent_runs = max_concurrent_runs
        self.store_url = f"sqlite:///{root / 'batch_api.sqlite'}"
        sizes = bench.ctx.sizes
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "PYTHONPATH": str(REPO_ROOT),
            "GPUINFER_BATCH_ROUTES": str(root / "routes.yaml"),
            "GPUINFER_BATCH_STORE_URL": self.store_url,
            "GPUINFER_BATCH_FILES_ROOT": str(root / "files"),
            "GPUINFER_BENCH_POOL_QUEUE": str(bench.queue),
            "GPUINFER_BENCH_POOL_MAX_WORKERS": "2",
            "GPUINFER_BENCH_POOL_IDLE_TTL": str(sizes.pools_idle_ttl_s),
            "GPUINFER_BENCH_POOL_LEASE_TTL": str(sizes.pools_lease_ttl_s),
            LOAD_LOG_ENV: str(bench.load_log),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        self.model_dir = bench.model
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.daemon: subprocess.Popen[bytes] | None = None
        self.api: subprocess.Popen[bytes] | None = None
        self.key = ""

    def write_config(self) -> None:
        (self.home / "dagster.yaml").write_text(
            "run_coordinator:\n"
            "  module: dagster._core.run_coordinator\n"
            "  class: QueuedRunCoordinator\n"
            "  config:\n"
            "    dequeue_interval_seconds: 1\n"
            f"    max_concurrent_runs: {self.max_concurrent_runs}\n"
            "telemetry:\n"
            "  enabled: false\n"
        )
        route = (
            "    endpoint: /v1/embeddings\n"
            f"    model_path: {self.model_dir}\n"
            "    engine: {dtype: float32}\n"
            "    chunk_size: 64\n"
        )
        (self.root / "routes.yaml").write_text(
            "routes:\n"
            f"  - model: {POOL_MODEL}\n    pipeline: batch_pool\n    launch: pool\n{route}"
            f"  - model: {RUN_MODEL}\n    pipeline: batch_run\n    launch: run\n{route}"
        )
        (self.root / "workspace.yaml").write_text(
            "load_from:\n"
            "  - python_file:\n"
            f"      relative_path: {REPO_ROOT / 'bench' / 'pool_batches_defs.py'}\n"
            f"      working_directory: {REPO_ROOT}\n"
            "      location_name: bench_pool_batches\n"
        )

    def start(self) -> None:
        """Storages made once (the daemon and the service migrating one fresh SQLite
        instance at once collide), a key, the daemon, the service."""
        import dagster as dg
        from dagster._core.instance.ref import InstanceRef

        from dagster_gpuinfer.batch_api.store import BatchStore

        self.write_config()
        instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(self.home)))
        instance.get_runs(limit=1)
        instance.all_instigator_state()
        instance.dispose()
        store = BatchStore(self.store_url)
        self.key = store.create_key("bench").token
        store.close()
        daemon = Path(sys.executable).with_name("dagster-daemon")
        self.daemon = self._spawn(
            [str(daemon), "run", "-w", str(self.root / "workspace.yaml")], "daemon.log"
        )
        serve = ["serve", "--port", str(self.port), "--reconcile-interval", "0.25"]
        self.api = self._spawn(
            [sys.executable, "-m", "dagster_gpuinfer.batch_api", *serve], "api.log"
        )
        self._wait_for_api()

    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.root / log_name, "ab") as log:
            return subprocess.Popen(
                command,
                env=self.env,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the daemon's code server and runs share its group
            )

    def _wait_for_api(self, timeout_s: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.api is None or self.api.poll() is not None:
                raise RuntimeError(f"the batch API exited:\n{self.logs()}")
            try:
                if httpx.get(f"{self.base_url}/batches", timeout=2).status_code == 401:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the batch API did not answer within {timeout_s} s")

    def close(self) -> None:
        for process in (self.api, self.daemon):
            if process is None or process.poll() is not None:
                continue
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        if self.daemon is not None:  # whatever its group left (runs, per-run workers)
            try:
                os.killpg(self.daemon.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.root / name).read_text()[-3000:]
            for name in ("daemon.log", "api.log")
            if (self.root / name).exists()
        )

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.key, max_retries=2, timeout=120)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def embedding_lines(model: str, texts: list[str], prefix: str) -> bytes:
    lines = [
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": text},
            }
        )
        for i, text in enumerate(texts)
    ]
    return ("\n".join(lines) + "\n").encode()


def run_batches(bench: PoolBench, watch: PoolWatch) -> dict[str, Any]:
    """(b): one big batch per-run, then many small ones together on the pool."""
    sizes = bench.ctx.sizes
    count, lines = sizes.pools_batches, sizes.pools_batch_lines
    texts = embed_texts(count * lines, seed=47)
    stack = BatchStack(bench, bench.root / "batch_api", max_concurrent_runs=count)
    try:
        stack.start()
        sdk = stack.client()
        builds = len(bench.builds())
        one = _submit_and_wait(stack, sdk, RUN_MODEL, [texts], "one")
        one["engine_builds"] = len(bench.builds()) - builds
        parts = [texts[i * lines : (i + 1) * lines] for i in range(count)]
        builds = len(bench.builds())
        watch.reset_most_live()
        pool = _submit_and_wait(stack, sdk, POOL_MODEL, parts, "b")
        pool["engine_builds"] = len(bench.builds()) - builds
        pool["pool_workers_at_once"] = watch.most_live_now()
    finally:
        stack.close()
    return {
        "batches": count,
        "lines_per_batch": lines,
        "max_concurrent_runs": count,
        "one_batch_per_run_launch": one,
        "batches_on_pool": pool,
        "ratio": one["seconds"] / pool["seconds"],
    }


def _submit_and_wait(
    stack: BatchStack, sdk: Any, model: str, batches: list[list[str]], prefix: str
) -> dict[str, Any]:
    """Upload each batch's file, create every batch (the clock starts at the first create),
    wait until all are finished; check each answered every custom_id once."""
    files = [
        sdk.files.create(
            file=(f"{prefix}{b}.jsonl", embedding_lines(model, texts, f"{prefix}{b}")),
            purpose="batch",
        )
        for b, texts in enumerate(batches)
    ]
    started = time.perf_counter()
    ids = [
        sdk.batches.create(
            input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
        ).id
        for f in files
    ]
    done: dict[str, Any] = {}
    finished_at: dict[str, float] = {}
    deadline = time.monotonic() + 1800
    while len(done) < len(ids) and time.monotonic() < deadline:
        for batch_id in ids:
            if batch_id not in done:
                batch = sdk.batches.retrieve(batch_id)
                if batch.status in FINISHED:
                    done[batch_id] = batch
                    finished_at[batch_id] = time.perf_counter() - started
        time.sleep(0.5)
    if len(done) < len(ids):
        raise RuntimeError(f"{len(ids) - len(done)} batches unfinished\n{stack.logs()}")
    answered = _answered(sdk, [done[i] for i in ids], batches, prefix)
    return {
        "seconds": max(finished_at.values()),
        "batch_seconds": [finished_at[i] for i in ids],
        "statuses": sorted({b.status for b in done.values()}),
        "completed": sum(1 for b in done.values() if b.status == "completed"),
        **answered,
    }


def _answered(sdk: Any, batches: list[Any], texts: list[list[str]], prefix: str) -> dict[str, Any]:
    """Each batch's output custom_ids against the lines it was given: lost, duplicated."""
    lost = duplicated = out = 0
    for b, batch in enumerate(batches):
        expected = {f"{prefix}{b}-{i}" for i in range(len(texts[b]))}
        ids: list[str] = []
        if batch.output_file_id:
            content = sdk.files.content(batch.output_file_id).read()
            ids = [json.loads(line)["custom_id"] for line in content.splitlines() if line]
        out += len(ids)
        lost += len(expected - set(ids))
        duplicated += len(ids) - len(set(ids))
    return {
        "lines_in": sum(map(len, texts)),
        "lines_out": out,
        "lost": lost,
        "duplicated": duplicated,
    }
