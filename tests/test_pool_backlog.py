"""The KEDA scaler's backlog query (`pools.backlog`) against the real PostgreSQL server: on
random queue contents it counts what `LeaseQueue.pool_stats(pool).backlog` counts."""

from __future__ import annotations

import contextlib
import itertools
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import fresh_postgres_database

from dagster_gpuinfer.pools import JobSubmission, LeaseLostError, PostgresLeaseQueue, WorkItem
from dagster_gpuinfer.pools.backlog import backlog_query

POOLS = ("minilm-0123456789ab", "llama-ba9876543210")
LAPSED_TTL = 1e-6  # a lease that has lapsed by the time anything reads it
LIVE_TTL = 600.0

# One step on the queue: (operation, pool index, a number the operation reads)
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["submit", "lease", "lease_lapsing", "complete", "fail", "cancel"]),
        st.integers(0, len(POOLS) - 1),
        st.integers(1, 4),
    ),
    max_size=30,
)


@pytest.fixture(scope="module")
def queue_url():
    with fresh_postgres_database("backlog") as url:
        yield url


def backlog_by_query(queue: PostgresLeaseQueue, pool: str) -> int:
    connection = queue._connection()
    with connection.cursor() as cursor:
        cursor.execute(backlog_query(pool))
        (count,) = cursor.fetchone()
    connection.commit()
    return int(count)


def apply(queue: PostgresLeaseQueue, steps, run: str) -> None:
    leases = []
    jobs = []
    serial = itertools.count()
    for operation, pool_index, number in steps:
        pool = POOLS[pool_index]
        if operation == "submit":
            job_id = f"{run}-{next(serial)}"
            items = [WorkItem(f"p{i}") for i in range(number)]
            queue.submit(JobSubmission(job_id, pool, items, priority=number % 2, max_attempts=2))
            jobs.append(job_id)
        elif operation in ("lease", "lease_lapsing"):
            ttl = LAPSED_TTL if operation == "lease_lapsing" else LIVE_TTL
            lease = queue.lease(pool, worker_id=f"w{number}", ttl_s=ttl)
            if lease is not None and ttl == LIVE_TTL:
                leases.append(lease)
        elif operation in ("complete", "fail") and leases:
            lease = leases.pop(number % len(leases))
            with contextlib.suppress(LeaseLostError):  # its job was cancelled meanwhile
                if operation == "complete":
                    queue.complete(lease)
                else:
                    queue.fail(lease, "random failure")
        elif operation == "cancel" and jobs:
            queue.cancel(jobs.pop(number % len(jobs)), "random cancel")


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS)
def test_backlog_query_counts_what_pool_stats_counts(queue_url, steps):
    with PostgresLeaseQueue(queue_url) as queue:
        before = {pool: backlog_by_query(queue, pool) for pool in POOLS}
        assert before == {pool: queue.pool_stats(pool).backlog for pool in POOLS}
        apply(queue, steps, uuid.uuid4().hex)  # a fresh job id space per example
        for pool in POOLS:
            assert backlog_by_query(queue, pool) == queue.pool_stats(pool).backlog


def test_a_lapsed_last_attempt_is_not_backlog(queue_url):
    with PostgresLeaseQueue(queue_url) as queue:
        pool = "lapsed-0123456789ab"
        queue.submit(
            JobSubmission("lapsed-job", pool, [WorkItem("a"), WorkItem("b")], max_attempts=1)
        )
        assert backlog_by_query(queue, pool) == 2
        assert queue.lease(pool, worker_id="w", ttl_s=LAPSED_TTL) is not None
        assert backlog_by_query(queue, pool) == 1 == queue.pool_stats(pool).backlog


@pytest.mark.parametrize("key", ["x' OR '1'='1", "", "a" * 64, "bad key"])
def test_only_label_valued_pool_keys_reach_the_sql(key):
    with pytest.raises(ValueError, match="not a valid label value"):
        backlog_query(key)
