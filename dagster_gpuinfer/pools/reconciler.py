"""The pool reconciler: size each engine pool from its backlog, from zero to N and back.

A pool needs workers while it has work (queued or leased items) and none once it has none:
its size is `min(backlog, max_workers)`, zero without backlog; `desired_workers` says how
many of those are missing from the live workers, and `reconcile` starts them through a
backend; it never stops a worker: a worker exits by itself after
its idle TTL, which is how a pool scales back to zero (and a warm engine stays for the next
job in the meantime).

Backends start one worker of a pool:

- `LocalPoolBackend` (here): a detached `python -m dagster_gpuinfer.worker --pool KEY`
  subprocess on this host, its output in a log file beside the queue; the control plane
  gives it the worker's command, as it gives a pool pod its `k8s.command`.
- `K8sPoolBackend` (`dagster_gpuinfer.k8s`): a pool pod.

A started worker is reported to the queue as `starting` *before* it is started, so a
concurrent reconcile (another step, the sensor) counts it and does not start another;
`LocalPoolBackend.serialize` also holds a file lock around the count-and-start, so steps on
one host never over-start. The worker's own reports replace the `starting` one.

Imports neither dagster nor torch: the control plane (resource, sensor) calls it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dagster_gpuinfer.pools.stores import QUEUE_ENV

if TYPE_CHECKING:
    from dagster_gpuinfer.pools.lease_queue import LeaseQueue, PoolStats, PoolWorker

# A worker that stops counting toward its pool: it is going away.
LEAVING_STATES = frozenset({"draining"})


class WorkerSettings(Protocol):
    """What the reconciler reads of `GpuInferenceResource.pool` (`PoolSettings`)."""

    max_workers: int
    idle_ttl_s: float
    lease_ttl_s: float
    start_ttl_s: float


class PoolBackend(Protocol):
    """Starts one worker of a pool; the worker reports itself to the queue from then on."""

    def start(
        self, pool_key: str, worker_id: str, settings: WorkerSettings, env: Mapping[str, str]
    ) -> None:
        """Start worker `worker_id` of `pool_key` with `env` (the queue location in it)."""


@dataclass(frozen=True)
class Reconciled:
    """What one `reconcile` saw and did."""

    pool_key: str
    backlog: int
    live: int
    started: list[str] = field(default_factory=list)


def counted(live: Sequence[PoolWorker]) -> int:
    """Workers that count toward a pool's size: live ones (`starting` included) that are
    not leaving (`draining`)."""
    return sum(1 for worker in live if worker.state not in LEAVING_STATES)


def desired_workers(stats: PoolStats, live: Sequence[PoolWorker], max_workers: int) -> int:
    """How many workers to start in a pool now: the pool's size is one worker per item of
    backlog (queued plus leased), at most `max_workers`, zero without backlog; the live
    workers that count (`counted`: `starting` included, `draining` not) are subtracted.
    Never negative: live workers beyond the size are not stopped, they leave after their
    idle TTL.

    Examples:
        >>> from dagster_gpuinfer.pools.lease_queue import PoolStats
        >>> desired_workers(PoolStats("p", {0: 5}, 1, None, 0, 0, 0), [], max_workers=2)
        2
        >>> desired_workers(PoolStats("p", {}, 0, None, 0, 0, 0), [], max_workers=2)
        0
    """
    if max_workers < 0:
        raise ValueError(f"max_workers={max_workers} must be at least 0")
    size = min(stats.backlog, max_workers) if stats.backlog > 0 else 0
    return max(0, size - counted(live))


def reconcile(
    queue: LeaseQueue,
    pool_key: str,
    backend: PoolBackend,
    settings: WorkerSettings,
    *,
    env: Mapping[str, str] | None = None,
) -> Reconciled:
    """Start the workers `pool_key` lacks (`desired_workers`) through `backend`.

    Each new worker is reported `starting` (TTL `settings.start_ttl_s`) before the backend
    starts it; a start that raises removes that report and raises. Where the backend has a
    `serialize(pool_key)` context manager, the count and the starts run under it.

    Returns:
        The backlog, the live workers that counted, and the ids started.
    """
    guard = getattr(backend, "serialize", None)
    with guard(pool_key) if guard is not None else contextlib.nullcontext():
        stats = queue.pool_stats(pool_key)
        live = queue.pool_workers(pool_key)
        missing = desired_workers(stats, live, settings.max_workers)
        started: list[str] = []
        for _ in range(missing):
            worker_id = new_worker_id()
            queue.report_worker(
                pool_key,
                worker_id,
                state="starting",
                ttl_s=settings.start_ttl_s,
                info={"host": socket.gethostname(), "started_by": os.getpid()},
            )
            try:
                backend.start(pool_key, worker_id, settings, dict(env or {}))
            except BaseException:
                queue.remove_worker(worker_id)
                raise
            started.append(worker_id)
    return Reconciled(pool_key, stats.backlog, counted(live), started)


def new_worker_id() -> str:
    """A unique worker id, also a valid Kubernetes name part: `w-` and 10 hex digits."""
    return f"w-{uuid.uuid4().hex[:10]}"


def pool_worker_args(
    pool_key: str, worker_id: str, *, idle_ttl_s: float, lease_ttl_s: float
) -> list[str]:
    """The worker's arguments in pool mode, after its command (`python -m
    dagster_gpuinfer.worker`); the queue location travels in the environment."""
    return [
        "--pool",
        pool_key,
        "--worker-id",
        worker_id,
        "--idle-ttl",
        f"{idle_ttl_s:g}",
        "--lease-ttl",
        f"{lease_ttl_s:g}",
    ]


class LocalPoolBackend:
    """Pool workers as detached subprocesses on this host (laptops, CI, one GPU box).

    A worker runs in its own session (`start_new_session=True`): it outlives the step that
    started it, serves the next jobs of its pool warm, and exits after its idle TTL. Its
    output goes to `<log_dir>/<pool>-<worker>.log`.

    Args:
        queue_location: The lease queue, passed to the worker as `GPUINFER_LEASE_QUEUE`.
        log_dir: Where worker logs and the reconcile lock live (beside the queue file).
        command: The worker's command (`[python, "-m", WORKER_MODULE]`, a Python with
            vllm), before `pool_worker_args`.
    """

    def __init__(self, queue_location: str, log_dir: str | Path, *, command: Sequence[str]) -> None:
        self.queue_location = queue_location
        self.log_dir = Path(log_dir)
        self.command = list(command)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def log_path(self, pool_key: str, worker_id: str) -> Path:
        return self.log_dir / f"{pool_key}-{worker_id}.log"

    @contextlib.contextmanager
    def serialize(self, pool_key: str) -> Iterator[None]:
        """Hold `<log_dir>/<pool>.reconcile.lock`: one count-and-start at a time per host."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{pool_key}.reconcile.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def start(
        self, pool_key: str, worker_id: str, settings: WorkerSettings, env: Mapping[str, str]
    ) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = self.command + pool_worker_args(
            pool_key, worker_id, idle_ttl_s=settings.idle_ttl_s, lease_ttl_s=settings.lease_ttl_s
        )
        with open(self.log_path(pool_key, worker_id), "ab") as log:
            self.processes[worker_id] = subprocess.Popen(
                command,
                env={**os.environ, **env, QUEUE_ENV: self.queue_location},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )

    def exited(self) -> dict[str, int]:
        """The exit codes of the workers this backend started that have exited."""
        codes = {wid: process.poll() for wid, process in self.processes.items()}
        return {wid: code for wid, code in codes.items() if code is not None}

    def describe(self, pool_key: str, worker_id: str) -> dict[str, Any]:
        return {"log": str(self.log_path(pool_key, worker_id))}
