"""The pools' control plane without an engine: settings, sizing, reconcile, the step's wait.

The queue is the real SQLite store; a pool worker is played by the test through the queue's
own API (lease, post_event, complete with a result), as the pool worker CLI does. The
end-to-end cases with real pool workers and a real engine are in test_pool_engine.py.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import fresh_postgres_database

from dagster_gpuinfer import InputSpec, inference_assets
from dagster_gpuinfer.asset_factory import InferenceRunConfig
from dagster_gpuinfer.estimate import PoolShape
from dagster_gpuinfer.launchers.pool import JobWatch, pool_job, redact
from dagster_gpuinfer.messages import Fatal, PartitionFailed, to_payload
from dagster_gpuinfer.pools import PoolStats, PoolWorker, open_lease_queue
from dagster_gpuinfer.pools.reconciler import counted, desired_workers, reconcile
from dagster_gpuinfer.resource import GpuInferenceResource, PoolSettings
from dagster_gpuinfer.spec import InferenceSpec, OutputSpec

STATES = ("starting", "loading", "idle", "busy", "draining")


def worker(state: str, n: int = 0) -> PoolWorker:
    return PoolWorker(f"w{n}", "p", state, 0.0, 0.0, 10.0, {})


def stats(queued: int, leased: int) -> PoolStats:
    return PoolStats("p", {0: queued} if queued else {}, leased, None, 0, 0, 0)


# --------------------------------------------------------------------------- sizing


@given(
    queued=st.integers(0, 50),
    leased=st.integers(0, 10),
    states=st.lists(st.sampled_from(STATES), max_size=8),
    max_workers=st.integers(0, 6),
)
def test_desired_workers_fills_the_pool_to_its_backlog_within_its_cap(
    queued, leased, states, max_workers
):
    live = [worker(state, n) for n, state in enumerate(states)]
    start = desired_workers(stats(queued, leased), live, max_workers)
    backlog, have = queued + leased, counted(live)
    assert start >= 0
    if backlog == 0:
        assert start == 0  # scale to zero is the idle TTL's: nothing starts
        return
    # after starting, the pool covers its backlog up to the cap, and never passes the cap
    # by its own starts
    assert have + start >= min(backlog, max_workers)
    assert start == 0 or have + start <= min(backlog, max_workers)


def test_desired_workers_counts_starting_workers_and_not_draining_ones():
    assert desired_workers(stats(4, 0), [worker("starting")], max_workers=2) == 1
    assert desired_workers(stats(4, 0), [worker("draining")], max_workers=2) == 2
    assert desired_workers(stats(1, 0), [], max_workers=3) == 1
    with pytest.raises(ValueError, match="max_workers"):
        desired_workers(stats(1, 0), [], max_workers=-1)


# --------------------------------------------------------------------------- settings


def test_pool_settings_defaults_and_queue_location(tmp_path, monkeypatch):
    settings = PoolSettings()
    assert (settings.max_workers, settings.idle_ttl_s, settings.lease_ttl_s, settings.poll_s) == (
        1,
        300.0,
        30.0,
        0.5,
    )
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    assert settings.location() == str(tmp_path / "home" / "gpuinfer" / "pools.db")
    assert settings.log_dir() == str(tmp_path / "home" / "gpuinfer" / "pool-workers")
    monkeypatch.delenv("DAGSTER_HOME")
    monkeypatch.chdir(tmp_path)
    assert settings.location() == str(tmp_path / ".data" / "pools.db")
    url = "postgresql://gpu:s3cret@db:5432/pools"
    assert PoolSettings(queue=url).location() == url
    assert redact(url) == "postgresql://gpu:***@db:5432/pools"
    with pytest.raises(Exception, match="max_workers"):
        GpuInferenceResource(pool={"max_workers": -1})
    resource = GpuInferenceResource(pool={"max_workers": 3, "queue": url})
    assert resource.pool.max_workers == 3


def pipeline(tmp_path: Path, **kwargs: Any):
    return inference_assets(
        name="emb",
        model=str(tmp_path / "model"),
        task="embed",
        input=InputSpec(uri=str(tmp_path / "in" / "{partition_key}.parquet")),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["a", "b"]),
        **kwargs,
    )


def test_launch_is_per_pipeline_and_per_run_and_not_in_the_spec(tmp_path):
    run, pool = pipeline(tmp_path), pipeline(tmp_path, launch="pool")
    assert run.spec == pool.spec and "launch" not in pool.spec
    assert run.output_asset.code_versions_by_key == pool.output_asset.code_versions_by_key
    meta = pool.output_asset.metadata_by_key[pool.output_asset.key]
    assert meta["gpuinfer/launch"] == "pool"
    assert InferenceRunConfig(launch="pool").launch.value == "pool"
    assert InferenceRunConfig().apply(run.spec) == run.spec  # launch never reaches the spec
    with pytest.raises(ValueError, match="launch"):
        InferenceRunConfig(launch="cluster")


# --------------------------------------------------------------------------- reconcile


@pytest.fixture(params=["sqlite", "postgres"])
def location(request, tmp_path):
    """A fresh queue: a SQLite file, or a new database on the suite's PostgreSQL server."""
    if request.param == "sqlite":
        yield str(tmp_path / "q.db")
        return
    with fresh_postgres_database("poollaunch") as url:
        yield url


class RecordingBackend:
    """A backend that records its starts (the process side is test_pool_engine's)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str, dict[str, str]]] = []

    def start(self, pool_key, worker_id, settings, env) -> None:
        self.started.append((pool_key, worker_id, dict(env)))


def spec_for(tmp_path: Path, keys: list[str]) -> InferenceSpec:
    return InferenceSpec(
        model=str(tmp_path / "model"),
        task="embed",
        input=InputSpec(uri=str(tmp_path / "{partition_key}.parquet")),
        output=OutputSpec(root=str(tmp_path / "out"), asset_name="emb"),
        partition_keys=keys,
    )


def test_reconcile_starts_to_the_backlog_then_again_when_a_worker_is_gone(tmp_path, location):
    settings = PoolSettings(max_workers=2)
    backend = RecordingBackend()
    with open_lease_queue(location) as queue:
        job = pool_job(spec_for(tmp_path, ["a", "b", "c"]), run_id="r1", retry_number=0)
        assert reconcile(queue, job.pool_key, backend, settings).started == []  # no backlog
        queue.submit(job)
        first = reconcile(queue, job.pool_key, backend, settings, env={"X": "1"})
        assert len(first.started) == 2 and first.backlog == 3
        assert {w.state for w in queue.pool_workers(job.pool_key)} == {"starting"}
        assert reconcile(queue, job.pool_key, backend, settings).started == []
        queue.remove_worker(first.started[0])  # killed before it ever reported
        again = reconcile(queue, job.pool_key, backend, settings)
        assert len(again.started) == 1
        assert backend.started[0][2] == {"X": "1"}


def test_reconcile_unregisters_a_worker_whose_start_failed(tmp_path):
    class Broken:
        def start(self, *args: Any) -> None:
            raise OSError("no such executable")

    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        job = pool_job(spec_for(tmp_path, ["a"]), run_id="r1", retry_number=0)
        queue.submit(job)
        with pytest.raises(OSError):
            reconcile(queue, job.pool_key, Broken(), PoolSettings())
        assert queue.pool_workers(job.pool_key) == []


# --------------------------------------------------------------------------- the wait


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __getattr__(self, level: str):
        return lambda message: self.lines.append((level, message))


def play_worker(
    location: str, pool_key: str, worker_id: str, results: dict[str, list[Any]], warm: bool
):
    """Serve every item of `pool_key` as a pool worker does: log, progress, result."""
    with open_lease_queue(location) as queue:
        serve(queue, pool_key, worker_id, results, warm)


def serve(queue, pool_key: str, worker_id: str, results: dict[str, list[Any]], warm: bool):
    while (lease := queue.lease(pool_key, worker_id=worker_id, ttl_s=30)) is not None:
        queue.post_event(lease, "log", {"level": "info", "message": f"took {lease.item_key}"})
        queue.post_event(lease, "progress", {"rows_done": 1, "chunks_committed": 1})
        queue.complete(
            lease,
            {
                "messages": results[lease.item_key],
                "pool": {
                    "worker_id": worker_id,
                    "warm": warm,
                    "engine_load_seconds": 0.0 if warm else 12.5,
                    "lease_attempt": lease.attempt,
                    "inference_seconds": 0.1,
                },
            },
        )
        warm = True  # the engine stays built for the next lease


def test_the_wait_streams_events_and_returns_each_partitions_messages(tmp_path, location):
    spec = spec_for(tmp_path, ["a", "b"])
    failed = {
        key: [to_payload(PartitionFailed(error_type="bad_shard", message="x", partition_key=key))]
        for key in ("a", "b")
    }
    log = Log()
    with open_lease_queue(location) as queue:
        job = pool_job(spec, run_id="r1", retry_number=0)
        queue.submit(job)
        players: list[threading.Thread] = []

        def reconcile_pool() -> list[str]:
            players.append(
                threading.Thread(
                    target=play_worker,
                    args=(location, job.pool_key, "w1", failed, False),
                )
            )
            players[-1].start()
            return ["w1"]

        watch = JobWatch(queue, job, log, reconcile_pool=reconcile_pool)
        assert watch.wait(poll_s=0.05).state == "done"
        messages = watch.messages()
        for player in players:
            player.join(timeout=10)
    leases = {m["partition_key"]: m for m in messages if m.get("type") == "pool_lease"}
    assert (leases["a"]["warm"], leases["b"]["warm"]) == (False, True)
    assert leases["a"]["engine_load_seconds"] == 12.5 and leases["b"]["leases"] == 1
    assert all(m["queue_wait_s"] is not None and m["queue_wait_s"] >= 0 for m in leases.values())
    run = next(m for m in messages if m.get("type") == "run")
    assert (run["model_loads"], run["replicas"], run["partitions_failed"]) == (1, 1, 2)
    assert ("info", "[pool w1] took a") in log.lines and ("info", "[pool w1] took b") in log.lines


def test_a_refused_spec_cancels_the_job_at_its_first_result(tmp_path):
    spec = spec_for(tmp_path, ["a", "b", "c"])
    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        job = pool_job(spec, run_id="r1", retry_number=0)
        queue.submit(job)
        lease = queue.lease(job.pool_key, worker_id="w1", ttl_s=30)
        fatal = to_payload(Fatal(error_type="bad_spec", message="no model"))
        queue.complete(lease, {"messages": [fatal], "pool": {"warm": False}})
        watch = JobWatch(queue, job, Log(), reconcile_pool=lambda: [])
        assert watch.wait(poll_s=0.05).state == "cancelled"
        assert fatal in watch.messages()


def test_workers_that_never_lease_or_report_fail_the_step_retryably(tmp_path):
    spec = spec_for(tmp_path, ["a"])
    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        job = pool_job(spec, run_id="r1", retry_number=0)
        queue.submit(job)
        watch = JobWatch(queue, job, Log(), reconcile_pool=lambda: ["w-dead"], max_workers=1)
        with pytest.raises(dg.Failure) as failure:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("dagster_gpuinfer.launchers.pool.RECONCILE_SECONDS", 0.0)
                watch.wait(poll_s=0.01)
        assert failure.value.allow_retries
        assert queue.job_progress(job.job_id).state == "cancelled"
    assert "none took a lease or reported back" in failure.value.description
    assert f"gpuinfer/pool={job.pool_key}" in failure.value.description  # where the logs are


def test_workers_restarted_while_the_job_reports_progress_are_no_crash_loop(tmp_path):
    """Chaos pool seed 1: three pool workers killed within 13 s, the reconciler started
    replacements, and the step failed "5 pool workers ... none reported back" although the
    job's events kept coming: only events read in the very read that reconciled counted."""
    spec = spec_for(tmp_path, ["a"])
    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        job = pool_job(spec, run_id="r1", retry_number=0)
        queue.submit(job)
        lease = queue.lease(job.pool_key, worker_id="w-alive", ttl_s=300)
        starts: list[str] = []

        def reconcile_pool() -> list[str]:
            starts.append(f"w{len(starts)}")  # a replacement for a worker that died
            if len(starts) == 8:
                queue.complete(lease, {"messages": [], "pool": {"warm": True}})
            else:  # the live worker reports after this reconcile, before the next
                queue.post_event(lease, "progress", {"rows_done": len(starts)})
            return [starts[-1]]

        assert _watch_one_worker_pool(queue, job, reconcile_pool) == "done"
        assert len(starts) == 8  # more starts than the limit (max_workers + 2), no failure


def _watch_one_worker_pool(queue, job, reconcile_pool) -> str:
    """The job's final state, watched for a pool of one worker whose clock advances a second
    at each read (so it reconciles every few reads)."""
    ticks = itertools.count()
    watch = JobWatch(
        queue, job, Log(), reconcile_pool=reconcile_pool, max_workers=1,
        clock=lambda: float(next(ticks)),
    )  # fmt: skip
    return watch.wait(poll_s=0.01).state


def test_workers_that_take_leases_and_die_are_no_crash_loop(tmp_path):
    """Chaos pool seed 1 on the PostgreSQL queue: an EngineCore, a worker and a lease holder
    SIGKILLed within 17 s, before any worker had posted an event; the reconciler's five
    starts failed the step "none reported back", though every worker had taken a lease (the
    verdict is for workers that exit without one: a bad image, a missing secret)."""
    spec = spec_for(tmp_path, ["a", "b", "c", "d", "e", "f", "g", "h"])
    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        job = pool_job(spec, run_id="r1", retry_number=0)
        queue.submit(job)
        starts: list[str] = []
        leases = []

        def reconcile_pool() -> list[str]:
            starts.append(f"w{len(starts)}")  # a replacement for a worker that died leasing
            leases.append(queue.lease(job.pool_key, worker_id=starts[-1], ttl_s=300))
            if len(starts) == 8:  # every item leased: they finish, no event posted
                for lease in leases:
                    queue.complete(lease, {"messages": [], "pool": {"warm": True}})
            return [starts[-1]]

        assert _watch_one_worker_pool(queue, job, reconcile_pool) == "done"
        assert len(starts) == 8  # more starts than the limit (max_workers + 2), no failure


# --------------------------------------------------------------------------- interruption

INTERRUPTED_RUN = """
import sys, dagster as dg
from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
root = sys.argv[1]
pipe = inference_assets(
    name="emb", model=root + "/model", task="embed", launch="pool",
    input=InputSpec(uri=root + "/{partition_key}.parquet"), output_root=root + "/out",
    partitions_def=dg.StaticPartitionsDefinition(["a"]),
)
gpu = GpuInferenceResource(pool={"queue": root + "/q.db", "max_workers": 0, "poll_s": 0.05})
with dg.instance_for_test() as instance:
    result = dg.materialize(pipe.assets, selection=[pipe.output_asset.key], partition_key="a",
                            instance=instance, resources={"gpu": gpu}, raise_on_error=False)
    print("RUN", result.success, flush=True)
"""


def test_an_interrupted_run_cancels_its_pool_job(tmp_path):
    """A run waiting on its pool job (a pool capped at 0 workers never serves it) gets
    SIGINT, as Dagster's run termination sends: the step cancels the job in the queue."""
    script = tmp_path / "run.py"
    script.write_text(INTERRUPTED_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        job = wait_for_job(tmp_path / "q.db", process)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        process.kill()
    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        progress = queue.job_progress(job)
    assert progress.cancelled and "interrupted" in (progress.cancel_reason or "")


def wait_for_job(path: Path, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists():
            with open_lease_queue(str(path)) as queue:
                pools = queue.pools()
                if pools:
                    stats = queue.pool_stats(pools[0])
                    if stats.queued:
                        return next(iter(_jobs(path)))
        time.sleep(0.2)
    raise AssertionError("the run never submitted its pool job")


def _jobs(path: Path) -> list[str]:
    import sqlite3

    from dagster_gpuinfer.pools.sql_queue import JOBS

    with sqlite3.connect(path) as db:
        return [row[0] for row in db.execute(f"SELECT job_id FROM {JOBS}")]


# --------------------------------------------------------------------------- estimate


def test_pool_estimate_pays_no_model_load_on_a_warm_worker():
    cold = PoolShape(max_workers=2, warm_workers=0)
    warm = PoolShape(max_workers=2, warm_workers=2)
    seconds = [10.0, 10.0, 10.0, 10.0]
    assert cold.cost(seconds, cold_start=100.0) == (2, 120.0, 240.0)
    assert warm.cost(seconds, cold_start=100.0) == (0, 20.0, 40.0)
    assert PoolShape(max_workers=4, idle_ttl_s=5.0).cost([1.0], cold_start=2.0) == (1, 3.0, 8.0)


def test_the_asset_estimate_counts_a_live_idle_pool_worker_as_warm(tmp_path):
    from dagster_gpuinfer.estimate import estimate_asset
    from dagster_gpuinfer.launchers.pool import job_pool_key

    queue_path = str(tmp_path / "q.db")
    gpu = GpuInferenceResource(pool={"queue": queue_path, "max_workers": 2})
    asset = pipeline(tmp_path, launch="pool").output_asset
    cold = estimate_asset(asset, resource=gpu)
    assert (cold.launch, cold.engine_builds, cold.warm_workers) == ("pool", 2, 0)
    raw = asset.metadata_by_key[asset.key]["gpuinfer/spec"].data
    spec = gpu.prepare_spec(InferenceSpec.model_validate({**raw, "partition_keys": ["a", "b"]}))
    with open_lease_queue(queue_path) as queue:
        queue.report_worker(job_pool_key(spec), "w1", state="idle", ttl_s=60)
    warm = estimate_asset(asset, resource=gpu)
    assert (warm.engine_builds, warm.warm_workers) == (1, 1)
    assert warm.wall_seconds < cold.wall_seconds
    per_run = estimate_asset(pipeline(tmp_path).output_asset, resource=gpu)
    assert (per_run.launch, per_run.engine_builds) == ("run", per_run.runs)


def test_the_reconciler_starts_the_worker_module(tmp_path):
    from dagster_gpuinfer.worker import WORKER_MODULE

    backend = GpuInferenceResource(pool={"queue": str(tmp_path / "q.db")}).pool_backend()
    started = backend.command[2]
    assert started == WORKER_MODULE


def test_batch_routes_run_per_batch_unless_the_route_or_deployment_says_pool(tmp_path):
    from dagster_gpuinfer.batch_api.pipelines import batch_pipelines

    route = {"endpoint": "/v1/embeddings", "model_path": "/m/minilm"}
    routes = [
        {**route, "model": "a", "pipeline": "p_a"},
        {**route, "model": "b", "pipeline": "p_b", "launch": "pool"},
    ]

    def launches(**kwargs: Any) -> dict[str, str]:
        built = batch_pipelines(routes, files_root=str(tmp_path / "files"), **kwargs)
        return {
            name: p.output_asset.metadata_by_key[p.output_asset.key]["gpuinfer/launch"]
            for name, p in built.pipelines.items()
        }

    assert launches() == {"p_a": "run", "p_b": "pool"}
    assert launches(launch="pool") == {"p_a": "pool", "p_b": "pool"}


def test_the_sensor_starts_a_detached_local_worker_for_queued_work(tmp_path, instance):
    """The daemon's backstop: a job nobody waits on gets a real worker process, in its own
    session, logging beside the queue, counted as `starting` before it starts."""
    from dagster_gpuinfer.launchers.pool import pool_reconciler_sensor

    queue_path = str(tmp_path / "q.db")
    gpu = GpuInferenceResource(pool={"queue": queue_path, "max_workers": 1, "idle_ttl_s": 5})
    sensor = pool_reconciler_sensor()
    with open_lease_queue(queue_path) as queue:
        job = pool_job(spec_for(tmp_path, ["a"]), run_id="r1", retry_number=0)
        queue.submit(job)
        context = dg.build_sensor_context(instance=instance, resources={"gpu": gpu})
        assert "started" in str(sensor(context).skip_message)
        (worker,) = queue.pool_workers(job.pool_key)
        assert "every pool has its workers" in str(sensor(context).skip_message)
    logs = list((tmp_path / "pool-workers").glob(f"{job.pool_key}-w-*.log"))
    assert [log.name for log in logs] == [f"{job.pool_key}-{worker.worker_id}.log"]
    pid = wait_for_pid(queue_path, job.pool_key, worker.worker_id)
    try:
        assert os.getpgid(pid) == pid  # its own session: it outlives the step
    finally:
        os.killpg(pid, signal.SIGKILL)


def wait_for_pid(queue_path: str, pool: str, worker_id: str) -> int:
    """The worker's pid once it has reported itself (replacing the `starting` record)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open_lease_queue(queue_path) as queue:
            for live in queue.pool_workers(pool):
                if live.worker_id == worker_id and live.info.get("pid"):
                    return int(live.info["pid"])
        time.sleep(0.2)
    raise AssertionError(f"pool worker {worker_id} never reported itself")
