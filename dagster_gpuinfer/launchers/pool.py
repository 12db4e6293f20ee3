"""`PoolLauncher`: a step's partitions run by an engine pool's warm workers.

The step submits its job to the pool's lease queue (one work item per partition, the spec
in the job's payload: `pools-contract` section 2), makes sure the pool has workers
(`pools.reconciler.reconcile`, at submit and every `RECONCILE_SECONDS` while it waits, so a
worker killed mid-job is replaced once its lease lapses), streams the job's events into the
run's log, and returns the worker messages found in the items' results, plus one
`pool_lease` message per partition (warm engine, queue wait, leases) and a `run` summary of
what this job cost on the pool. The step stays the unit of Dagster's retries and lineage: an
item out of attempts leaves its partition uncommitted, and the resource fails the step
(retryable) naming it; a retry is a new job whose committed chunks are reused.

`pool_reconciler_sensor` reconciles every pool with backlog from the daemon, for jobs whose
step is gone or waiting on another host.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import dagster as dg

from dagster_gpuinfer.messages import (
    Fatal,
    PartitionCommitted,
    PartitionFailed,
    PoolLease,
    RunFinished,
    parse_message,
)
from dagster_gpuinfer.pools.doorbell import Listener, job_channel
from dagster_gpuinfer.pools.keys import pool_key
from dagster_gpuinfer.pools.lease_queue import JobProgress, JobSubmission, LeaseQueue, WorkItem
from dagster_gpuinfer.pools.metrics import push_pool_metrics
from dagster_gpuinfer.pools.reconciler import PoolBackend, WorkerSettings, reconcile
from dagster_gpuinfer.pools.stores import open_lease_queue
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import model_version

if TYPE_CHECKING:
    from dagster_gpuinfer.pools.lease_queue import JobEvent

RECONCILE_SECONDS = 5.0
# Workers this step may start in a row without the job hearing from any before it gives up
# (a worker that cannot start: missing CLI, bad environment), above the pool's max_workers.
EXTRA_STARTS_WITHOUT_NEWS = 2


def job_pool_key(spec: InferenceSpec) -> str:
    """The pool `spec` runs on: `pool_key` with the local model folder's version when the
    control plane sees the folder (a changed folder is another engine, another pool)."""
    try:
        revision = model_version(spec)
    except FileNotFoundError:
        revision = None
    return pool_key(spec, model_revision=revision)


def pool_job(
    spec: InferenceSpec, *, run_id: str, retry_number: int, priority: int = 0
) -> JobSubmission:
    """The job a step submits for `spec`'s partitions (`pools-contract` section 2)."""
    asset = spec.output.asset_name
    return JobSubmission(
        job_id=f"{run_id}-{asset}-{retry_number}",
        pool_key=job_pool_key(spec),
        items=[WorkItem(key=key, payload={"partition_key": key}) for key in spec.partition_keys],
        priority=priority,
        payload={"spec": spec.model_dump(mode="json"), "run_id": run_id, "asset": asset},
    )


class PoolLauncher:
    """`Launcher`: submit the step's job to its pool and wait for it (module docstring).

    Args:
        queue_location: The lease queue (`PoolSettings.location()`).
        settings: Pool sizing and TTLs (`PoolSettings`).
        backend: Starts pool workers (`LocalPoolBackend`, `K8sPoolBackend`).
        env: The workers' environment (the resource's worker env).
        priority: The job's lease priority (higher first).
    """

    def __init__(
        self,
        *,
        queue_location: str,
        settings: WorkerSettings,
        backend: PoolBackend,
        env: Mapping[str, str],
        priority: int = 0,
        poll_s: float = 0.5,
    ) -> None:
        self.queue_location = queue_location
        self.settings = settings
        self.backend = backend
        self.env = dict(env)
        self.priority = priority
        self.poll_s = poll_s

    def launch(
        self,
        *,
        context: dg.AssetExecutionContext,
        spec: InferenceSpec,
        extras: Mapping[str, Any],
        launch_attempt: int = 0,
    ) -> list[Any]:
        del extras, launch_attempt  # the spec travels in the job's payload
        job = pool_job(
            spec, run_id=context.run_id, retry_number=context.retry_number, priority=self.priority
        )
        with open_lease_queue(self.queue_location) as queue:
            queue.submit(job)
            try:  # from the submit on, an interruption cancels the job
                return self._wait(context, queue, job)
            except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
                queue.cancel(job.job_id, "the Dagster run was interrupted")
                context.log.info(f"run interrupted: cancelled pool job {job.job_id}")
                raise

    def _wait(
        self, context: dg.AssetExecutionContext, queue: LeaseQueue, job: JobSubmission
    ) -> list[Any]:
        context.log.info(
            f"submitted job {job.job_id} ({len(job.items)} partition(s)) to engine pool "
            f"{job.pool_key} (queue {redact(self.queue_location)})"
        )
        watch = JobWatch(
            queue,
            job,
            context.log,
            reconcile_pool=self._reconciler(queue, job),
            max_workers=self.settings.max_workers,
        )
        watch.wait(poll_s=self.poll_s)
        return watch.messages()

    def _reconciler(self, queue: LeaseQueue, job: JobSubmission) -> Callable[[], list[str]]:
        def run() -> list[str]:
            done = reconcile(queue, job.pool_key, self.backend, self.settings, env=self.env)
            return done.started

        return run


class JobWatch:
    """Waits for one pool job: streams its events into `log`, reconciles its pool, keeps
    each item's result."""

    def __init__(
        self,
        queue: LeaseQueue,
        job: JobSubmission,
        log: Any,
        *,
        reconcile_pool: Callable[[], list[str]],
        max_workers: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.max_workers = max_workers
        self.job = job
        self.log = log
        self.reconcile_pool = reconcile_pool
        self.clock = clock
        self.after_seq = 0
        self.results: dict[str, Mapping[str, Any]] = {}
        self.refused = False
        self.started_at = clock()
        self.starts_without_news = 0

    def wait(self, *, poll_s: float) -> JobProgress:
        """Until the job is finished (or a partition's spec was refused: the job is
        cancelled, the others would be refused too).

        Raises:
            dagster.Failure: retryable, when workers keep exiting without taking a lease.
        """
        # Listening before the first read: an event posted in between rings.
        with self.queue.doorbell().listen(job_channel(self.job.job_id)) as bell:
            progress = self._wait_heard(bell, poll_s)
        self.drain_events()
        if self.refused and not progress.finished:
            progress = self.queue.cancel(self.job.job_id, "a worker refused the job's spec")
        return progress

    def _wait_heard(self, bell: Listener, poll_s: float) -> JobProgress:
        """Read the job whenever its bell rings (an event, a result), else every `poll_s`."""
        last_reconcile = -RECONCILE_SECONDS
        while True:
            heard = self.drain_events()
            progress = self.queue.job_progress(self.job.job_id)
            if progress.finished or self.refused:
                return progress
            if self.clock() - last_reconcile >= RECONCILE_SECONDS:
                self._reconcile(heard)
                last_reconcile = self.clock()
            bell.wait(poll_s)

    def _reconcile(self, heard: bool) -> None:
        if heard:
            self.starts_without_news = 0
        started = self.reconcile_pool()
        if started:
            self.log.info(f"started pool worker(s) {started} for pool {self.job.pool_key}")
        self.starts_without_news += len(started)
        limit = self.max_workers + EXTRA_STARTS_WITHOUT_NEWS
        if self.starts_without_news > limit:
            self.queue.cancel(self.job.job_id, "pool workers exit without taking a lease")
            raise dg.Failure(
                description=f"{self.starts_without_news} pool workers of {self.job.pool_key} "
                f"were started for job {self.job.job_id} and none reported back; their logs "
                "say why (LocalPoolBackend: beside the queue file). The run can be retried.",
                allow_retries=True,
            )

    def drain_events(self) -> bool:
        """Read the job's new events; True when there were any."""
        heard = False
        while True:
            events = self.queue.job_events(self.job.job_id, after_seq=self.after_seq)
            if not events:
                return heard
            heard = True
            for event in events:
                self.after_seq = max(self.after_seq, event.seq)
                self.handle(event)

    def handle(self, event: JobEvent) -> None:
        """One event: a log line into the run's log, progress at debug, a result kept."""
        who = f"[pool {event.worker_id or '?'}]"
        payload = event.payload
        if event.kind == "log":
            level = str(payload.get("level", "info")).lower()
            write = getattr(self.log, level if level in LOG_LEVELS else "info")
            write(f"{who} {payload.get('message', '')}")
        elif event.kind == "progress":
            self.log.debug(f"{who} {event.item_key}: {dict(payload)}")
        elif event.kind == "result" and event.item_key is not None:
            self.results[event.item_key] = payload
            if any(isinstance(parse_message(m), Fatal) for m in payload.get("messages", ())):
                self.refused = True

    def messages(self) -> list[Any]:
        """The worker messages of every item's result, one `pool_lease` per partition that
        has a result, and the job's `run` summary."""
        messages: list[Any] = []
        leases: list[PoolLease] = []
        for item in self.queue.job_items(self.job.job_id):
            result = self.results.get(item.key)
            if result is None:
                if item.state in ("failed", "cancelled"):
                    self.log.warning(
                        f"partition {item.key!r} ended {item.state} on the pool after "
                        f"{item.leases} lease(s): {item.last_error}"
                    )
                continue
            messages.extend(result.get("messages", ()))
            facts = result.get("pool", {})
            lease = PoolLease(
                partition_key=item.key,
                worker_id=facts.get("worker_id", item.worker_id),
                warm=bool(facts.get("warm", False)),
                engine_load_seconds=float(facts.get("engine_load_seconds", 0.0)),
                queue_wait_s=item.queue_wait_s,
                leases=item.leases,
            )
            leases.append(lease)
            messages.append(lease.model_dump(mode="json"))
        messages.append(self.summary(leases, messages).model_dump(mode="json"))
        return messages

    def summary(self, leases: list[PoolLease], messages: list[Any]) -> RunFinished:
        """What this job cost on the pool: engine builds are the leases that found no warm
        engine; replicas the distinct workers that served it."""
        parsed = [parse_message(m) for m in messages]
        committed = [m for m in parsed if isinstance(m, PartitionCommitted)]
        cold = [lease for lease in leases if not lease.warm]
        return RunFinished(
            partitions=len(self.job.items),
            partitions_computed=sum(1 for m in committed if m.computed),
            partitions_failed=sum(1 for m in parsed if isinstance(m, PartitionFailed)),
            replicas=len({lease.worker_id for lease in leases}),
            model_loads=len(cold),
            load_seconds=max((lease.engine_load_seconds for lease in cold), default=None),
            wall_seconds=round(self.clock() - self.started_at, 3),
            launch="pool",
            pool_key=self.job.pool_key,
        )


LOG_LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})


def redact(location: str) -> str:
    """A queue location fit for a log line: a URL's password replaced by `***`."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(location)
    if not parts.password:
        return location
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def reconcile_all(
    queue: LeaseQueue, backend: PoolBackend, settings: WorkerSettings, env: Mapping[str, str]
) -> dict[str, list[str]]:
    """`reconcile` every pool with unfinished jobs; the workers started, by pool."""
    started: dict[str, list[str]] = {}
    for key in queue.pools():
        done = reconcile(queue, key, backend, settings, env=env)
        if done.started:
            started[key] = done.started
    return started


def pool_reconciler_sensor(
    *,
    resource_key: str = "gpu",
    name: str = "pool_reconciler_sensor",
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor that reconciles every engine pool with backlog (`reconcile_all`) from the
    daemon, with the `GpuInferenceResource` under `resource_key`: a job whose step waits
    elsewhere, or whose worker died while no step was reconciling, gets workers again.
    Steps reconcile their own pool while they wait; this is the backstop.

    Returns:
        The sensor definition: add it to `dagster.Definitions(sensors=[...])`.
    """

    @dg.sensor(
        name=name,
        minimum_interval_seconds=minimum_interval_seconds,
        required_resource_keys={resource_key},
        default_status=default_status,
        description="Starts engine pool workers for pools with queued work (launch='pool').",
    )
    def _pool_sensor(context: dg.SensorEvaluationContext, **_resources: Any) -> dg.SkipReason:
        resource = getattr(context.resources, resource_key)
        with open_lease_queue(resource.pool.location()) as queue:
            started = reconcile_all(
                queue, resource.pool_backend(), resource.pool, resource.pool_worker_env()
            )
            if resource.pushgateway_url:  # pools/metrics.py: size, depth, leases
                known = json.loads(context.cursor) if context.cursor else []
                shown = push_pool_metrics(resource.pushgateway_url, queue, known)
                context.update_cursor(json.dumps(shown))
        if started:
            context.log.info(f"started pool workers: {started}")
        return dg.SkipReason(f"started {started}" if started else "every pool has its workers")

    return _pool_sensor
