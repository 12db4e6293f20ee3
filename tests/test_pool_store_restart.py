"""Engine pools on the PostgreSQL lease queue while its server restarts (`pg_ctl stop`,
start again: the chaos harness's private server). Before, the doorbell's LISTEN connection
died with the server and every later wait raised, so an idle pool worker crashed (its warm
engine lost) and a waiting step failed; the queue's calls raised psycopg2's errors. Now the
queue raises `QueueUnavailable`, the doorbell listens again, the step and the worker wait
the outage out."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import dagster as dg
import pytest
from pool_worker_fakes import POOL, FakePoolEngine, spec_dict, submission, write_shards

from bench.chaos.store_faults import Postgres, postgres
from dagster_gpuinfer.launchers.pool import JobWatch
from dagster_gpuinfer.pools import (
    JobSubmission,
    PostgresLeaseQueue,
    QueueUnavailable,
    WorkItem,
)
from dagster_gpuinfer.pools.doorbell import pool_channel
from dagster_gpuinfer.worker.pool.loop import PoolWorkerLoop

DOWN_S = 3.0
NEVER_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[Postgres]:
    with postgres() as found:
        yield found


@pytest.fixture
def url(server, request) -> str:
    return server.database(f"pool_{request.node.name[:40].lower()}")


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __getattr__(self, level: str):
        return lambda message: self.lines.append((level, message))


def restart_soon(server: Postgres, after_s: float = 0.3) -> threading.Thread:
    thread = threading.Timer(after_s, lambda: server.restart(DOWN_S, "fast"))
    thread.start()
    return thread


def test_calls_while_the_server_is_down_raise_queue_unavailable_then_work_again(server, url):
    queue = PostgresLeaseQueue(url)
    assert queue.pools() == []
    server.stop("fast")
    try:
        for _ in range(2):  # the dropped connection, then a refused one
            with pytest.raises(QueueUnavailable, match="lease queue at postgresql"):
                queue.pools()
    finally:
        server.start()
    assert queue.pools() == []
    queue.close()


def test_a_listener_listens_again_after_a_restart_and_hears_the_next_ring(server, url):
    queue = PostgresLeaseQueue(url)
    with queue.doorbell().listen(pool_channel(POOL)) as bell:
        assert not bell.wait(0.1)
        server.restart(DOWN_S, "fast")
        assert bell.wait(1.0)  # its connection is gone: it says "look", once, not raise
        assert bell.wait(1.0)  # listening again: a ring may have been missed meanwhile
        assert not bell.wait(0.2)
        PostgresLeaseQueue(url).doorbell().ring(pool_channel(POOL))
        assert bell.wait(NEVER_S)
    queue.close()


def test_a_listener_logs_an_outage_once_as_it_begins_and_once_as_it_ends(server, url, caplog):
    queue = PostgresLeaseQueue(url)
    caplog.set_level(logging.DEBUG, logger="dagster_gpuinfer.pools.doorbell")
    with queue.doorbell().listen(pool_channel(POOL)) as bell:
        server.stop("fast")
        try:
            waits = [bell.wait(0.05) for _ in range(6)]  # a waiter polling through the outage
        finally:
            server.start()
        assert waits[0] and not any(waits[1:])  # "look" once as the connection goes
        assert bell.wait(1.0)  # listening again
    said = [(r.levelno, r.getMessage().split(" (")[0]) for r in caplog.records]
    channel = pool_channel(POOL)
    assert said.count((logging.WARNING, f"doorbell {channel} lost its connection")) == 1
    assert not [m for level, m in said if level >= logging.WARNING and "no doorbell" in m]
    assert said.count((logging.DEBUG, f"no doorbell for {channel} yet")) == 5
    assert said[-1] == (logging.INFO, f"doorbell {channel} listens again")
    queue.close()


def test_a_waiting_step_rides_out_a_restart_of_the_queue(server, url):
    queue = PostgresLeaseQueue(url)
    job = JobSubmission("j1", POOL, [WorkItem("a")])
    queue.submit(job)

    def work() -> None:
        server.restart(DOWN_S, "fast")
        worker_side = PostgresLeaseQueue(url)
        lease = worker_side.lease(POOL, worker_id="w1", ttl_s=30)
        worker_side.complete(lease, {"messages": [], "pool": {"warm": True}})
        worker_side.close()

    log = _Log()
    watch = JobWatch(queue, job, log, reconcile_pool=lambda: [])
    playing = threading.Timer(0.3, work)
    playing.start()
    progress = watch.wait(poll_s=0.5)
    playing.join()
    assert progress.state == "done" and "a" in watch.results
    assert any("waiting up to" in line for _, line in log.lines), log.lines
    assert any("answers again" in line for _, line in log.lines)
    queue.close()


def test_a_step_fails_retryably_when_the_queue_stays_down(server, url, monkeypatch):
    monkeypatch.setattr("dagster_gpuinfer.launchers.pool.QUEUE_DOWN_LIMIT_S", 1.0)
    queue = PostgresLeaseQueue(url)
    job = JobSubmission("j1", POOL, [WorkItem("a")])
    queue.submit(job)
    watch = JobWatch(queue, job, _Log(), reconcile_pool=lambda: [])
    server.stop("fast")
    try:
        with pytest.raises(dg.Failure) as failure:
            watch.wait(poll_s=0.2)
    finally:
        server.start()
    assert failure.value.allow_retries
    assert "unreachable" in failure.value.description and "j1" in failure.value.description
    queue.close()


def test_an_idle_worker_keeps_its_engine_through_restarts_and_serves_the_next_job(
    server, url, tmp_path
):
    """The server restarts while the worker idles (its bell died with it before), then
    again while a step waits for the job the worker serves."""
    write_shards(tmp_path, ["a", "b"], rows=4)
    spec = spec_dict(tmp_path, ["a", "b"])
    engines: list[FakePoolEngine] = []

    def build(s, on_death):
        engines.append(FakePoolEngine(s))
        return engines[-1]

    queue = PostgresLeaseQueue(url)
    loop = PoolWorkerLoop(
        queue, POOL, worker_id="w1", idle_ttl_s=8.0, lease_ttl_s=10.0, poll_s=0.5,
        engine_builder=build,
    )  # fmt: skip
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(loop.run()))
    worker.start()
    first = submission("run-1", spec)
    step_side = PostgresLeaseQueue(url)
    step_side.submit(first)
    assert JobWatch(step_side, first, _Log(), reconcile_pool=lambda: []).wait(poll_s=0.5).finished
    server.restart(DOWN_S, "fast")  # the worker is idle, waiting on its bell
    assert worker.is_alive()
    step_side.close()
    step_side = PostgresLeaseQueue(url)  # the next step opens the queue anew, as launch() does
    second = submission("run-2", spec_dict(tmp_path, ["a", "b"], asset="again"))
    step_side.submit(second)
    restarting = restart_soon(server)  # and again while the step waits for the job
    progress = JobWatch(step_side, second, _Log(), reconcile_pool=lambda: []).wait(poll_s=0.5)
    restarting.join()
    assert progress.state == "done", progress
    assert worker.is_alive(), "the worker died with the queue's connection"
    assert len(engines) == 1  # one engine built: warm for the second job
    worker.join(NEVER_S)
    assert codes == [0]  # it left on its idle TTL, not by a crash
    assert loop.leases_served == 4
    step_side.close()
    queue.close()
