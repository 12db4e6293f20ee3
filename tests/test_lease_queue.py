"""The engine pools' queue of work leases (dagster_gpuinfer.pools), on both stores.

Every behaviour test runs on SQLite (a file in tmp_path) and on PostgreSQL (a fresh
database on the server in GPUINFER_TEST_POSTGRES_URL, which `make test` starts; skipped
when no URL is given). Time is a fake clock, so expiry is tested without sleeping; the
concurrency test runs on the real clock.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)
from support import fresh_postgres_database

from dagster_gpuinfer.pools import (
    JobConflictError,
    JobSubmission,
    Lease,
    LeaseLostError,
    LeaseQueue,
    PostgresLeaseQueue,
    SqliteLeaseQueue,
    UnknownJobError,
    WorkItem,
    open_lease_queue,
    pool_identity,
    pool_key,
)
from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, InputSpec, OutputSpec, SamplingParams

POOL = "pool-a"


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def items(count: int, prefix: str = "part") -> list[WorkItem]:
    return [WorkItem(f"{prefix}-{i:04d}", {"partition": f"{prefix}-{i:04d}"}) for i in range(count)]


def job(job_id: str, count: int, *, priority: int = 0, pool: str = POOL, **kwargs) -> JobSubmission:
    return JobSubmission(job_id, pool, items(count, job_id), priority=priority, **kwargs)


# --------------------------------------------------------------------------- stores


@pytest.fixture(params=["sqlite", "postgres"])
def store_location(request, tmp_path) -> Iterator[str]:
    """Where a fresh queue lives: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        yield str(tmp_path / "leases.db")
        return
    with fresh_postgres_database("leases") as url:
        yield url


@pytest.fixture
def open_queue(store_location) -> Iterator[Callable[..., LeaseQueue]]:
    """Opens queues on the test's store (as many as a test needs); all closed after."""
    opened: list[LeaseQueue] = []

    def opener(clock: Callable[[], float] | None = None) -> LeaseQueue:
        queue = open_lease_queue(store_location, clock=clock)
        opened.append(queue)
        return queue

    yield opener
    for queue in opened:
        queue.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(open_queue, clock) -> LeaseQueue:
    return open_queue(clock)


def drain(queue: LeaseQueue, *, worker_id: str = "w1", limit: int = 10_000) -> list[Lease]:
    """Lease and complete until the pool is empty; the leases in the order granted."""
    granted = []
    while (lease := queue.lease(POOL, worker_id=worker_id, ttl_s=30)) is not None:
        assert queue.complete(lease)
        granted.append(lease)
        assert len(granted) <= limit
    return granted


# --------------------------------------------------------------------------- expiry


def test_expired_lease_is_leased_again_and_its_stale_holder_is_refused(queue, clock):
    queue.submit(job("run-1", 1))
    first = queue.lease(POOL, worker_id="killed", ttl_s=10)
    assert first is not None and first.attempt == 1
    clock.advance(6)
    first = queue.heartbeat(first)  # kept alive: now expires at +16
    assert first.expires_at == clock.now + 10
    clock.advance(9)
    assert queue.lease(POOL, worker_id="other", ttl_s=10) is None  # still held
    clock.advance(2)  # lapsed
    with pytest.raises(LeaseLostError, match="expired 1.0 s ago") as lapsed:
        queue.heartbeat(first)
    assert lapsed.value.reason == "expired"

    second = queue.lease(POOL, worker_id="other", ttl_s=10)
    assert second is not None
    assert (second.item_key, second.attempt, second.worker_id) == (first.item_key, 2, "other")
    assert second.token != first.token
    for stale_call in (queue.heartbeat, queue.complete):
        with pytest.raises(LeaseLostError, match="leased again .*'other'") as taken:
            stale_call(first)
        assert taken.value.reason == "taken_over"
    with pytest.raises(LeaseLostError, match="taken_over|leased again"):
        queue.fail(first, "stale holder")

    assert queue.complete(second) is True
    assert queue.complete(second) is False  # a retried call: idempotent, done once
    with pytest.raises(LeaseLostError, match="completed"):
        queue.heartbeat(second)
    progress = queue.job_progress("run-1")
    assert (progress.done, progress.leases, progress.state) == (1, 2, "done")
    assert queue.lease(POOL, worker_id="other", ttl_s=10) is None
    assert queue.pool_stats(POOL).expired_leases == 1


def test_a_lapsed_lease_cannot_complete_even_before_anyone_else_leases_it(queue, clock):
    queue.submit(job("run-1", 1))
    lease = queue.lease(POOL, worker_id="slow", ttl_s=5)
    clock.advance(5)
    with pytest.raises(LeaseLostError) as lost:
        queue.complete(lease)
    assert lost.value.reason == "expired"
    assert queue.reclaim_expired() == 1
    with pytest.raises(LeaseLostError, match="expired"):  # reclaimed: still says why
        queue.release(lease, "draining")
    assert queue.job_progress("run-1").queued == 1


def test_expiries_and_failures_count_attempts_and_the_cap_fails_the_item(queue, clock):
    queue.submit(job("run-1", 1, max_attempts=3))
    lease = queue.lease(POOL, worker_id="w", ttl_s=5)
    queue.release(lease, "worker draining")  # a hand-back costs no attempt
    lease = queue.lease(POOL, worker_id="w", ttl_s=5)
    assert queue.fail(lease, "CUDA error: an illegal memory access") == "queued"
    queue.lease(POOL, worker_id="w", ttl_s=5)
    clock.advance(5)  # expires: the second attempt counted
    lease = queue.lease(POOL, worker_id="w", ttl_s=5)
    assert lease.attempt == 4
    assert queue.fail(lease, "out of memory again") == "failed"
    assert queue.lease(POOL, worker_id="w", ttl_s=5) is None
    (status,) = queue.job_items("run-1")
    assert (status.state, status.leases, status.failures) == ("failed", 4, 3)
    assert status.last_error == "failed on w: out of memory again"
    assert queue.job_progress("run-1").state == "failed"


def test_an_item_out_of_attempts_by_expiry_is_failed_not_leased_again(queue, clock):
    queue.submit(job("poison", 1, max_attempts=2))
    for _ in range(2):
        assert queue.lease(POOL, worker_id="crashing", ttl_s=5) is not None
        clock.advance(6)
    assert queue.lease(POOL, worker_id="crashing", ttl_s=5) is None
    assert queue.job_progress("poison").state == "failed"
    assert queue.pool_stats(POOL).failed == 1


# --------------------------------------------------------------------------- exactly once


def lease_and_complete_until_done(
    location: str, job_id: str, worker_id: str, abandon_every: int
) -> list[str]:
    """A worker: lease and complete until the job is finished, abandoning every
    `abandon_every`-th lease (as a killed worker would); the item keys it completed."""
    queue = open_lease_queue(location)
    completed: list[str] = []
    leased = 0
    try:
        while not queue.job_progress(job_id).finished:
            lease = queue.lease(POOL, worker_id=worker_id, ttl_s=0.3)
            if lease is None:
                time.sleep(0.02)
                continue
            leased += 1
            if leased % abandon_every == 0:
                continue  # killed mid-item: the lease lapses
            try:
                if queue.complete(lease):
                    completed.append(lease.item_key)
            except LeaseLostError:
                pass  # lapsed under a slow commit: another worker redoes it
    finally:
        queue.close()
    return completed


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_every_item_is_completed_exactly_once_by_concurrent_workers(store_location, runner):
    count = 150
    with open_lease_queue(store_location) as queue:
        queue.submit(job("backfill", count, max_attempts=100))
    workers = [("backfill", f"{runner}-{i}", 7 + i) for i in range(4)]
    if runner == "threads":
        results: dict[int, list[str]] = {}

        def run(index: int, args: tuple[str, str, int]) -> None:
            results[index] = lease_and_complete_until_done(store_location, *args)

        threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        completed = [key for keys in results.values() for key in keys]
        assert len(results) == len(workers)
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(len(workers), mp_context=context) as pool:
            futures = [
                pool.submit(lease_and_complete_until_done, store_location, *w) for w in workers
            ]
            completed = [key for future in futures for key in future.result(timeout=120)]
    assert sorted(completed) == [item.key for item in items(count, "backfill")]
    with open_lease_queue(store_location) as queue:
        progress = queue.job_progress("backfill")
        assert (progress.done, progress.state) == (count, "done")
        assert progress.leases > count  # abandoned leases were redone
        assert queue.pool_stats(POOL).expired_leases == progress.leases - count


# --------------------------------------------------------------------------- fair share


def test_a_small_job_is_not_starved_by_a_big_job_submitted_before_it(queue):
    queue.submit(job("backfill", 1000))
    queue.submit(job("tenant-batch", 50))
    order = [lease.job_id for lease in drain(queue)]
    assert len(order) == 1050
    # The two jobs take turns: the small one is done within its first 100 leases.
    assert order[:100].count("tenant-batch") == 50
    assert order[:4] == ["backfill", "tenant-batch", "backfill", "tenant-batch"]


def test_concurrent_leases_go_to_the_job_holding_fewest(queue):
    queue.submit(job("big", 100))
    queue.submit(job("small", 3))
    held = [queue.lease(POOL, worker_id=f"w{i}", ttl_s=60) for i in range(6)]
    assert sorted(lease.job_id for lease in held) == ["big"] * 3 + ["small"] * 3
    queue.submit(job("late", 10))  # holds none: the next two leases are its
    assert [queue.lease(POOL, worker_id="w", ttl_s=60).job_id for _ in range(2)] == ["late"] * 2


def test_higher_priority_is_leased_first_whatever_the_submission_order(queue):
    queue.submit(job("low", 3, priority=0))
    queue.submit(job("high", 2, priority=1000))  # e.g. Kueue PriorityClass values
    queue.submit(job("mid", 2, priority=100))
    order = [lease.job_id for lease in drain(queue)]
    assert order == ["high", "high", "mid", "mid", "low", "low", "low"]


def test_pools_are_separate(queue):
    queue.submit(job("a", 2, pool="pool-a"))
    queue.submit(job("b", 2, pool="pool-b"))
    assert queue.pools() == ["pool-a", "pool-b"]
    leases = [queue.lease("pool-b", worker_id="w", ttl_s=5) for _ in range(3)]
    assert [lease.job_id for lease in leases[:2]] == ["b", "b"] and leases[2] is None
    assert queue.pool_stats("pool-a").queued == 2


# --------------------------------------------------------------------------- jobs


def test_cancel_stops_leasing_and_refuses_live_leases(queue):
    queue.submit(job("cancelled", 4))
    queue.submit(job("other", 2))
    held, other, done = (queue.lease(POOL, worker_id="w", ttl_s=30) for _ in range(3))
    assert [held.job_id, other.job_id, done.job_id] == ["cancelled", "other", "cancelled"]
    queue.complete(done)
    progress = queue.cancel("cancelled", "the run was terminated")
    assert (progress.state, progress.done, progress.queued, progress.cancel_reason) == (
        "cancelled",
        1,
        0,
        "the run was terminated",
    )
    with pytest.raises(LeaseLostError, match="cancelled") as lost:
        queue.heartbeat(held)
    assert lost.value.reason == "cancelled"
    queue.heartbeat(other)  # other jobs go on
    assert queue.lease(POOL, worker_id="w", ttl_s=30).job_id == "other"
    assert queue.lease(POOL, worker_id="w", ttl_s=30) is None
    assert queue.pool_stats(POOL).queued == 0
    with pytest.raises(UnknownJobError, match="no job 'missing'"):
        queue.cancel("missing", "typo")


def test_resubmitting_a_job_is_a_no_op_and_a_changed_one_is_refused(queue):
    first = queue.submit(job("run-1", 3, payload={"spec": {"model": "m"}}))
    lease = queue.lease(POOL, worker_id="w", ttl_s=30)
    assert lease.job_payload == {"spec": {"model": "m"}}
    assert lease.item_payload == {"partition": "run-1-0000"}
    again = queue.submit(job("run-1", 3))  # a retried step
    assert (first.total, again.total, again.leased) == (3, 3, 1)
    with pytest.raises(JobConflictError, match="new job id"):
        queue.submit(job("run-1", 4))
    with pytest.raises(JobConflictError, match="pool 'pool-a'"):
        queue.submit(job("run-1", 3, pool="pool-b"))
    with pytest.raises(ValueError, match="not JSON-ready"):
        queue.submit(JobSubmission("bad", POOL, [WorkItem("x", {"at": object()})]))
    with pytest.raises(ValueError, match="ttl_s"):
        queue.lease(POOL, worker_id="w", ttl_s=0)


# --------------------------------------------------------------------------- read-outs


def test_read_outs_for_the_scaler_and_the_metrics(queue, clock):
    queue.submit(job("batch", 3, priority=10))
    queue.submit(job("backfill", 5, priority=0))
    empty = queue.pool_stats("nobody")
    assert (empty.queued, empty.leased, empty.oldest_lease_age_s) == (0, 0, None)

    oldest = queue.lease(POOL, worker_id="w1", ttl_s=60)
    clock.advance(10)
    queue.lease(POOL, worker_id="w2", ttl_s=5)
    clock.advance(4)
    stats = queue.pool_stats(POOL)
    assert dict(stats.queued_by_priority) == {10: 1, 0: 5}
    assert (stats.leased, stats.oldest_lease_age_s, stats.backlog) == (2, 14.0, 8)
    clock.advance(1)  # w2's lease lapses: it reads as queued and as expired at once
    stats = queue.pool_stats(POOL)
    assert (dict(stats.queued_by_priority), stats.leased, stats.expired_leases) == (
        {10: 2, 0: 5},
        1,
        1,
    )
    queue.complete(oldest)
    progress = queue.job_progress("batch")
    assert (progress.total, progress.queued, progress.leased, progress.done) == (3, 2, 0, 1)
    statuses = queue.job_items("batch")
    assert [s.state for s in statuses] == ["done", "queued", "queued"]
    assert [s.queue_wait_s for s in statuses] == [0.0, 10.0, None]
    assert statuses[1].worker_id == "w2" and statuses[1].leases == 1
    assert queue.reclaim_expired(POOL) == 1
    assert queue.pool_stats(POOL).expired_leases == 1  # counted once, before and after
    with pytest.raises(UnknownJobError, match="submit it first"):
        queue.job_progress("missing")


def test_stores_share_state_across_connections(open_queue, clock):
    submitter, worker = open_queue(clock), open_queue(clock)
    submitter.submit(job("run-1", 2))
    lease = worker.lease(POOL, worker_id="w", ttl_s=30)
    assert submitter.job_progress("run-1").leased == 1
    worker.complete(lease)
    assert submitter.job_progress("run-1").done == 1


# --------------------------------------------------------------------------- job events


def test_complete_stores_the_result_once_with_the_completion(queue, clock):
    queue.submit(job("run-1", 2))
    first = queue.lease(POOL, worker_id="w1", ttl_s=30)
    clock.advance(2)
    result = {"messages": [{"type": "PartitionCommitted"}], "pool": {"warm": False}}
    assert queue.complete(first, result)
    assert queue.complete(first, result) is False  # a retried call stores nothing more
    (event,) = queue.job_events("run-1")
    assert (event.kind, event.item_key, event.worker_id, event.at) == (
        "result",
        first.item_key,
        "w1",
        1_002.0,
    )
    assert event.payload == result
    second = queue.lease(POOL, worker_id="w2", ttl_s=30)
    assert queue.complete(second)  # no result given: no event
    assert len(queue.job_events("run-1")) == 1
    queue.submit(job("run-2", 1))
    third = queue.lease(POOL, worker_id="w3", ttl_s=30)
    with pytest.raises(ValueError, match="not JSON-ready"):
        queue.complete(third, {"x": object()})
    assert queue.job_progress("run-2").leased == 1  # the refused result left it leased


def test_a_lost_lease_neither_completes_nor_stores_its_result(queue, clock):
    queue.submit(job("run-1", 1))
    lost = queue.lease(POOL, worker_id="w1", ttl_s=5)
    clock.advance(6)
    taker = queue.lease(POOL, worker_id="w2", ttl_s=30)
    with pytest.raises(LeaseLostError) as refused:
        queue.complete(lost, {"messages": ["stale"]})
    assert refused.value.reason == "taken_over"
    with pytest.raises(LeaseLostError):
        queue.post_event(lost, "log", {"message": "stale"})
    queue.complete(taker, {"messages": ["fresh"]})
    assert [e.payload for e in queue.job_events("run-1")] == [{"messages": ["fresh"]}]


def test_events_stream_in_order_by_seq_and_page_with_after_seq(queue, clock):
    queue.submit(job("run-1", 2))
    queue.submit(job("run-2", 1))
    a, other, b = (queue.lease(POOL, worker_id="w", ttl_s=30) for _ in range(3))
    assert (a.job_id, other.job_id, b.job_id) == ("run-1", "run-2", "run-1")
    seqs = [
        queue.post_event(a, "log", {"level": "info", "message": "engine built"}),
        queue.post_event(other, "progress", {"rows_done": 1}),
        queue.post_event(b, "progress", {"rows_done": 5, "chunks_committed": 1}),
    ]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    events = queue.job_events("run-1")
    assert [(e.seq, e.kind, e.item_key) for e in events] == [
        (seqs[0], "log", a.item_key),
        (seqs[2], "progress", b.item_key),
    ]
    assert queue.job_events("run-1", after_seq=seqs[0]) == events[1:]
    assert queue.job_events("run-1", limit=1) == events[:1]
    assert queue.job_events("run-1", after_seq=seqs[2]) == []
    with pytest.raises(ValueError, match="event kind='chat' must be one of log, progress"):
        queue.post_event(a, "chat", {})
    with pytest.raises(UnknownJobError):
        queue.job_events("missing")
    queue.cancel("run-1", "interrupted")
    with pytest.raises(LeaseLostError, match="cancelled"):
        queue.post_event(a, "log", {"message": "after cancel"})


def post_events(location: str, job_id: str, worker_id: str, count: int) -> list[int]:
    """A worker: lease one item of `job_id` and post `count` progress events on it."""
    with open_lease_queue(location) as queue:
        lease = queue.lease(POOL, worker_id=worker_id, ttl_s=60)
        assert lease is not None and lease.job_id == job_id
        return [queue.post_event(lease, "progress", {"n": n}) for n in range(count)]


def test_a_reader_polling_after_seq_misses_no_event_of_concurrent_writers(store_location):
    """Several writers post to one job while a reader polls with the last seq it saw:
    the reader gets every event exactly once, in seq order (no late-committed gap)."""
    writers, per_writer = 4, 60
    with open_lease_queue(store_location) as queue:
        queue.submit(job("busy", writers))
    done = threading.Event()
    seen: list[int] = []

    def read() -> None:
        with open_lease_queue(store_location) as reader:
            while True:
                finished = done.is_set()
                events = reader.job_events("busy", after_seq=seen[-1] if seen else 0)
                seen.extend(event.seq for event in events)
                if finished and not events:
                    return

    posted: dict[int, list[int]] = {}
    reader = threading.Thread(target=read)
    reader.start()
    threads = [
        threading.Thread(
            target=lambda i=i: posted.__setitem__(
                i, post_events(store_location, "busy", f"w{i}", per_writer)
            )
        )
        for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    done.set()
    reader.join(timeout=120)
    every = sorted(seq for seqs in posted.values() for seq in seqs)
    assert len(every) == writers * per_writer
    assert seen == every


# --------------------------------------------------------------------------- pool workers


def test_workers_report_upsert_and_vanish_past_their_ttl(queue, clock):
    first = queue.report_worker(POOL, "w1", state="starting", ttl_s=30, info={"pid": 7})
    assert (first.state, first.started_at, first.expires_at, first.info) == (
        "starting",
        1_000.0,
        1_030.0,
        {"pid": 7},
    )
    clock.advance(10)
    queue.report_worker(POOL, "w2", state="loading", ttl_s=5)
    again = queue.report_worker(POOL, "w1", state="busy", ttl_s=30)  # info kept
    assert (again.state, again.started_at, again.last_seen, again.info) == (
        "busy",
        1_000.0,
        1_010.0,
        {"pid": 7},
    )
    queue.report_worker("pool-b", "w3", state="idle", ttl_s=30, info={"warm": True})
    assert [w.worker_id for w in queue.pool_workers(POOL)] == ["w1", "w2"]
    clock.advance(5)  # w2 reported a 5 s TTL and went silent
    assert [w.worker_id for w in queue.pool_workers(POOL)] == ["w1"]
    updated = queue.report_worker(POOL, "w1", state="idle", ttl_s=30, info={"leases": 2})
    assert updated.info == {"leases": 2}
    queue.remove_worker("w1")
    queue.remove_worker("never-seen")
    assert queue.pool_workers(POOL) == []
    assert [w.info for w in queue.pool_workers("pool-b")] == [{"warm": True}]
    with pytest.raises(ValueError, match="worker state='asleep' must be one of starting"):
        queue.report_worker(POOL, "w1", state="asleep", ttl_s=30)
    with pytest.raises(ValueError, match="ttl_s"):
        queue.report_worker(POOL, "w1", state="idle", ttl_s=-1)


def test_a_store_made_before_events_and_workers_gets_their_tables(store_location, clock):
    """A queue created by the release before these tables existed (jobs and items only)
    opens with them added, and its jobs stay."""
    from dagster_gpuinfer.pools.sql_queue import schema_statements

    if store_location.startswith("postgresql://"):
        import psycopg2

        connection = psycopg2.connect(store_location)
        statements = schema_statements(id_column="BIGSERIAL PRIMARY KEY", real="DOUBLE PRECISION")
        with connection, connection.cursor() as cursor:
            cursor.execute("CREATE SEQUENCE IF NOT EXISTS gpuinfer_pool_served")
            for statement in statements[:5]:
                cursor.execute(statement)
            cursor.execute(
                "INSERT INTO gpuinfer_pool_jobs (job_id, pool_key, priority, payload, "
                "max_attempts, state, submitted_at, served_seq) "
                "VALUES ('old', 'pool-a', 0, '{}', 3, 'active', 1, 0)"
            )
        connection.close()
    else:
        import sqlite3

        connection = sqlite3.connect(store_location)
        for statement in schema_statements(id_column="INTEGER PRIMARY KEY", real="REAL")[:5]:
            connection.execute(statement)
        connection.execute(
            "INSERT INTO gpuinfer_pool_jobs (job_id, pool_key, priority, payload, "
            "max_attempts, state, submitted_at, served_seq) "
            "VALUES ('old', 'pool-a', 0, '{}', 3, 'active', 1, 0)"
        )
        connection.commit()
        connection.close()
    with open_lease_queue(store_location, clock=clock) as queue:
        assert queue.job_events("old") == []
        assert queue.report_worker(POOL, "w", state="idle", ttl_s=30).worker_id == "w"


# --------------------------------------------------------------------------- pool keys


def make_spec(**changes) -> InferenceSpec:
    fields = {
        "model": "/models/Qwen2.5-0.5B-Instruct",
        "task": "generate",
        "input": InputSpec(uri="data/{partition_key}.parquet"),
        "output": OutputSpec(root="out", asset_name="answers"),
    }
    return InferenceSpec(**{**fields, **changes})


def test_pool_key_covers_what_fixes_the_engine_and_nothing_else():
    base = make_spec()
    key = pool_key(base)
    assert key.startswith("qwen2-5-0-5b-instruct-") and len(key) <= 63
    same_engine = [
        make_spec(sampling=SamplingParams(temperature=0.7, max_tokens=256)),
        make_spec(partition_keys=["a", "b"], chunk_size=64, replicas=4),
        make_spec(task="chat", input=InputSpec(uri="other/{partition_key}.jsonl")),
        make_spec(output=OutputSpec(root="s3://b/out", asset_name="x")),
        make_spec(model="/models/./Qwen2.5-0.5B-Instruct", max_requests_in_flight=64),
    ]
    assert {pool_key(spec) for spec in same_engine} == {key}
    other_engine = [
        make_spec(model="/models/Qwen2.5-1.5B-Instruct"),
        make_spec(task="embed"),  # the pooling runner
        make_spec(engine=EngineArgs(max_model_len=4096)),
        make_spec(engine=EngineArgs(extra={"revision": "abc123"})),
        make_spec(tensor_parallel_size=2),
        make_spec(vllm_version="0.32.0"),
    ]
    other_keys = [pool_key(spec) for spec in other_engine]
    other_keys += [
        pool_key(base, image="gpuinfer-worker@sha256:1"),
        pool_key(base, gpu_type="nvidia-h100-80gb"),
        pool_key(base, model_revision="files:12:abcdef"),
    ]
    assert len(set(other_keys) | {key}) == len(other_keys) + 1
    assert pool_key(make_spec()) == key  # stable
    assert pool_identity(base)["runner"] == "generate"


# --------------------------------------------------------------------------- invariants


class LeaseInvariants(RuleBasedStateMachine):
    """Random submits, leases, heartbeats, completions, failures, releases, cancels and
    clock steps on the SQLite store, checked against a model of what must hold:

    - a call on a lease succeeds exactly when that lease is its item's live one;
    - an item is completed at most once, and never leased after it is done or cancelled;
    - every lease goes to a job of the highest priority with waiting items;
    - the progress counts add up to the model's, lapsed leases included.
    """

    leases = Bundle("leases")

    @initialize()
    def open_store(self) -> None:
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="lease-invariants-")
        self.clock = FakeClock()
        self.queue = SqliteLeaseQueue(os.path.join(self.folder, "q.db"), clock=self.clock)
        self.jobs: dict[str, tuple[int, int, int]] = {}  # id -> (priority, items, cap)
        self.live: dict[tuple[str, str], tuple[str, float]] = {}  # item -> (token, expiry)
        self.state: dict[tuple[str, str], str] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.completed: list[tuple[str, str]] = []

    def teardown(self) -> None:
        if hasattr(self, "queue"):
            self.queue.close()

    def _expire(self) -> None:
        """Lapsed leases back to queued, or failed once out of attempts."""
        for item, (_, expires_at) in list(self.live.items()):
            if expires_at <= self.clock.now:
                del self.live[item]
                self.failures[item] += 1
                capped = self.failures[item] >= self.jobs[item[0]][2]
                self.state[item] = "failed" if capped else "queued"

    def _is_live(self, lease: Lease) -> bool:
        self._expire()
        held = self.live.get((lease.job_id, lease.item_key))
        return held is not None and held[0] == lease.token

    @rule(count=st.integers(1, 4), priority=st.sampled_from([0, 5]), cap=st.integers(1, 3))
    def submit(self, count: int, priority: int, cap: int) -> None:
        job_id = f"job-{len(self.jobs)}"
        self.queue.submit(job(job_id, count, priority=priority, max_attempts=cap))
        self.jobs[job_id] = (priority, count, cap)
        for item in items(count, job_id):
            self.state[(job_id, item.key)] = "queued"
            self.failures[(job_id, item.key)] = 0

    @rule(target=leases, ttl=st.sampled_from([1.0, 5.0]))
    def lease(self, ttl: float):
        self._expire()
        lease = self.queue.lease(POOL, worker_id="w", ttl_s=ttl)
        waiting = [item for item, state in self.state.items() if state == "queued"]
        if lease is None:
            assert not waiting
            return multiple()
        item = (lease.job_id, lease.item_key)
        assert item in waiting, f"leased {item}, which is {self.state[item]}"
        assert lease.priority == max(self.jobs[job_id][0] for job_id, _ in waiting)
        self.state[item] = "leased"
        self.live[item] = (lease.token, lease.expires_at)
        return lease

    @rule(lease=leases)
    def heartbeat(self, lease: Lease) -> None:
        live = self._is_live(lease)
        try:
            renewed = self.queue.heartbeat(lease)
        except LeaseLostError:
            assert not live
            return
        assert live
        self.live[(lease.job_id, lease.item_key)] = (lease.token, renewed.expires_at)

    @rule(lease=consumes(leases))
    def complete(self, lease: Lease) -> None:
        item = (lease.job_id, lease.item_key)
        live = self._is_live(lease)
        try:
            first = self.queue.complete(lease)
        except LeaseLostError:
            assert not live
            return
        assert live and first
        self.state[item] = "done"
        del self.live[item]
        self.completed.append(item)
        assert self.queue.complete(lease) is False

    @rule(lease=consumes(leases), failed=st.booleans())
    def give_back(self, lease: Lease, failed: bool) -> None:
        item = (lease.job_id, lease.item_key)
        live = self._is_live(lease)
        try:
            if failed:
                state = self.queue.fail(lease, "planted")
            else:
                self.queue.release(lease, "planted")
                state = "queued"
        except LeaseLostError:
            assert not live
            return
        assert live
        del self.live[item]
        self.failures[item] += int(failed)
        assert state == ("failed" if self.failures[item] >= self.jobs[item[0]][2] else "queued")
        self.state[item] = state

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(data=st.data())
    def cancel(self, data) -> None:
        if not self.jobs:
            return
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        self._expire()
        self.queue.cancel(job_id, "planted")
        for item, state in self.state.items():
            if item[0] == job_id and state in ("queued", "leased"):
                self.state[item] = "cancelled"
                self.live.pop(item, None)

    @invariant()
    def completed_once_and_counts_add_up(self) -> None:
        if not hasattr(self, "queue"):
            return
        assert len(self.completed) == len(set(self.completed))
        self._expire()
        for job_id, (_, count, _) in self.jobs.items():
            progress = self.queue.job_progress(job_id)
            mine = [s for (j, _), s in self.state.items() if j == job_id]
            assert progress.total == count
            for name in ("queued", "leased", "done", "failed"):
                assert getattr(progress, name) == mine.count(name), (job_id, name, mine)


LeaseInvariants.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_lease_invariants_hold_on_the_sqlite_store = LeaseInvariants.TestCase


def test_open_lease_queue_picks_the_store_by_location(tmp_path):
    with open_lease_queue(f"sqlite:///{tmp_path}/a.db") as queue:
        assert isinstance(queue, SqliteLeaseQueue) and queue.path == f"{tmp_path}/a.db"
    assert PostgresLeaseQueue.lock_clause.strip() == "FOR UPDATE SKIP LOCKED"
