"""The lease queue's doorbells (dagster_gpuinfer/pools/doorbell.py): a change wakes its
waiter at once, on both stores (SQLite: Unix sockets beside the file; PostgreSQL: LISTEN /
NOTIFY on the suite's real server); a pool worker and a step waiting with long polls are
woken by the submit and by the result."""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pool_worker_fakes import POOL, FakePoolEngine, spec_dict, submission, write_shards
from support import fresh_postgres_database

from dagster_gpuinfer.launchers.pool import JobWatch
from dagster_gpuinfer.pools import JobSubmission, LeaseQueue, WorkItem, open_lease_queue
from dagster_gpuinfer.pools.doorbell import (
    MAX_SOCKET_PATH,
    Doorbell,
    LocalDoorbell,
    bell_folder,
    channel_digest,
    job_channel,
    pool_channel,
)
from dagster_gpuinfer.worker.pool.loop import PoolWorkerLoop

# Long enough that a waiter woken before it did not time out: a missed ring fails the test.
NEVER_S = 60.0


@pytest.fixture(params=["sqlite", "postgres"])
def location(request, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "leases.db")
        return
    with fresh_postgres_database("bells") as url:
        yield url


@pytest.fixture
def queue(location) -> Iterator[LeaseQueue]:
    with open_lease_queue(location) as opened:
        yield opened


def job(job_id: str = "j1", keys: tuple[str, ...] = ("a",)) -> JobSubmission:
    return JobSubmission(job_id, POOL, [WorkItem(key) for key in keys])


def test_each_change_rings_the_channel_its_waiter_listens_on(location, queue):
    """Submit and a requeue ring the pool; an event, a result, a failed item and a
    cancel ring the job. Each is heard by a listener opened before the change, in
    another connection (as another process would)."""
    with open_lease_queue(location) as other:
        bell = other.doorbell()
        with bell.listen(pool_channel(POOL)) as pool, bell.listen(job_channel("j1")) as job1:
            assert not pool.wait(0) and not job1.wait(0)
            queue.submit(job("j1", ("a", "b", "c")))
            assert pool.wait(NEVER_S) and not job1.wait(0)

            lease = queue.lease(POOL, worker_id="w1", ttl_s=30)
            queue.post_event(lease, "log", {"message": "hi"})
            assert job1.wait(NEVER_S)
            queue.complete(lease, {"messages": []})
            assert job1.wait(NEVER_S) and not pool.wait(0)

            lease = queue.lease(POOL, worker_id="w1", ttl_s=30)
            queue.release(lease, "going away")
            assert pool.wait(NEVER_S)
            lease = queue.lease(POOL, worker_id="w1", ttl_s=30)
            assert queue.fail(lease, "bad") == "queued"  # attempts left: back in the pool
            assert pool.wait(NEVER_S)

            queue.cancel("j1", "enough")
            assert job1.wait(NEVER_S)


def test_a_ring_before_the_wait_is_kept_and_another_channel_is_not_heard(queue):
    with queue.doorbell().listen(job_channel("j")) as listener:
        queue.doorbell().ring(job_channel("other"))
        assert not listener.wait(0.2)
        queue.doorbell().ring(job_channel("j"))
        assert listener.wait(NEVER_S)  # rung before the wait: not lost


def _ring_from_another_process(location: str, channel: str) -> None:
    with open_lease_queue(location) as queue:
        queue.doorbell().ring(channel)


def test_a_ring_from_another_process_wakes_the_listener(location, queue):
    with queue.doorbell().listen(pool_channel(POOL)) as listener:
        process = multiprocessing.get_context("spawn").Process(
            target=_ring_from_another_process, args=(location, pool_channel(POOL))
        )
        process.start()
        process.join(NEVER_S)
        assert process.exitcode == 0
        assert listener.wait(NEVER_S)


def test_the_base_doorbell_rings_nothing_and_its_listener_times_out():
    bell = Doorbell()
    with bell.listen("x") as listener:
        bell.ring("x")
        assert listener.wait(0.01) is False


def test_a_dead_listeners_socket_is_removed_by_the_next_ring(tmp_path):
    bell = LocalDoorbell(tmp_path / "bells")
    folder = bell.folder / channel_digest("c")  # under the temp folder: tmp_path is deep
    folder.mkdir(parents=True)
    dead = folder / "12345-dead"
    orphan = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    orphan.bind(str(dead))
    orphan.close()  # closed without unlinking, as a killed process leaves it
    with bell.listen("c") as live:
        bell.ring("c")
        assert live.wait(NEVER_S)
    assert not dead.exists()
    assert not folder.exists()  # the last listener removed the channel's folder


def test_a_folder_too_deep_for_socket_paths_moves_the_bells_to_the_temp_folder(tmp_path):
    deep = tmp_path / ("d" * 80) / "pools.db.bells"
    bell = LocalDoorbell(deep)
    assert bell.folder != deep and bell.folder == bell_folder(deep)
    socket_path = bell.folder / channel_digest("c") / f"{os.getpid()}-{'f' * 12}"
    assert len(str(socket_path)) <= MAX_SOCKET_PATH
    with bell.listen("c") as listener:
        bell.ring("c")
        assert listener.wait(NEVER_S)
    short = Path(tempfile.mkdtemp(prefix="b", dir="/tmp")) / "q.db.bells"
    assert bell_folder(short) == short


# --------------------------------------------------------------------------- the waiters


class Recorded:
    """Wraps a queue's doorbell to record what each listener's waits returned."""

    def __init__(self, queue: LeaseQueue) -> None:
        self.queue = queue
        self.bell = queue.doorbell()
        self.waits: list[bool] = []
        queue.doorbell = self.doorbell  # type: ignore[method-assign]

    def doorbell(self) -> Recorded:
        return self

    def ring(self, channel: str) -> None:
        self.bell.ring(channel)

    def listen(self, channel: str):
        listener = self.bell.listen(channel)
        wait = listener.wait

        def recorded(timeout_s: float) -> bool:
            heard = wait(timeout_s)
            self.waits.append(heard)
            return heard

        listener.wait = recorded  # type: ignore[method-assign]
        return listener


def test_an_idle_worker_with_a_long_poll_is_woken_by_a_submit(tmp_path):
    """The worker polls every minute; a job submitted while it waits is served as soon as
    it is submitted, and a ring after that (no work) lets it leave on its idle TTL."""
    write_shards(tmp_path, ["a"], rows=4)
    spec = spec_dict(tmp_path, ["a"])
    with open_lease_queue(str(tmp_path / "pools.db")) as queue:
        recorded = Recorded(queue)
        loop = PoolWorkerLoop(
            queue,
            POOL,
            worker_id="w1",
            idle_ttl_s=0.2,
            poll_s=NEVER_S,
            engine_builder=lambda s, on_death: FakePoolEngine(s),
        )
        idle = threading.Event()
        report = loop.report

        def reported(state: str) -> None:
            report(state)
            if state == "idle":
                idle.set()

        loop.report = reported  # type: ignore[method-assign]
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(loop.run()))
        thread.start()
        assert idle.wait(NEVER_S)
        with open_lease_queue(str(tmp_path / "pools.db")) as submitter:
            submitter.submit(submission("run-1", spec))
            with submitter.doorbell().listen(job_channel("run-1")) as done:
                while not submitter.job_progress("run-1").finished:
                    assert done.wait(NEVER_S), "the worker was not woken by the submit"
            while thread.is_alive():  # rings until it wakes past its idle TTL and leaves
                submitter.doorbell().ring(pool_channel(POOL))
                thread.join(0.3)
        assert codes == [0]
        assert recorded.waits and all(recorded.waits)  # every wait was cut short by a ring
        assert queue.job_progress("run-1").state == "done"


def test_a_waiting_step_with_a_long_poll_is_woken_by_its_result(location, queue):
    queue.submit(job("j1", ("a",)))
    recorded = Recorded(queue)

    def work() -> None:
        with open_lease_queue(location) as worker_side:
            lease = worker_side.lease(POOL, worker_id="w1", ttl_s=30)
            worker_side.complete(lease, {"messages": [], "pool": {"warm": True}})

    watch = JobWatch(queue, job("j1", ("a",)), log=_Log(), reconcile_pool=lambda: [])
    playing = threading.Timer(0.1, work)
    playing.start()
    progress = watch.wait(poll_s=NEVER_S)
    playing.join()
    assert progress.state == "done" and "a" in watch.results
    assert recorded.waits and all(recorded.waits)


class _Log:
    def __getattr__(self, level: str):
        return lambda message: None
