"""`PoolLauncher`: a step's partitions run by an engine pool's warm workers.

The step submits its job to the pool's lease queue (one work item per partition, or per
chunk range of a big one, `pools/ranges.py`; the spec in the job's payload: `pools-contract`
section 2), makes sure the pool has workers
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
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

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
from dagster_gpuinfer.pools.lease_queue import (
    ItemStatus,
    JobProgress,
    JobSubmission,
    LeaseQueue,
    QueueUnavailable,
    WorkItem,
)
from dagster_gpuinfer.pools.metrics import push_pool_metrics
from dagster_gpuinfer.pools.ranges import ChunkRange, range_rows, split_chunks
from dagster_gpuinfer.pools.reconciler import PoolBackend, WorkerSettings, reconcile
from dagster_gpuinfer.pools.stores import open_lease_queue
from dagster_gpuinfer.spec import InferenceSpec, split_partition_key
from dagster_gpuinfer.storage import filesystem_for, input_version, model_version

if TYPE_CHECKING:
    from dagster_gpuinfer.pools.lease_queue import JobEvent

RECONCILE_SECONDS = 5.0
# Workers this step may start in a row without the job hearing from any before it gives up
# (a worker that cannot start: missing CLI, bad environment), above the pool's max_workers.
EXTRA_STARTS_WITHOUT_NEWS = 2
# How long a waiting step rides out an unreachable lease queue (a PostgreSQL restart or
# failover) before it fails, retryably; the Dagster instance's storage waits as long
# (dagster_gpuinfer/instance_storage.py).
QUEUE_DOWN_LIMIT_S = 120.0


def job_pool_key(spec: InferenceSpec) -> str:
    """The pool `spec` runs on: `pool_key` with the local model folder's version when the
    control plane sees the folder (a changed folder is another engine, another pool)."""
    try:
        revision = model_version(spec)
    except FileNotFoundError:
        revision = None
    return pool_key(spec, model_revision=revision)


def pool_job(
    spec: InferenceSpec,
    *,
    run_id: str,
    retry_number: int,
    priority: int = 0,
    max_workers: int = 1,
) -> JobSubmission:
    """The job a step submits for `spec`'s partitions (`pools-contract` section 2): one
    item per partition, a big one split into chunk ranges when the pool has more than one
    worker (`job_items`)."""
    asset = spec.output.asset_name
    return JobSubmission(
        job_id=f"{run_id}-{asset}-{retry_number}",
        pool_key=job_pool_key(spec),
        items=job_items(spec, max_workers),
        priority=priority,
        payload={"spec": spec.model_dump(mode="json"), "run_id": run_id, "asset": asset},
    )


def job_items(spec: InferenceSpec, max_workers: int) -> list[WorkItem]:
    """The work items of `spec`'s partitions, in their order: a partition whose rows the
    step can count from a Parquet footer and that is bigger than the job's range size
    (`pools.ranges.range_rows`) becomes chunk ranges (`<key>#chunks=<start>-<end>`), so
    that the pool's workers share it; any other partition is one item. One worker: no
    ranges (they would only cost reads)."""
    keys = spec.partition_keys
    whole = [WorkItem(key=key, payload={"partition_key": key}) for key in keys]
    if max_workers < 2 or spec.input.is_table() or spec.input.resolved_format() != "parquet":
        return whole
    rows = {key: n for key in keys if (n := footer_rows(spec, key)) is not None}
    target = range_rows(sum(rows.values()), max_workers, spec.chunk_size)
    items: list[WorkItem] = []
    for item, key in zip(whole, keys, strict=True):
        spans = split_chunks(rows.get(key, 0), spec.chunk_size, target)
        if key not in rows or len(spans) == 1:
            items.append(item)
            continue
        version = input_version(spec, key)
        for start, end in spans:
            span = ChunkRange(start=start, end=end, total=spans[-1][1], input_version=version)
            items.append(WorkItem(key=range_item_key(key, span), payload=span.payload(key)))
    return items


def footer_rows(spec: InferenceSpec, partition_key: str) -> int | None:
    """The rows of a Parquet partition as its shard's footer says (a row-range key: its
    share), or None when the shard cannot be read here (the worker reports it)."""
    file_key, part = split_partition_key(partition_key)
    if part is not None and part.unit != "rows":
        return None
    try:
        fs, path = filesystem_for(spec.input.shard_uri(file_key), spec.storage)
        with fs.open_input_file(path) as handle:
            rows = int(pq.ParquetFile(handle).metadata.num_rows)
    except (OSError, pa.ArrowException):
        return None
    return rows if part is None else max(0, min(part.end, rows) - part.start)


# Between a partition key and its chunk range in a range item's key.
RANGE_MARK = "#chunks="


def range_item_key(partition_key: str, span: ChunkRange) -> str:
    """A chunk range's work item key: `<partition key>#chunks=<start>-<last>`."""
    return f"{partition_key}{RANGE_MARK}{span.start}-{span.end - 1}"


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
            spec,
            run_id=context.run_id,
            retry_number=context.retry_number,
            priority=self.priority,
            max_workers=self.settings.max_workers,
        )
        with open_lease_queue(self.queue_location) as queue, interrupts_remembered() as seen:
            queue.submit(job)
            try:  # from the submit on, an interruption cancels the job
                return self._wait(context, queue, job, seen)
            except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
                queue.cancel(job.job_id, "the Dagster run was interrupted")
                context.log.info(f"run interrupted: cancelled pool job {job.job_id}")
                raise

    def _wait(
        self,
        context: dg.AssetExecutionContext,
        queue: LeaseQueue,
        job: JobSubmission,
        interrupted: Callable[[], bool],
    ) -> list[Any]:
        partitions = len({item.payload.get("partition_key", item.key) for item in job.items})
        context.log.info(
            f"submitted job {job.job_id} ({partitions} partition(s) in {len(job.items)} work "
            f"item(s)) to engine pool {job.pool_key} (queue {redact(self.queue_location)})"
        )
        watch = JobWatch(
            queue,
            job,
            context.log,
            reconcile_pool=self._reconciler(queue, job),
            max_workers=self.settings.max_workers,
        )
        watch.wait(poll_s=self.poll_s, interrupted=interrupted)
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
        self.leases_seen = 0  # the job's `JobProgress.leases` at the last read

    def wait(
        self, *, poll_s: float, interrupted: Callable[[], bool] = lambda: False
    ) -> JobProgress:
        """Until the job is finished (or a partition's spec was refused: the job is
        cancelled, the others would be refused too).

        Raises:
            dagster.Failure: retryable, when workers keep exiting without taking a lease.
            dagster.DagsterExecutionInterruptedError: `interrupted()` says a SIGINT came
                whose own exception was lost (`interrupts_remembered`).
        """
        # Listening before the first read: an event posted in between rings.
        with self.queue.doorbell().listen(job_channel(self.job.job_id)) as bell:
            progress = self._wait_heard(bell, poll_s, interrupted)
        self.drain_events()
        if self.refused and not progress.finished:
            progress = self.queue.cancel(self.job.job_id, "a worker refused the job's spec")
        return progress

    def _wait_heard(
        self, bell: Listener, poll_s: float, interrupted: Callable[[], bool]
    ) -> JobProgress:
        """Read the job whenever its bell rings (an event, a result), else every `poll_s`;
        raise as soon as `interrupted()` says so."""
        last_reconcile = -RECONCILE_SECONDS
        # news since the last reconcile, not only in this read: an event, or a lease taken
        # (a worker that leased is no crash loop, whatever became of it after)
        heard = False
        down_since: float | None = None  # when the queue became unreachable
        while True:
            if interrupted():
                raise dg.DagsterExecutionInterruptedError()
            try:
                heard = self.drain_events() or heard
                progress = self.queue.job_progress(self.job.job_id)
                heard = heard or progress.leases > self.leases_seen
                self.leases_seen = max(self.leases_seen, progress.leases)
                if down_since is not None:
                    self.log.info(f"the lease queue answers again ({self._down_for(down_since)})")
                    down_since = None
                if progress.finished or self.refused:
                    return progress
                if self.clock() - last_reconcile >= RECONCILE_SECONDS:
                    self._reconcile(heard)
                    heard = False
                    last_reconcile = self.clock()
            except QueueUnavailable as exc:
                down_since = self._queue_down(down_since, exc)
            bell.wait(poll_s)

    def _queue_down(self, down_since: float | None, exc: QueueUnavailable) -> float:
        """Note an unreachable queue; when it has been so for QUEUE_DOWN_LIMIT_S, fail."""
        now = self.clock()
        if down_since is None:
            self.log.warning(f"{exc}; waiting up to {QUEUE_DOWN_LIMIT_S:.0f} s for it")
            return now
        if now - down_since >= QUEUE_DOWN_LIMIT_S:
            raise dg.Failure(
                description=f"the lease queue was unreachable for {self._down_for(down_since)}"
                f" while job {self.job.job_id} ran: {exc}. Committed partitions stay "
                "committed; the run can be retried once the queue's store answers.",
                allow_retries=True,
            )
        return down_since

    def _down_for(self, down_since: float) -> str:
        return f"{self.clock() - down_since:.0f} s"

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
                f"were started for job {self.job.job_id} and none took a lease or reported "
                "back; their logs say why (Kubernetes: the pods labelled gpuinfer/pool="
                f"{self.job.pool_key}; the local backend: beside the queue file). The run "
                "can be retried.",
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
        """The worker messages of every item's result (one per partition: the ranges of a
        split partition report it once, `partition_messages`), one `pool_lease` per
        partition that has a result, and the job's `run` summary."""
        messages: list[Any] = []
        leases: list[PoolLease] = []
        partition_of = {
            item.key: str(item.payload.get("partition_key") or item.key) for item in self.job.items
        }
        served: dict[str, list[tuple[ItemStatus, Mapping[str, Any]]]] = {}
        for item in self.queue.job_items(self.job.job_id):
            result = self.results.get(item.key)
            if result is None:
                if item.state in ("failed", "cancelled"):
                    self.log.warning(
                        f"work item {item.key!r} ended {item.state} on the pool after "
                        f"{item.leases} lease(s): {item.last_error}"
                    )
                continue
            served.setdefault(partition_of.get(item.key, item.key), []).append((item, result))
        for key, items in served.items():
            messages.extend(partition_messages([result for _, result in items]))
            lease = pool_lease(key, items)
            leases.append(lease)
            messages.append(lease.model_dump(mode="json"))
        facts = [result.get("pool", {}) for items in served.values() for _, result in items]
        summary = self.summary(len(set(partition_of.values())), facts, messages)
        messages.append(summary.model_dump(mode="json"))
        return messages

    def summary(
        self, partitions: int, facts: list[Mapping[str, Any]], messages: list[Any]
    ) -> RunFinished:
        """What this job cost on the pool: engine builds are the leases that found no warm
        engine; replicas the distinct workers that served it (`facts`: each item result's
        pool facts)."""
        parsed = [parse_message(m) for m in messages]
        committed = [m for m in parsed if isinstance(m, PartitionCommitted)]
        cold = [f for f in facts if not f.get("warm", False)]
        return RunFinished(
            partitions=partitions,
            partitions_computed=sum(1 for m in committed if m.computed),
            partitions_failed=sum(1 for m in parsed if isinstance(m, PartitionFailed)),
            replicas=len({f.get("worker_id") for f in facts}),
            model_loads=len(cold),
            load_seconds=max(
                (float(f.get("engine_load_seconds", 0.0)) for f in cold), default=None
            ),
            wall_seconds=round(self.clock() - self.started_at, 3),
            launch="pool",
            pool_key=self.job.pool_key,
        )


def partition_messages(results: list[Mapping[str, Any]]) -> list[Any]:
    """The worker messages of one partition's item results. A split partition's ranges each
    report what they saw: the range that committed it (`computed`), others that found it
    committed, or failures; the partition is reported once: its commit (the computing one
    first), else its first failure. Other messages pass as they are."""
    messages = [m for result in results for m in result.get("messages", ())]
    if len(results) == 1:
        return messages
    pairs = [(m, parse_message(m)) for m in messages]
    commits = [m for m, p in pairs if isinstance(p, PartitionCommitted)]
    commits.sort(key=lambda m: not m.get("computed", False))
    failures = [m for m, p in pairs if isinstance(p, PartitionFailed)]
    others = [m for m, p in pairs if not isinstance(p, PartitionCommitted | PartitionFailed)]
    return [*others, *(commits[:1] or failures[:1])]


def pool_lease(key: str, items: list[tuple[ItemStatus, Mapping[str, Any]]]) -> PoolLease:
    """How partition `key` ran on the pool, over its work items (a split partition has
    several): its workers, warm when every lease found a warm engine, the slowest cold
    lease's engine build, the first lease's queue wait, and the leases of all its items."""
    facts = [(item, result.get("pool", {})) for item, result in items]
    workers = sorted({str(f.get("worker_id", item.worker_id)) for item, f in facts})
    cold = [float(f.get("engine_load_seconds", 0.0)) for _, f in facts if not f.get("warm")]
    waits = [item.queue_wait_s for item, _ in facts if item.queue_wait_s is not None]
    return PoolLease(
        partition_key=key,
        worker_id=", ".join(workers) or None,
        warm=not cold,
        engine_load_seconds=max(cold, default=0.0),
        queue_wait_s=min(waits, default=None),
        leases=sum(item.leases for item, _ in facts),
    )


@contextmanager
def interrupts_remembered() -> Iterator[Callable[[], bool]]:
    """While a step waits on its pool job: a SIGINT (or a SIGTERM Dagster handles as one)
    still goes to Dagster's handler, which raises; and it is remembered, for the wait to
    raise it again. Python drops an exception raised by a signal handler that runs inside
    a garbage-collector callback (seen: SQLAlchemy's `_collection_gced`), and the step
    would then wait on. Off the main thread (no signals there) nothing is remembered."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    seen = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # default or ignored: Dagster handles nothing here
        yield seen.is_set
        return

    def remember(signo: int, frame: Any) -> None:
        seen.set()
        previous(signo, frame)

    wrapped = [signal.SIGINT]
    if signal.getsignal(signal.SIGTERM) is previous:
        wrapped.append(signal.SIGTERM)
    for signum in wrapped:
        signal.signal(signum, remember)
    try:
        yield seen.is_set
    finally:
        for signum in wrapped:
            signal.signal(signum, previous)


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
