"""The durable queue of work leases that engine pools share: its records and its interface.

A *job* is what one Dagster step submits: a pool key, a priority, a JSON payload (the spec
and what else a pool worker needs) and its *work items* (one per partition, or per chunk
range of one). A pool worker *leases* the next item of its pool for a TTL, *heartbeats* to
keep it, and *completes*, *releases* or *fails* it. A lease that is not kept up expires: its
item goes back to the queue (an attempt counted), and the old holder's token is refused
from then on, so a worker that lost its lease finds out at its next heartbeat.

What the queue promises, and what it does not:

- At most one live lease per item at any time, and an item is marked done at most once,
  by the holder of its live lease. The queue is the source of *who should work on what*.
- It is not the source of *what is committed*: a worker that dies after writing a chunk and
  before `complete` leaves an item that is leased again. Exactly-once outputs stay in the
  storage layer's chunk markers and manifests; the next holder skips what is committed.
- Fair sharing: within a pool, the next lease goes to the job with the highest priority;
  among equal priorities, to the job holding the fewest live leases, then the one served
  least recently, then the one submitted first. A 1,000-item backfill and a 50-item batch
  of the same priority take turns; a higher priority goes first (Kueue `PriorityClass`
  values map onto it as they are).
- Time comes from the store's `clock` (seconds, `time.time` by default). With several
  hosts, keep their clocks in step (NTP); a TTL of tens of seconds tolerates the usual skew.

Beside the leases, two read-outs the control plane streams and scales by:

- *Job events* (`post_event`, `job_events`): what the workers say while they work (log
  lines, progress) and each item's result (`complete(lease, result)` stores it atomically
  with the completion), in one increasing `seq` across the store, so a step streams a job's
  events by polling with the last `seq` it saw.
- *Pool workers* (`report_worker`, `pool_workers`): each worker upserts its state (starting,
  loading, idle, busy, draining) with a TTL on every poll; one past its TTL is gone.

Two stores behave the same (tests/test_lease_queue.py runs one suite on both):
`SqliteLeaseQueue` (a file, the embedded default) and `PostgresLeaseQueue` (production).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from dagster_gpuinfer.pools.doorbell import Doorbell

Clock = Callable[[], float]
ItemState = Literal["queued", "leased", "done", "failed", "cancelled"]
EventKind = Literal["log", "progress", "result"]
WorkerState = Literal["starting", "loading", "idle", "busy", "draining"]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
WORKER_STATES: tuple[str, ...] = get_args(WorkerState)
JobState = Literal["running", "done", "failed", "cancelled"]

DEFAULT_MAX_ATTEMPTS = 3
# A lease lapses this long after its last heartbeat (the worker beats every third of it).
DEFAULT_LEASE_TTL_S = 30.0
# A pool worker exits after this long without a lease: how a pool scales back to zero.
DEFAULT_IDLE_TTL_S = 300.0


class LeaseQueueError(Exception):
    """Something the lease queue refused; the message says what and what to do."""


class LeaseLostError(LeaseQueueError):
    """The lease is no longer the item's live lease (expired, taken over, finished).

    Attributes:
        reason: One of `expired`, `taken_over`, `completed`, `failed`, `cancelled`,
            `released`, `unknown`.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class QueueUnavailable(ConnectionError):
    """The queue's store cannot be reached now (a restart, a failover, the network). The
    same call may succeed later; a change it carried may or may not have been applied."""


class UnknownJobError(LeaseQueueError):
    """No job with this id was submitted (or it was deleted)."""


class JobConflictError(LeaseQueueError):
    """A job id was submitted again with another pool or other work items."""


@dataclass(frozen=True)
class WorkItem:
    """One unit of leasable work of a job.

    Attributes:
        key: Unique within the job, e.g. `part-007` or `big@rows=0-100000#chunks=0-7`.
        payload: JSON-ready details the worker needs for this item (partition, chunk range).
    """

    key: str
    payload: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobSubmission:
    """A job: work items for one pool, leased fairly with the pool's other jobs.

    Attributes:
        job_id: Unique across the queue; submitting the same job again is a no-op.
        pool_key: The pool whose workers run it (`pool_key(spec)`).
        items: The work items, leased in this order within the job.
        priority: Higher goes first (a Kueue `PriorityClass` value as it is).
        payload: JSON-ready job data every lease carries (the spec, the run id, ...).
        max_attempts: Failed or expired leases of one item before it is marked failed.
    """

    job_id: str
    pool_key: str
    items: Sequence[WorkItem]
    priority: int = 0
    payload: Mapping[str, Any] = field(default_factory=dict)
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    def __post_init__(self) -> None:
        where = f"job {self.job_id!r}"
        if not self.job_id or not self.pool_key:
            raise ValueError(f"{where}: job_id and pool_key must be non-empty strings")
        if not self.items:
            raise ValueError(f"{where} has no work items; submit at least one")
        keys = [item.key for item in self.items]
        if len(set(keys)) != len(keys) or not all(keys):
            raise ValueError(f"{where}: work item keys must be non-empty and unique")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"{where}: priority must be an int, got {self.priority!r}")
        if self.max_attempts < 1:
            raise ValueError(f"{where}: max_attempts={self.max_attempts} must be at least 1")


@dataclass(frozen=True)
class Lease:
    """A worker's hold on one work item until `expires_at`.

    Attributes:
        item_id: The item's id in the store.
        job_id: Its job.
        item_key: `WorkItem.key`.
        pool_key: The pool it was leased from.
        token: This lease's secret; heartbeat, complete, release and fail present it.
        worker_id: Who holds it (for read-outs and messages).
        attempt: How many times the item has been leased, this lease included.
        priority: The job's priority.
        leased_at: When this lease was granted (store clock).
        expires_at: When it lapses unless heartbeated (store clock).
        ttl_s: The TTL a heartbeat extends it by unless told otherwise.
        job_payload: `JobSubmission.payload`.
        item_payload: `WorkItem.payload`.
    """

    item_id: int
    job_id: str
    item_key: str
    pool_key: str
    token: str
    worker_id: str
    attempt: int
    priority: int
    leased_at: float
    expires_at: float
    ttl_s: float
    job_payload: Mapping[str, Any]
    item_payload: Mapping[str, Any]


@dataclass(frozen=True)
class JobProgress:
    """Where a job stands; a lease past its expiry counts as queued.

    Attributes:
        job_id: The job.
        pool_key: Its pool.
        priority: Its priority.
        cancelled: Whether it was cancelled.
        total: Work items.
        queued: Waiting for a lease.
        leased: Under a live lease.
        done: Completed.
        failed: Out of attempts.
        leases: Leases granted over all items (a lease count above `total` means redos).
        cancel_reason: Why it was cancelled, if it was.
    """

    job_id: str
    pool_key: str
    priority: int
    cancelled: bool
    total: int
    queued: int
    leased: int
    done: int
    failed: int
    leases: int
    cancel_reason: str | None = None

    @property
    def state(self) -> JobState:
        """`cancelled`, `running` while items are queued or leased, then `failed` if any
        item failed, else `done`."""
        if self.cancelled:
            return "cancelled"
        if self.queued or self.leased:
            return "running"
        return "failed" if self.failed else "done"

    @property
    def finished(self) -> bool:
        """True once nothing of the job will be leased again."""
        return self.state != "running"


@dataclass(frozen=True)
class ItemStatus:
    """One work item's state, for the UI (warm engine, queue wait, lease count).

    Attributes:
        key: `WorkItem.key`.
        state: queued, leased, done, failed or cancelled (a lapsed lease reads queued).
        leases: Times leased.
        failures: Failed or expired leases counted against `max_attempts`.
        worker_id: The last holder, if any.
        queue_wait_s: From submission to its first lease; None until leased.
        last_error: The last failure's, release's or cancellation's reason.
    """

    key: str
    state: ItemState
    leases: int
    failures: int
    worker_id: str | None
    queue_wait_s: float | None
    last_error: str | None


@dataclass(frozen=True)
class JobEvent:
    """Something a worker said about a job: a log line, progress, or an item's result.

    Attributes:
        seq: Increasing across the store (stream a job's events with `after_seq`).
        job_id: The job.
        item_key: The work item it is about (None for job-wide events).
        worker_id: The worker that posted it (None when posted otherwise).
        kind: `log`, `progress` or `result`.
        at: When it was posted (store clock).
        payload: Its JSON-ready content.
    """

    seq: int
    job_id: str
    item_key: str | None
    worker_id: str | None
    kind: str
    at: float
    payload: Mapping[str, Any]


@dataclass(frozen=True)
class PoolWorker:
    """A pool worker as it last reported itself.

    Attributes:
        worker_id: Unique across the queue.
        pool_key: Its pool.
        state: `starting`, `loading`, `idle`, `busy` or `draining`.
        started_at: When it first reported (store clock).
        last_seen: When it last reported.
        expires_at: `last_seen` + its TTL; past it the worker is gone (not listed).
        info: JSON-ready facts (pid, host, pod, engine_load_seconds, leases_served, ...).
    """

    worker_id: str
    pool_key: str
    state: str
    started_at: float
    last_seen: float
    expires_at: float
    info: Mapping[str, Any]


@dataclass(frozen=True)
class PoolStats:
    """A pool's backlog and leases, for the scaler and the metrics.

    Attributes:
        pool_key: The pool.
        queued_by_priority: Items waiting for a lease per job priority (lapsed leases
            included: they are leasable).
        leased: Live leases.
        oldest_lease_age_s: Age of the oldest live lease (a stuck worker shows here); None
            when nothing is leased.
        expired_leases: Leases that lapsed, over the pool's jobs still stored.
        done: Items completed, over the pool's jobs still stored.
        failed: Items out of attempts, likewise.
    """

    pool_key: str
    queued_by_priority: Mapping[int, int]
    leased: int
    oldest_lease_age_s: float | None
    expired_leases: int
    done: int
    failed: int

    @property
    def queued(self) -> int:
        """Items waiting for a lease, all priorities."""
        return sum(self.queued_by_priority.values())

    @property
    def backlog(self) -> int:
        """Queued plus leased: the work a pool must hold workers for."""
        return self.queued + self.leased


class LeaseQueue(abc.ABC):
    """The durable queue of work leases (see the module docstring for its promises).

    Every method is safe to call from several threads and processes at once.
    """

    @abc.abstractmethod
    def submit(self, job: JobSubmission) -> JobProgress:
        """Queue `job`'s items. Submitting the same job again (same id, pool and item keys)
        changes nothing and returns its progress, so a retried step may resubmit.

        Raises:
            JobConflictError: the job id exists with another pool or other items.
        """

    @abc.abstractmethod
    def lease(self, pool_key: str, *, worker_id: str, ttl_s: float) -> Lease | None:
        """Lease the next item of `pool_key` (fair share across jobs) for `ttl_s` seconds.

        Lapsed leases of the pool go back to the queue first. Returns None when nothing of
        the pool is waiting.
        """

    @abc.abstractmethod
    def heartbeat(self, lease: Lease, *, ttl_s: float | None = None) -> Lease:
        """Extend a live lease to now + `ttl_s` (default: its own TTL).

        Raises:
            LeaseLostError: the lease lapsed, was taken over, or its item or job finished;
                stop working on it.
        """

    @abc.abstractmethod
    def complete(self, lease: Lease, result: Mapping[str, Any] | None = None) -> bool:
        """Mark the lease's item done. True when this call did; False when this same lease
        had already completed it (a retried call).

        `result` (JSON-ready), when given, is stored in the same transaction as a
        `JobEvent(kind="result", item_key=lease.item_key)`: a done item's result is never
        missing, and a retried call stores it once.

        Raises:
            LeaseLostError: the lease is not the item's live lease.
        """

    @abc.abstractmethod
    def release(self, lease: Lease, reason: str) -> None:
        """Hand a live lease back without counting an attempt (a worker draining or shut
        down); the item is queued again at once.

        Raises:
            LeaseLostError: the lease is not the item's live lease.
        """

    @abc.abstractmethod
    def fail(self, lease: Lease, reason: str) -> ItemState:
        """Give a live lease back as failed: an attempt is counted, and the item is queued
        again, or marked failed once it has used its job's `max_attempts`.

        Returns:
            The item's new state: `queued` or `failed`.

        Raises:
            LeaseLostError: the lease is not the item's live lease.
        """

    @abc.abstractmethod
    def reclaim_expired(self, pool_key: str | None = None) -> int:
        """Return lapsed leases (of one pool, or all) to the queue, counting an attempt each.
        `lease` does this for its pool; a reconciler may call it for all.

        Returns:
            How many leases were reclaimed.
        """

    @abc.abstractmethod
    def cancel(self, job_id: str, reason: str) -> JobProgress:
        """Cancel a job: its waiting items are never leased, its live leases are refused at
        their next heartbeat. Finished items stay as they are.

        Raises:
            UnknownJobError: no such job.
        """

    @abc.abstractmethod
    def job_progress(self, job_id: str) -> JobProgress:
        """Where a job stands.

        Raises:
            UnknownJobError: no such job.
        """

    @abc.abstractmethod
    def job_items(self, job_id: str) -> list[ItemStatus]:
        """Each work item's state, in submission order.

        Raises:
            UnknownJobError: no such job.
        """

    @abc.abstractmethod
    def post_event(self, lease: Lease, kind: str, payload: Mapping[str, Any]) -> int:
        """Store an event about the lease's item (kind `log`, `progress` or `result`).

        Returns:
            The event's `seq`.

        Raises:
            LeaseLostError: the lease is not the item's live lease (a stale worker's events
                are not mixed into the job's stream).
            ValueError: `kind` is not one of the three.
        """

    @abc.abstractmethod
    def job_events(self, job_id: str, *, after_seq: int = 0, limit: int = 1000) -> list[JobEvent]:
        """The job's events with `seq > after_seq`, oldest first, at most `limit`.

        Raises:
            UnknownJobError: no such job.
        """

    @abc.abstractmethod
    def report_worker(
        self,
        pool_key: str,
        worker_id: str,
        *,
        state: str,
        ttl_s: float,
        info: Mapping[str, Any] | None = None,
    ) -> PoolWorker:
        """Insert or update a worker's record: its state, now as `last_seen`, and an expiry
        `ttl_s` from now. `info` replaces the stored one when given (kept when None).

        Raises:
            ValueError: `state` is not a worker state, or `ttl_s` is not a positive number.
        """

    @abc.abstractmethod
    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (it exited); removing an unknown worker does nothing."""

    @abc.abstractmethod
    def pool_workers(self, pool_key: str) -> list[PoolWorker]:
        """The pool's live workers (`expires_at` after now), oldest first."""

    @abc.abstractmethod
    def pool_stats(self, pool_key: str) -> PoolStats:
        """The pool's backlog and leases (zeros for a pool with no jobs)."""

    @abc.abstractmethod
    def pools(self) -> list[str]:
        """The pools with unfinished jobs, sorted."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close this process's connections to the store."""

    def doorbell(self) -> Doorbell:
        """What wakes a waiter when the store changes (`pools.doorbell`): the store rings
        `pool_channel` when it queues an item and `job_channel` when a job changes. This
        default rings nothing (waiters poll)."""
        return Doorbell()

    def __enter__(self) -> LeaseQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    """`value`, or a ValueError that lists the `choices`."""
    if value not in choices:
        raise ValueError(f"{what}={value!r} must be one of {', '.join(choices)}")
    return value


def check_ttl(ttl_s: float) -> float:
    """`ttl_s` as a float, or a ValueError that says what a TTL must be."""
    if not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(
            f"lease ttl_s={ttl_s!r} must be a positive number of seconds: a few times the "
            "heartbeat interval, e.g. 30"
        )
    return float(ttl_s)
