"""The batch API under load: two replicas over one PostgreSQL store, many clients at once.

    python -m bench.batch_load --clients 150 --seconds 180 --results bench/results/DIR
    python -m bench.batch_load --clients 6 --seconds 3 --results DIR     # the suite's smoke

What runs (all on this machine, no engine):

- a fresh database on a PostgreSQL server (`--postgres-url`, default
  `$GPUINFER_TEST_POSTGRES_URL`, else the one `deploy/local/test-postgres.sh` starts);
- `--replicas` (2) `python -m dagster_gpuinfer.batch_api serve` processes (uvicorn, each with
  its reconcile loop every second) over that store and one files root, as a deployment
  runs them behind a load balancer;
- a stand-in worker (a thread here): it commits each queued batch's partition, one to five
  seconds after the batch was queued, through the storage layer's own calls (an OpenAI
  output line per input line, a chunk part, the manifest), as the batch pipeline's worker
  would, so the replicas' reconcile loops finalize batches for real;
- `--clients` async clients (httpx), spread over `--tenants` tenants (one key each), each
  sending every request to a replica picked at random: upload a file, create a batch from
  it, delete the upload (half the time), cancel the batch (`--cancel-share`), poll it to a
  final state, download its output and check every input line is in it once, delete the
  output (half the time), list batches and files now and then. A 429 is waited out as its
  `Retry-After` says, at most 5 s. The tenant `tight` has small limits, so 429s of every
  kind are seen;
- after `--seconds`, the clients stop; the worker goes on until every batch created is
  final (`--drain-seconds` at most); then each tenant's batches and files are listed
  through the API (every page) and held against what the clients were told.

Reported: latency p50/p99/max per endpoint (from the client: queueing on the shared
machine included), answers by status and error code, 5xx, transport errors, objects lost
(acknowledged to a client, then missing), unknown (listed, never acknowledged: a create
whose answer was lost), duplicated (twice in the pages), batches not final, outputs that
did not match their inputs. `results.json` and `RESULTS.md` in `--results`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import resource
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.context import REPO_ROOT

FINAL = ("completed", "failed", "expired", "cancelled")
TIGHT = "tight"
# The limits of the tenant `tight` (everyone else gets the defaults of limits.py).
TIGHT_LIMITS = {
    "requests_per_second": 1,
    "burst": 3,
    "max_files": 6,
    "max_batches_in_flight": 3,
}
MAX_WAIT_SECONDS = 5.0
ROUTES_YAML = """routes:
  - model: mini
    endpoint: /v1/embeddings
    pipeline: batch_embed
    model_path: /models/not-loaded-here
"""


@dataclass
class LoadConfig:
    clients: int = 150
    seconds: float = 180.0
    tenants: int = 10
    replicas: int = 2
    poll_seconds: float = 1.0
    cancel_share: float = 0.25
    lines: int = 5
    drain_seconds: float = 120.0
    seed: int = 0
    postgres_url: str | None = None
    results: Path | None = None
    work: Path | None = None


@dataclass
class Ledger:
    """What the clients were told and saw: every answer, every id acknowledged."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    answers: Counter = field(default_factory=Counter)  # (endpoint, status, code) -> count
    transport_errors: Counter = field(default_factory=Counter)
    files: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    deleted: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    # Files whose DELETE got no answer (a transport error, or 429s until the client gave
    # up at the run's end): gone or kept, either is right.
    delete_unanswered: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    batches: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    outputs_checked: int = 0
    outputs_wrong: list[str] = field(default_factory=list)

    def record(self, endpoint: str, response: httpx.Response, seconds: float) -> None:
        self.latencies[endpoint].append(seconds)
        code = None
        if response.status_code >= 400:
            try:
                code = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "not-openai-shaped"
        self.answers[(endpoint, response.status_code, code)] += 1


@dataclass
class Clients:
    """What every client shares: the replicas, the keys, the ledger, the clock."""

    http: httpx.AsyncClient
    replicas: list[str]
    keys: dict[str, str]
    ledger: Ledger
    deadline: float
    config: LoadConfig

    def over(self) -> bool:
        return time.monotonic() >= self.deadline


# ------------------------------------------------------------------------- the clients


async def send(
    clients: Clients,
    rng: random.Random,
    tenant: str,
    endpoint: str,
    method: str,
    path: str,
    *,
    until: float | None = None,
    **kwargs: Any,
) -> httpx.Response | None:
    """One API call on a random replica, recorded; a 429 is waited out (its Retry-After, at
    most `MAX_WAIT_SECONDS`) and sent again until `until` (default: the run's end). None:
    the run ended first, or the request never got an answer (a transport error)."""
    until = clients.deadline if until is None else until
    headers = {"Authorization": f"Bearer {clients.keys[tenant]}"}
    while True:
        url = rng.choice(clients.replicas) + path
        started = time.monotonic()
        try:
            response = await clients.http.request(method, url, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            clients.ledger.transport_errors[f"{endpoint}: {type(exc).__name__}"] += 1
            return None
        clients.ledger.record(endpoint, response, time.monotonic() - started)
        if response.status_code != 429:
            return response
        wait = min(float(response.headers.get("retry-after", "1")), MAX_WAIT_SECONDS)
        if time.monotonic() + wait >= until:
            return None
        await asyncio.sleep(wait * rng.uniform(0.5, 1.0))


def input_lines(client_id: int, round_: int, lines: int) -> tuple[list[str], bytes]:
    ids = [f"c{client_id}-r{round_}-{i}" for i in range(lines)]
    body = [
        json.dumps(
            {
                "custom_id": i,
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "mini", "input": f"a note numbered {i}"},
            }
        )
        for i in ids
    ]
    return ids, ("\n".join(body) + "\n").encode()


async def upload_and_create(
    clients: Clients, rng: random.Random, tenant: str, data: bytes
) -> dict | None:
    """Upload a file and create a batch of it (deleting the upload half the time)."""
    ledger = clients.ledger
    files = {"file": ("in.jsonl", data, "application/jsonl")}
    answer = await send(
        clients,
        rng,
        tenant,
        "POST /files",
        "POST",
        "/files",
        files=files,
        data={"purpose": "batch"},
    )
    if answer is None or answer.status_code != 200:
        return None
    file_id = answer.json()["id"]
    ledger.files[tenant].add(file_id)
    body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    answer = await send(clients, rng, tenant, "POST /batches", "POST", "/batches", json=body)
    batch = answer.json() if answer is not None and answer.status_code == 200 else None
    if batch is not None:
        ledger.batches[tenant].add(batch["id"])
    if batch is None or rng.random() < 0.5:
        await delete_file(clients, rng, tenant, file_id)
    return batch


async def delete_file(clients: Clients, rng: random.Random, tenant: str, file_id: str) -> None:
    path = f"/files/{file_id}"
    until = time.monotonic() + 30  # a delete frees quota: it goes on past the run's end
    answer = await send(clients, rng, tenant, "DELETE /files/{id}", "DELETE", path, until=until)
    if answer is None:
        clients.ledger.delete_unanswered[tenant].add(file_id)
    elif answer.status_code == 200:
        clients.ledger.deleted[tenant].add(file_id)


async def follow_batch(
    clients: Clients, rng: random.Random, tenant: str, batch: dict, ids: list[str]
) -> None:
    """Cancel it (sometimes), poll it to a final state, check and maybe delete its output."""
    batch_id = batch["id"]
    if rng.random() < clients.config.cancel_share:
        await asyncio.sleep(rng.uniform(0, 2))
        path = f"/batches/{batch_id}/cancel"
        await send(clients, rng, tenant, "POST /batches/{id}/cancel", "POST", path)
    while batch["status"] not in FINAL and not clients.over():
        await asyncio.sleep(clients.config.poll_seconds * rng.uniform(0.5, 1.5))
        answer = await send(
            clients, rng, tenant, "GET /batches/{id}", "GET", f"/batches/{batch_id}"
        )
        if answer is not None and answer.status_code == 200:
            batch = answer.json()
    if batch["status"] != "completed" or not batch.get("output_file_id"):
        return
    output = batch["output_file_id"]
    answer = await send(
        clients, rng, tenant, "GET /files/{id}/content", "GET", f"/files/{output}/content"
    )
    if answer is None or answer.status_code != 200:
        return
    found = [json.loads(line)["custom_id"] for line in answer.content.splitlines() if line]
    clients.ledger.outputs_checked += 1
    if found != ids:
        clients.ledger.outputs_wrong.append(batch_id)
    if rng.random() < 0.5:
        await delete_file(clients, rng, tenant, output)


async def client_loop(clients: Clients, client_id: int) -> None:
    """One client's rounds until the run's end."""
    rng = random.Random(clients.config.seed * 100_003 + client_id)
    tenants = sorted(clients.keys)
    tenant = tenants[client_id % len(tenants)]
    round_ = 0
    await asyncio.sleep(rng.uniform(0, 1))  # the clients do not all start at one instant
    while not clients.over():
        ids, data = input_lines(client_id, round_, clients.config.lines)
        round_ += 1
        batch = await upload_and_create(clients, rng, tenant, data)
        if batch is not None:
            await follow_batch(clients, rng, tenant, batch, ids)
        if rng.random() < 0.3 and not clients.over():
            await send(clients, rng, tenant, "GET /batches", "GET", "/batches?limit=20")
        if rng.random() < 0.2 and not clients.over():
            await send(clients, rng, tenant, "GET /files", "GET", "/files?limit=100")


async def run_clients(config: LoadConfig, replicas: list[str], keys: dict[str, str]) -> Ledger:
    ledger = Ledger()
    # An idle connection is dropped after 2 s, before uvicorn's 5 s keep-alive closes it
    # from its side: at equal timeouts a request sent on a connection the server is closing
    # fails with a ReadError (seen in the first run), as behind any load balancer whose idle
    # timeout is not below the server's.
    limits = httpx.Limits(
        max_connections=config.clients * 2, max_keepalive_connections=None, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        clients = Clients(http, replicas, keys, ledger, time.monotonic() + config.seconds, config)
        await asyncio.gather(*(client_loop(clients, i) for i in range(config.clients)))
    return ledger


# ------------------------------------------------------------------------- the worker


def commit_batch(files: Any, pipeline: str, batch_id: str) -> None:
    """Commit a batch's partition as its worker would: an output line per input line in one
    part file, then the manifest (the storage layer's own calls)."""
    from dagster_gpuinfer.storage import (
        FileEntry,
        Manifest,
        chunk_part_name,
        commit_partition,
        filesystem_for,
        partition_dir,
        write_file_entry,
    )

    shard = files.input_template.replace("{partition_key}", batch_id)
    ids = [json.loads(line)["custom_id"] for line in files.lines(shard) if line.strip()]
    lines = [
        json.dumps(
            {
                "id": f"batch_req_{i}",
                "custom_id": i,
                "response": {"status_code": 200, "request_id": i, "body": {"data": []}},
                "error": None,
            }
        )
        for i in ids
    ]
    fs, path = filesystem_for(partition_dir(files.output_spec(pipeline), batch_id), files.storage)
    fs.create_dir(path, recursive=True)
    spec_hash, attempt = "10adbe0c10adbe0c", uuid.uuid4().hex[:8]
    name = chunk_part_name(spec_hash, 0, attempt, ".jsonl")
    part = write_file_entry(fs, path, name, ("\n".join(lines) + "\n").encode(), len(ids))
    manifest = Manifest(
        partition_key=batch_id,
        spec_hash=spec_hash,
        model="mini",
        task="embed",
        output_format="openai_batch",
        rows_in=len(ids),
        rows_out=len(ids),
        prompt_tokens=7 * len(ids),
        parts=[part],
        errors=FileEntry(name="errors.parquet", rows=0, bytes=0, sha256=""),
    )
    commit_partition(fs, path, manifest, [])


def worker_loop(store_url: str, files_root: str, stop: threading.Event, seed: int) -> None:
    """Commit every queued batch 1-5 s after it was queued, until `stop`."""
    from dagster_gpuinfer.batch_api.files import FileBytes
    from dagster_gpuinfer.batch_api.store import BatchStore

    store, files = BatchStore(store_url), FileBytes(files_root)
    rng, due, done = random.Random(seed), {}, set()
    try:
        while not stop.wait(0.25):
            for record in store.batches_in(("in_progress",), limit=5000):
                due.setdefault(record["id"], time.time() + rng.uniform(1, 5))
                if record["id"] not in done and due[record["id"]] <= time.time():
                    commit_batch(files, record["pipeline"], record["id"])
                    done.add(record["id"])
    finally:
        store.close()


# ------------------------------------------------------------------------- set-up


def fresh_database(server_url: str) -> tuple[str, str]:
    """A new database on the server: (its URL, its name)."""
    import psycopg2

    name = f"batch_load_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(server_url)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    admin.close()
    return server_url.rsplit("/", 1)[0] + f"/{name}", name


def drop_database(server_url: str, name: str) -> None:
    import psycopg2

    admin = psycopg2.connect(server_url)
    admin.autocommit = True
    admin.cursor().execute(f"DROP DATABASE {name} WITH (FORCE)")
    admin.close()


def postgres_server(given: str | None) -> str:
    """The PostgreSQL server: given, `$GPUINFER_TEST_POSTGRES_URL`, or the test server."""
    if given or os.environ.get("GPUINFER_TEST_POSTGRES_URL"):
        return given or os.environ["GPUINFER_TEST_POSTGRES_URL"]
    script = REPO_ROOT / "deploy" / "local" / "test-postgres.sh"
    return subprocess.run(
        ["bash", str(script)], check=True, capture_output=True, text=True
    ).stdout.strip()


def write_settings(work: Path) -> tuple[Path, Path]:
    """The routing table and the limits (`tight` small, the rest the defaults)."""
    routes, limits = work / "routes.yaml", work / "limits.yaml"
    routes.write_text(ROUTES_YAML)
    limits.write_text(json.dumps({"tenants": {TIGHT: TIGHT_LIMITS}}))
    return routes, limits


def start_replicas(
    count: int, store_url: str, work: Path, routes: Path, limits: Path
) -> tuple[list[subprocess.Popen], list[str]]:
    """`count` API processes on free ports; returns them and their base URLs once healthy."""
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home(work)), "PYTHONPATH": str(REPO_ROOT)}
    processes, urls = [], []
    for index in range(count):
        port = _free_port()
        command = [
            sys.executable,
            "-m",
            "dagster_gpuinfer.batch_api",
            "--store-url",
            store_url,
            "serve",
            f"--port={port}",
            f"--routes={routes}",
            f"--files-root={work / 'files'}",
            f"--limits={limits}",
            "--reconcile-interval=1",
        ]
        log = open(work / f"replica-{index}.log", "w")  # noqa: SIM115 (the process keeps it)
        processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        urls.append(f"http://127.0.0.1:{port}/v1")
    for process, url in zip(processes, urls, strict=True):
        _wait_healthy(process, url)
    return processes, urls


def dagster_home(work: Path) -> Path:
    """A DAGSTER_HOME whose (SQLite) instance exists before any replica starts: replicas
    starting at once on a fresh one raced to create its tables ("table bulk_actions
    already exists") and one exited."""
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    home = work / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").touch()
    dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))).dispose()
    return home


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process: subprocess.Popen, base_url: str, seconds: float = 120) -> None:
    health = base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"replica {base_url} exited {process.returncode}; see its log")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"replica {base_url} was not healthy within {seconds:.0f} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """This process's CPU seconds: the clients and the stand-in worker."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def create_keys(store_url: str, tenants: int) -> dict[str, str]:
    """A key per tenant: `tight` and tenant-1 ... tenant-(N-1)."""
    from dagster_gpuinfer.batch_api.store import BatchStore

    store = BatchStore(store_url)
    names = [TIGHT, *(f"tenant-{i}" for i in range(1, tenants))]
    keys = {name: store.create_key(name).token for name in names}
    store.close()
    return keys


# ------------------------------------------------------------------------- afterwards


def drain(store_url: str, seconds: float) -> float:
    """Wait until no batch is unfinished (the worker and the reconcile loops go on);
    returns the seconds it took."""
    from dagster_gpuinfer.batch_api.store import IN_FLIGHT_STATUSES, BatchStore

    store, started = BatchStore(store_url), time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            if not store.batches_in(IN_FLIGHT_STATUSES, limit=1):
                break
            time.sleep(0.5)
    finally:
        store.close()
    return time.monotonic() - started


def list_all(base_url: str, key: str, path: str, limit: int) -> list[dict]:
    """Every object of a list endpoint, page by page through `after` (429s waited out)."""
    headers, found, after = {"Authorization": f"Bearer {key}"}, [], None
    while True:
        params = {"limit": limit, **({"after": after} if after else {})}
        answer = httpx.get(f"{base_url}{path}", headers=headers, params=params, timeout=60)
        if answer.status_code == 429:
            time.sleep(float(answer.headers["retry-after"]))
            continue
        answer.raise_for_status()
        page = answer.json()
        found += page["data"]
        if not page["has_more"]:
            return found
        after = page["last_id"]


def reconcile_objects(ledger: Ledger, base_url: str, keys: dict[str, str]) -> dict[str, Any]:
    """Each tenant's batches and files as the API lists them, against what its clients were
    acknowledged: lost, unknown, duplicated, not final."""
    counts: Counter = Counter()
    statuses: Counter = Counter()
    for tenant, key in keys.items():
        batches = list_all(base_url, key, "/batches", 100)
        ids = [b["id"] for b in batches]
        statuses.update(b["status"] for b in batches)
        counts["batches_listed"] += len(ids)
        counts["batches_duplicated"] += len(ids) - len(set(ids))
        counts["batches_lost"] += len(ledger.batches[tenant] - set(ids))
        counts["batches_unknown"] += len(set(ids) - ledger.batches[tenant])
        counts["batches_not_final"] += sum(b["status"] not in FINAL for b in batches)
        files = list_all(base_url, key, "/files", 1000)
        file_ids = [f["id"] for f in files]
        counts["files_duplicated"] += len(file_ids) - len(set(file_ids))
        inputs = {f["id"] for f in files if f["purpose"] == "batch"}
        kept = ledger.files[tenant] - ledger.deleted[tenant] - ledger.delete_unanswered[tenant]
        counts["files_lost"] += len(kept - inputs)
        counts["files_delete_unanswered"] += len(ledger.delete_unanswered[tenant])
        counts["files_unknown"] += len(inputs - ledger.files[tenant])
        outputs = {b["output_file_id"] for b in batches if b.get("output_file_id")}
        missing = outputs - ledger.deleted[tenant] - ledger.delete_unanswered[tenant]
        missing -= set(file_ids)
        counts["output_files_lost"] += len(missing)
    return {**counts, "batch_statuses": dict(statuses)}


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (`share` in 0..1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def endpoint_table(ledger: Ledger) -> dict[str, dict[str, Any]]:
    """Per endpoint: requests, p50/p99/max milliseconds, answers by status (and code)."""
    table = {}
    for endpoint, seconds in sorted(ledger.latencies.items()):
        answers = {
            f"{status} {code}" if code else str(status): count
            for (name, status, code), count in sorted(ledger.answers.items(), key=str)
            if name == endpoint
        }
        table[endpoint] = {
            "requests": len(seconds),
            "p50_ms": round(1000 * percentile(seconds, 0.50), 1),
            "p99_ms": round(1000 * percentile(seconds, 0.99), 1),
            "max_ms": round(1000 * max(seconds), 1),
            "answers": answers,
        }
    return table


def summarize(ledger: Ledger, objects: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The run's totals: requests, rate, 5xx, 429 by code, transport errors, objects."""
    total = sum(ledger.answers.values())
    limited = Counter()
    for (_, status, code), count in ledger.answers.items():
        if status == 429:
            limited[code] += count
    return {
        "requests": total,
        "requests_per_second": round(total / seconds, 1),
        "server_errors_5xx": sum(c for (_, s, _), c in ledger.answers.items() if s >= 500),
        "rate_limited_429": sum(limited.values()),
        "rate_limited_by_code": dict(limited),
        "transport_errors": dict(ledger.transport_errors),
        "batches_created": sum(len(ids) for ids in ledger.batches.values()),
        "files_uploaded": sum(len(ids) for ids in ledger.files.values()),
        "outputs_checked": ledger.outputs_checked,
        "outputs_wrong": len(ledger.outputs_wrong),
        **objects,
    }


def markdown(results: dict[str, Any]) -> str:
    """RESULTS.md: the command, the totals and the endpoint table."""
    totals = results["totals"]
    lines = [
        "# Batch API under load",
        "",
        f"`{results['command']}` on {results['started']} ({results['machine']}).",
        "",
        "| endpoint | requests | p50 ms | p99 ms | max ms | answers |",
        "|---|---|---|---|---|---|",
    ]
    for endpoint, row in results["endpoints"].items():
        answers = ", ".join(f"{k}: {v}" for k, v in row["answers"].items())
        lines.append(
            f"| {endpoint} | {row['requests']} | {row['p50_ms']} | {row['p99_ms']} | "
            f"{row['max_ms']} | {answers} |"
        )
    lines += ["", "| total | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in totals.items()]
    lines += [
        "",
        f"CPU seconds over the run: replicas {results['replica_cpu_seconds']}, the bench "
        f"process (clients and stand-in worker) {results['bench_process_cpu_seconds']}.",
        "",
    ]
    return "\n".join(lines)


def run(config: LoadConfig, command: str) -> dict[str, Any]:
    """Set up, load, drain, reconcile; returns the results (and writes them if asked)."""
    server = postgres_server(config.postgres_url)
    store_url, database = fresh_database(server)
    work = config.work or Path(f"/tmp/batch-load-{database}")
    work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()[0]
    keys = create_keys(store_url, config.tenants)
    processes, urls = start_replicas(config.replicas, store_url, work, *write_settings(work))
    stop = threading.Event()
    worker = threading.Thread(
        target=worker_loop, args=(store_url, str(work / "files"), stop, config.seed), daemon=True
    )
    worker.start()
    try:
        began = time.monotonic()
        ledger = asyncio.run(run_clients(config, urls, keys))
        loaded = time.monotonic() - began
        drained = drain(store_url, config.drain_seconds)
        objects = reconcile_objects(ledger, urls[0], keys)
        alive = [process.poll() is None for process in processes]
        cpu = [round(cpu_seconds(p.pid), 1) for p in processes if p.poll() is None]
    finally:
        stop.set()
        worker.join(timeout=30)
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        drop_database(server, database)
    results = {
        "command": command,
        "started": started,
        "machine": f"{os.cpu_count()} CPUs, load average {load_at_start:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in config.__dict__.items()},
        "tight_limits": TIGHT_LIMITS,
        "load_seconds": round(loaded, 1),
        "drain_seconds": round(drained, 1),
        "replicas_alive_at_end": alive,
        "replica_cpu_seconds": cpu,
        "bench_process_cpu_seconds": round(_own_cpu_seconds(), 1),
        "server_tracebacks": sum(
            (work / f"replica-{i}.log").read_text().count("Traceback") for i in range(len(urls))
        ),
        "totals": summarize(ledger, objects, loaded),
        "endpoints": endpoint_table(ledger),
        "wrong_outputs": ledger.outputs_wrong[:20],
    }
    if config.results:
        config.results.mkdir(parents=True, exist_ok=True)
        (config.results / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (config.results / "RESULTS.md").write_text(markdown(results))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_load", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = LoadConfig()
    for name in ("clients", "tenants", "replicas", "lines", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    for name in ("seconds", "poll_seconds", "cancel_share", "drain_seconds"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=float, default=getattr(defaults, name))
    parser.add_argument("--postgres-url", help="a PostgreSQL server (a database is made)")
    parser.add_argument("--results", type=Path, help="write results.json and RESULTS.md here")
    parser.add_argument("--work", type=Path, help="scratch folder (default under /tmp)")
    args = parser.parse_args(argv)
    config = LoadConfig(**vars(args))
    command = "python -m bench.batch_load " + " ".join(sys.argv[1:] if argv is None else argv)
    results = run(config, command)
    print(markdown(results))
    totals = results["totals"]
    bad = (
        totals["server_errors_5xx"]
        + totals.get("batches_lost", 0)
        + totals.get("batches_duplicated", 0)
        + totals.get("batches_not_final", 0)
        + totals.get("files_lost", 0)
        + totals["outputs_wrong"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
