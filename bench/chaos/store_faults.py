"""The chaos run's stores and their faults: the PostgreSQL server under the Dagster instance
and the batch API's store, and the batch API service beside the backfill.

- `Postgres`: a server of the harness's own (initdb from the test server's binaries, a free
  port, its own data folder), so that `postgres_restart` stops and starts the very server
  process the instance, the daemon, the run workers and the batch API talk to, and no one
  else's (the shared test server on 54329 is never touched).
- `BatchApi`: the real service (`python -m dagster_gpuinfer.batch_api serve`) over a fresh
  database of that server and files on the chaos S3 (through the fault proxy), with batches
  created through its HTTP endpoints; the batch pipelines (`batch_pipelines`, the sensor
  that turns batches into runs) join the chaos code location (`batch_defs`).

Kinds:
- `postgres_restart`: the server stopped (`pg_ctl stop`, mode `fast`: connections closed,
  a clean shutdown; or `immediate`: every server process killed, crash recovery at start)
  and started again after the fault's down time;
- `batch_api_restart`: SIGKILL to the service while one of its batches is not final, and
  the service started again after the down time (the reconcile loop resumes from the store).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from dagster_postgres.utils import DagsterPostgresException
from sqlalchemy.exc import OperationalError

STORE_FAULTS = ("postgres_restart", "batch_api_restart")
# What the instance raises while its server is down past its reconnect_for_s.
STORE_DOWN = (DagsterPostgresException, OperationalError)
FINAL = ("completed", "failed", "expired", "cancelled")
REPO = Path(__file__).resolve().parents[2]
PREFIX = "gpuinfer-chaos-pg-"  # the harness's server folders, under the temporary folder
OWNER = "owner.pid"  # in each: the pid of the harness that started the server
DEPLOY = REPO / "deploy"
MODEL = "chaos-minilm"  # the model the batch lines name (the route serves it)
ENDPOINT = "/v1/embeddings"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pg_bin(name: str) -> str:
    """A PostgreSQL server binary: on PATH, else the newest /usr/lib/postgresql/*/bin."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=_version)
    if not candidates:
        raise RuntimeError(
            f"no PostgreSQL {name}: install the server (`bash deploy/local/test-postgres.sh` "
            "installs Debian's postgresql package)"
        )
    return str(candidates[-1])


def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in path.parts[-3].split(".") if p.isdigit())


class Postgres:
    """`start()`, `stop(mode)`, `restart(down_s, mode)`, `database(name)`, `close()`.

    As root the server runs as the `postgres` user (PostgreSQL refuses root), as
    deploy/local/pg-cluster.sh does; pg_ctl detaches the server from this process. It
    listens on 127.0.0.1, and with `pod_gateway` (the pod executor's bridge address) also
    there, trusting the pods' /24: pool worker pods lease from a queue on it."""

    def __init__(
        self, folder: Path | None = None, port: int | None = None, pod_gateway: str | None = None
    ) -> None:
        self.folder = folder or Path(tempfile.mkdtemp(prefix=PREFIX))
        self.data = self.folder / "data"
        self.port = port or free_port()
        self.url = f"postgresql://gpuinfer@127.0.0.1:{self.port}/postgres"
        self.pod_gateway = pod_gateway
        self.restarts: list[str] = []

    def _as_owner(self, *command: str) -> subprocess.CompletedProcess:
        if os.getuid() == 0:
            line = " ".join(f"'{part}'" for part in command)
            command = ("su", "postgres", "-s", "/bin/bash", "-c", line)
        return subprocess.run(command, capture_output=True, text=True, check=False)

    def start(self) -> Postgres:
        if os.getuid() == 0:
            if subprocess.run(["id", "postgres"], capture_output=True).returncode:
                subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
            self.folder.chmod(0o755)
        if not (self.data / "PG_VERSION").exists():
            self.data.mkdir(parents=True, exist_ok=True)
            if os.getuid() == 0:
                shutil.chown(self.data, "postgres")
            done = self._as_owner(
                pg_bin("initdb"),
                "-D",
                str(self.data),
                "-U",
                "gpuinfer",
                "--auth=trust",
                "-E",
                "UTF8",
            )
            if done.returncode:
                raise RuntimeError(f"initdb {self.data} failed: {done.stderr[-2000:]}")
            if self.pod_gateway:
                pods = self.pod_gateway.rsplit(".", 1)[0] + ".0/24"
                with open(self.data / "pg_hba.conf", "a") as rules:
                    rules.write(f"host all all {pods} trust\n")
        hosts = ",".join(["127.0.0.1", *([self.pod_gateway] if self.pod_gateway else [])])
        options = f"-p {self.port} -k {self.data} -c listen_addresses={hosts}"
        done = self._as_owner(
            pg_bin("pg_ctl"), "-D", str(self.data), "-w", "-l", str(self.data / "server.log"),
            "-o", options, "start",
        )  # fmt: skip
        if done.returncode:
            log = (self.data / "server.log").read_text()[-2000:]
            raise RuntimeError(f"pg_ctl start on port {self.port} failed: {done.stderr}\n{log}")
        (self.folder / OWNER).write_text(str(os.getpid()))
        return self

    def stop(self, mode: str = "fast") -> None:
        done = self._as_owner(pg_bin("pg_ctl"), "-D", str(self.data), "-w", "-m", mode, "stop")
        if done.returncode:
            raise RuntimeError(f"pg_ctl stop -m {mode} failed: {done.stderr}")

    def server_pid(self) -> int | None:
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int(pid_file.read_text().splitlines()[0])
        return None

    def restart(self, down_s: float, mode: str) -> str:
        before = self.server_pid()
        self.stop(mode)
        time.sleep(down_s)
        self.start()
        after = self.server_pid()
        note = f"pg_ctl stop -m {mode} (postmaster {before}), {down_s:.1f} s down, now {after}"
        self.restarts.append(note)
        return note

    def database(self, name: str, host: str = "127.0.0.1") -> str:
        """A new database `name` (dropped first if there); its URL through `host` (one the
        server listens on)."""
        import psycopg2

        admin = psycopg2.connect(self.url)
        admin.autocommit = True
        with admin.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{name}"')
        admin.close()
        return f"postgresql://gpuinfer@{host}:{self.port}/{name}"

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, FileNotFoundError):
            self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


def stop_orphans(root: Path | None = None) -> list[Path]:
    """Stop and remove the servers of harnesses that died without closing them (SIGKILL):
    a server folder whose OWNER process is gone. The folders removed."""
    removed = []
    for folder in sorted(Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*")):
        try:
            owner = int((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not started yet, or not one of ours
        if psutil.pid_exists(owner):
            continue
        Postgres(folder=folder).close()
        removed.append(folder)
    return removed


@contextlib.contextmanager
def postgres(pod_gateway: str | None = None) -> Iterator[Postgres]:
    stop_orphans()
    server = Postgres(pod_gateway=pod_gateway).start()
    try:
        yield server
    finally:
        server.close()


def with_down_time(faults: list[Any], seconds: float | None) -> list[Any]:
    """`faults` with every store fault's down time set to `seconds` (unchanged if None)."""
    if seconds is None:
        return faults
    return [
        dataclasses.replace(f, seconds=seconds) if f.kind in STORE_FAULTS else f for f in faults
    ]


def instance_storage(url: str) -> dict[str, Any]:
    """deploy/dagster.yaml's run, event log and schedule storage sections, on `url`."""
    deployed = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    sections = ("run_storage", "event_log_storage", "schedule_storage")
    found = {name: copy.deepcopy(deployed[name]) for name in sections}
    for section in found.values():
        section["config"].pop("postgres_db")
        section["config"]["postgres_url"] = url
    return found


def answer_kind(answer: Any) -> str:
    """An HTTP answer's status, with OpenAI's error `code` when it is 5xx: `200`,
    `503 store_unavailable` (the store's server restarting: by design), `500 ...`."""
    if answer.status_code < 500:
        return str(answer.status_code)
    try:
        code = answer.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "no OpenAI error body"
    return f"{answer.status_code} {code}"


@dataclass
class BatchSetup:
    """What the code location's batch pipelines read (bench/chaos/defs.py via `batch_defs`)."""

    routes: list[dict[str, Any]]
    files_root: str
    store_url: str


def routes(model_path: str, chunk_size: int) -> list[dict[str, Any]]:
    return [
        {
            "model": MODEL,
            "endpoint": ENDPOINT,
            "pipeline": "chaos_batches",
            "model_path": model_path,
            "engine": {"dtype": "float32"},
            "chunk_size": chunk_size,
        }
    ]


def batch_defs(setup: Any, retry_policy: Any) -> list[Any]:
    """The batch pipelines and their sensor for the chaos code location (none without a
    batch setup), under the backfill's retry policy."""
    batch = getattr(setup, "batch", None)
    if batch is None:
        return []
    from dagster_gpuinfer.batch_api.pipelines import batch_pipelines

    pipelines = batch_pipelines(
        batch.routes,
        files_root=batch.files_root,
        store_url=batch.store_url,
        retry_policy=retry_policy,
        minimum_interval_seconds=1,
    )
    return [pipelines.defs]


def batch_lines(name: str, count: int, rng: random.Random) -> tuple[bytes, list[str]]:
    """`count` embedding request lines, custom ids `<name>-<n>`."""
    from bench.chaos.cluster import TOPICS

    ids = [f"{name}-{n:03d}" for n in range(count)]
    lines = [
        json.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": ENDPOINT,
                "body": {"model": MODEL, "input": f"A line on {rng.choice(TOPICS)}, {custom_id}."},
            }
        )
        for custom_id in ids
    ]
    return ("\n".join(lines) + "\n").encode(), ids


@dataclass
class BatchApi:
    """The batch API service as a process of its own; `batches`: id -> the custom ids sent."""

    folder: Path
    store_url: str
    files_root: str
    routes: list[dict[str, Any]]
    dagster_home: str
    s3_endpoint: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    key: str = ""
    batches: dict[str, list[str]] = field(default_factory=dict)
    answers: Counter = field(default_factory=Counter)  # `answer_kind` -> count
    kills: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def create_key(self) -> None:
        """The tenant's key, made in the store before the service starts (both would create
        the store's tables at once otherwise)."""
        from dagster_gpuinfer.batch_api.store import BatchStore

        store = BatchStore(self.store_url)
        try:
            self.key = store.create_key("chaos").token
        finally:
            store.close()

    def start(self, wait_s: float = 180.0) -> None:
        import httpx

        routes_file = self.folder / "routes.yaml"
        routes_file.write_text(json.dumps({"routes": self.routes}))  # JSON is YAML
        env = {
            **os.environ,
            "DAGSTER_HOME": self.dagster_home,
            "PYTHONPATH": str(REPO),
            "GPUINFER_S3_ENDPOINT": self.s3_endpoint,
            "GPUINFER_S3_REGION": "us-east-1",
        }
        command = [sys.executable, "-m", "dagster_gpuinfer.batch_api", "--store-url"]
        command += [self.store_url, "serve", f"--port={self.port}", f"--routes={routes_file}"]
        command += [f"--files-root={self.files_root}", "--reconcile-interval=1"]
        log = open(self.folder / "batch_api.log", "ab")  # noqa: SIM115 - the process keeps it
        self.process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=log)
        deadline = time.monotonic() + wait_s
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the batch API exited {self.process.returncode}: {self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"the batch API was not healthy within {wait_s:.0f} s: {self.log()}")

    def log(self) -> str:
        path = self.folder / "batch_api.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def kill(self) -> int | None:
        """SIGKILL (no drain, no shutdown hook); its pid."""
        if self.process is None or self.process.poll() is not None:
            return None
        pid = self.process.pid
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self.kills += 1
        return pid

    def restart(self, down_s: float) -> str:
        pid = self.kill()
        time.sleep(down_s)
        self.start()
        return f"SIGKILL pid {pid}, {down_s:.1f} s down, pid {self.process.pid}"

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One call with the tenant's key; None when the service did not answer (down)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            answer = httpx.request(
                method, self.base_url + path, headers=headers, timeout=60, **kwargs
            )
        except httpx.HTTPError:
            return None
        self.answers[answer_kind(answer)] += 1
        return answer

    def submit(self, name: str, data: bytes, ids: list[str]) -> str:
        """Upload `data` and create a batch of it (retried while the service is down)."""
        files = {"file": (f"{name}.jsonl", data, "application/jsonl")}
        upload = self._until_ok("POST", "/files", files=files, data={"purpose": "batch"})
        body = {"input_file_id": upload["id"], "endpoint": ENDPOINT, "completion_window": "24h"}
        batch = self._until_ok("POST", "/batches", json=body)
        self.batches[batch["id"]] = ids
        return batch["id"]

    def _until_ok(self, method: str, path: str, tries: int = 30, **kwargs: Any) -> Any:
        for _ in range(tries):
            answer = self.request(method, path, **kwargs)
            if answer is not None and answer.status_code == 200:
                return answer.json()
            if answer is not None and answer.status_code < 500:
                raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text[:500]}")
            time.sleep(2)
        raise RuntimeError(f"{method} {path}: no 200 in {tries} tries; {self.log()}")

    def statuses(self) -> dict[str, str]:
        """Each batch's status as the service tells it ('?' when it does not answer)."""
        found = {}
        for batch_id in self.batches:
            answer = self.request("GET", f"/batches/{batch_id}")
            ok = answer is not None and answer.status_code == 200
            found[batch_id] = answer.json()["status"] if ok else "?"
        return found

    def in_flight(self) -> list[str]:
        return [b for b, status in self.statuses().items() if status not in FINAL]

    def wait_final(self, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.statuses()
            if all(s in FINAL for s in found.values()) or time.monotonic() > deadline:
                return found
            time.sleep(2)

    def tally(self, timeout_s: float) -> dict[str, Any]:
        """Every batch final, and each line answered how often (output and error files)."""
        found = self.wait_final(timeout_s)
        tally: dict[str, Any] = {
            "submitted": len(self.batches),
            "completed": sum(1 for s in found.values() if s == "completed"),
            "statuses": found,
            "lines": sum(len(ids) for ids in self.batches.values()),
            "lines_lost": 0,
            "lines_duplicated": 0,
            "lines_unexpected": 0,
            "api_kills": self.kills,
        }
        for batch_id, ids in self.batches.items():
            seen = self._answered(batch_id)
            tally["lines_lost"] += sum(1 for i in ids if i not in seen)
            tally["lines_duplicated"] += sum(n - 1 for n in seen.values() if n > 1)
            tally["lines_unexpected"] += sum(1 for i in seen if i not in set(ids))
        server_errors = {kind: n for kind, n in self.answers.items() if kind.startswith("5")}
        tally["answers_5xx"] = sum(server_errors.values())
        tally["answers_5xx_by_kind"] = dict(sorted(server_errors.items()))
        return tally

    def _answered(self, batch_id: str) -> Counter:
        seen: Counter[str] = Counter()
        answer = self.request("GET", f"/batches/{batch_id}")
        if answer is None or answer.status_code != 200:
            return seen
        batch = answer.json()
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if not file_id:
                continue
            content = self.request("GET", f"/files/{file_id}/content")
            if content is not None and content.status_code == 200:
                seen.update(
                    json.loads(line)["custom_id"] for line in content.text.splitlines() if line
                )
        return seen


@dataclass
class Stores:
    """One phase's stores: the instance's and the batch store's databases on the harness's
    server, the batch API beside the backfill; the injector's target for STORE_FAULTS."""

    server: Postgres
    instance_url: str
    api: BatchApi | None
    seed: int
    failures: list[str] = field(default_factory=list)  # a restart that did not come back

    def instance_overrides(self) -> dict[str, Any]:
        return instance_storage(self.instance_url)

    def inject(self, kind: str, down_s: float, rng: random.Random) -> str | None:
        """Do `kind`; the note, or None when it cannot be done now (no batch in flight)."""
        if kind == "postgres_restart":
            return self.server.restart(down_s, rng.choice(("fast", "immediate")))
        in_flight = self.api.in_flight() if self.api is not None else []
        if not in_flight:
            return None
        return f"{self.api.restart(down_s)}, {len(in_flight)} batch(es) in flight"

    def start_api(self, dagster_home: str) -> None:
        """The service on the instance `dagster_home` describes (the harness's own)."""
        if self.api is not None:
            self.api.dagster_home = dagster_home
            self.api.create_key()
            self.api.start()

    def submit_batches(self, ready: Callable[[], bool], count: int, lines: int) -> None:
        """`count` batches of `lines` lines each, once `ready()` (the backfill's runs are
        queued, so the batches' runs queue after them and stay in flight a while)."""
        if self.api is None:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(*STORE_DOWN):
                if ready():
                    break
            time.sleep(1)
        rng = random.Random(self.seed)
        for index in range(count):
            data, ids = batch_lines(f"b{index}", lines, rng)
            self.api.submit(f"b{index}", data, ids)

    def tally(self, timeout_s: float) -> dict[str, Any]:
        return {} if self.api is None else self.api.tally(timeout_s)

    def close(self) -> None:
        if self.api is not None:
            self.api.close()


@contextlib.contextmanager
def phase_stores(found: Any, label: str, options: Any, setup: Any) -> Iterator[Stores]:
    """Fresh databases for one phase (`<label>_dagster`, `<label>_batches`) on the
    harness's server; with `options.batches`, the batch API (files under
    `s3://<bucket>/<label>-batches`) and `setup.batch` for the code location."""
    server = found.postgres
    api = None
    folder = Path(tempfile.mkdtemp(prefix=f"chaos-{label}-api-"))
    if getattr(options, "batches", 0):
        batch = BatchSetup(
            routes=routes(setup.model, options.chunk_size),
            files_root=f"s3://{found.bucket}/{label}-batches",
            store_url=server.database(f"chaos_{label}_batches"),
        )
        setup.batch = batch
        api = BatchApi(
            folder, batch.store_url, batch.files_root, batch.routes, "", setup.s3_endpoint
        )
    stores = Stores(server, server.database(f"chaos_{label}_dagster"), api, options.seed)
    try:
        yield stores
    finally:
        stores.close()
        shutil.rmtree(folder, ignore_errors=True)


def inject(
    injector: Any,
    fault: Any,
    rng: random.Random,
    started: float,
    ready: Callable[[], str | None] | None = None,
) -> None:
    """The injector's hand for STORE_FAULTS (bench/chaos/faults.py): done, or retried
    every 0.5 s until it can be (a batch in flight; with `ready`, once it says what the
    fault will meet, as the pool's live leases), or skipped after `give_up_s`."""
    from bench.chaos.faults import Injected

    deadline = time.monotonic() + injector.give_up_s
    while injector.stores is not None and not injector._stop.is_set():  # noqa: SLF001
        meets = ready() if ready is not None else ""
        try:
            note = None if meets is None else injector.stores.inject(fault.kind, fault.seconds, rng)
        except RuntimeError as exc:  # the server or the service did not come back
            injector.stores.failures.append(f"{fault.kind} failed: {exc}")
            break
        if note is not None:
            note = f"{note}, under {meets}" if meets else note
            injector.done.append(Injected(fault, time.monotonic() - started, _target(fault), note))
            return
        if time.monotonic() > deadline:
            break
        injector._stop.wait(0.5)  # noqa: SLF001
    injector.skipped.append(fault)


def _target(fault: Any) -> str:
    return "postgres" if fault.kind == "postgres_restart" else "batch_api"


def verdict(phase: Any) -> list[str]:
    """What is wrong with a phase's batches (empty without batches): each one completed,
    every line answered exactly once."""
    batches = phase.batches
    if not batches:
        return []
    wrong = []
    if batches["completed"] != batches["submitted"]:
        wrong.append(f"batches not completed: {batches['statuses']}")
    for name in ("lost", "duplicated", "unexpected"):
        if batches[f"lines_{name}"]:
            wrong.append(f"{batches[f'lines_{name}']} batch lines {name}")
    return wrong


def summary_rows() -> list[tuple[str, Callable[[Any], str]]]:
    """The summary table's rows for the batch API (report.summary_table)."""

    def get(phase: Any, name: str) -> Any:
        return phase.batches.get(name, "-")

    return [
        (
            "batches completed / submitted",
            lambda p: f"{get(p, 'completed')} / {get(p, 'submitted')}",
        ),
        ("batch lines answered once / sent", lambda p: _answered_once(p)),
        (
            "batch lines lost / duplicated",
            lambda p: f"{get(p, 'lines_lost')} / {get(p, 'lines_duplicated')}",
        ),
        ("batch API 5xx answers", _server_errors),
    ]


def _server_errors(phase: Any) -> str:
    """`3 (503 store_unavailable: 3)`: the count and, when any, what they were."""
    b = phase.batches
    if not b:
        return "-"
    kinds = b.get("answers_5xx_by_kind") or {}
    detail = ", ".join(f"{kind}: {n}" for kind, n in kinds.items())
    return f"{b['answers_5xx']} ({detail})" if detail else str(b["answers_5xx"])


def _answered_once(phase: Any) -> str:
    b = phase.batches
    if not b:
        return "-"
    once = b["lines"] - b["lines_lost"]
    return f"{once} / {b['lines']}"
