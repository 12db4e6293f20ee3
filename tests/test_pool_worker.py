"""The pool worker (`python -m dagster_gpuinfer.worker --pool`, dagster_gpuinfer/worker/pool/).

Most tests run the worker on the fake engine of `pool_worker_fakes` (no vLLM) against a real
lease queue (SQLite) and real storage: in this process for the lease loop, a lost lease, a
refused spec and an engine death; as a process of its own for SIGTERM and SIGKILL. One test
(marked `engine`) runs the real worker command with the real vLLM engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pool_worker_fakes import (
    POOL,
    FakePoolEngine,
    spec_dict,
    submission,
    text,
    write_shards,
)

from dagster_gpuinfer import InferenceSpec, read_partition
from dagster_gpuinfer.pools import LeaseQueue, SqliteLeaseQueue
from dagster_gpuinfer.storage import (
    committed_manifest,
    filesystem_for,
    model_version,
    partition_dir,
    read_chunk_markers,
)
from dagster_gpuinfer.worker import lifecycle
from dagster_gpuinfer.worker.errors import EngineDied
from dagster_gpuinfer.worker.loop.engine import same_engine
from dagster_gpuinfer.worker.pool.loop import EXIT_BUILD_FAILED, PoolWorkerLoop

HERE = Path(__file__).parent
# The real engine's KV cache (bench/context.py gives its engines the same).
KV_CACHE_BYTES = 512 << 20


@pytest.fixture
def queue(tmp_path) -> LeaseQueue:
    with SqliteLeaseQueue(tmp_path / "pools.db") as opened:
        yield opened


class Builds:
    """An engine builder that counts builds and keeps the engines it built."""

    def __init__(self, **engine_kwargs) -> None:
        self.engines: list[FakePoolEngine] = []
        self.engine_kwargs = engine_kwargs

    def __call__(self, spec: InferenceSpec, on_death) -> FakePoolEngine:
        engine = FakePoolEngine(spec, **self.engine_kwargs)
        self.engines.append(engine)
        return engine


def worker(queue: LeaseQueue, builds: Builds, **kwargs) -> PoolWorkerLoop:
    settings = {"idle_ttl_s": 0.5, "lease_ttl_s": 30.0, "poll_s": 0.02} | kwargs
    return PoolWorkerLoop(queue, POOL, worker_id="w1", engine_builder=builds, **settings)


def results(queue: LeaseQueue, job_id: str) -> dict[str, dict]:
    return {e.item_key: e.payload for e in queue.job_events(job_id) if e.kind == "result"}


def markers(spec: dict, key: str) -> int:
    """Chunk markers of `spec`'s partition `key` on storage (committed chunks)."""
    parsed = InferenceSpec.model_validate(spec)
    fs, path = filesystem_for(partition_dir(parsed.output, key), parsed.storage)
    return len(read_chunk_markers(fs, path, parsed.spec_hash()))


def committed(spec: dict, key: str) -> bool:
    parsed = InferenceSpec.model_validate(spec)
    return committed_manifest(parsed, key, model=model_version(parsed)) is not None


def assert_every_row_once(spec: dict, key: str, rows: int, partition: int) -> None:
    output = InferenceSpec.model_validate(spec).output
    table = read_partition(output, key)
    assert table.column("id").to_pylist() == [f"{key}-{i}" for i in range(rows)]
    numbers = [int(v[0]) for v in table.column("embedding").to_pylist()]
    assert numbers == [int(text(partition, i)[4:]) for i in range(rows)]


# --------------------------------------------------------------------------- the lease loop


def test_one_engine_serves_two_jobs_then_the_worker_exits_when_idle(tmp_path, queue):
    keys = ["a0", "a1"]
    write_shards(tmp_path, keys, rows=10)
    first = spec_dict(tmp_path, keys, max_requests_in_flight=3)
    second = spec_dict(tmp_path, ["a1"], asset="emb2", chunk_size=3)
    queue.submit(submission("run-1", first))
    queue.submit(submission("run-2", second))
    builds = Builds()
    loop = worker(queue, builds)

    started = time.monotonic()
    assert loop.run() == 0
    assert time.monotonic() - started >= 0.5  # it waited out its idle TTL

    (engine,) = builds.engines  # one build for three leases of two jobs
    assert engine.shutdowns == 1 and len(engine.binds) == 2
    assert {s.output.asset_name for s in engine.binds} <= {"emb", "emb2"}
    assert_every_row_once(first, "a0", 10, 1)
    assert_every_row_once(first, "a1", 10, 2)
    assert_every_row_once(second, "a1", 10, 2)  # the same shard, another output
    served = {
        **results(queue, "run-1"),
        **{f"2:{k}": v for k, v in results(queue, "run-2").items()},
    }
    assert len(served) == 3
    warm = sorted(r["pool"]["warm"] for r in served.values())
    assert warm == [False, True, True]
    for result in served.values():
        (message,) = result["messages"]
        assert message["type"] == "partition" and message["computed"] is True
        assert result["pool"]["worker_id"] == "w1" and result["pool"]["lease_attempt"] == 1
        cold = not result["pool"]["warm"]
        assert (result["pool"]["engine_load_seconds"] > 0) == cold
    logs = [e.payload["message"] for e in queue.job_events("run-1") if e.kind == "log"]
    assert any(m.startswith("engine built in") for m in logs)
    assert any(m.startswith("partition a1 committed") for m in logs)
    assert (loop.cold_starts, loop.warm_hits, loop.leases_served) == (1, 2, 3)
    assert queue.pool_workers(POOL) == []  # removed on exit
    assert queue.job_progress("run-1").state == queue.job_progress("run-2").state == "done"


def test_a_spec_that_needs_another_engine_is_refused_with_a_fatal_result(tmp_path, queue):
    write_shards(tmp_path, ["p0"], rows=4)
    good = spec_dict(tmp_path, ["p0"])
    other_engine = spec_dict(tmp_path, ["p0"], asset="big", engine={"max_model_len": 4096})
    queue.submit(submission("run-1", good))
    queue.submit(submission("run-2", other_engine))
    queue.submit(submission("run-3", {**good, "task": "no-such-task"}))
    builds = Builds()
    assert worker(queue, builds).run() == 0

    assert len(builds.engines) == 1
    ((fatal,),) = [r["messages"] for r in results(queue, "run-2").values()]
    assert fatal["type"] == "fatal" and "max_model_len" in fatal["message"]
    ((invalid,),) = [r["messages"] for r in results(queue, "run-3").values()]
    assert invalid["type"] == "fatal" and "does not validate" in invalid["message"]
    assert queue.job_progress("run-2").state == "done"  # settled: the step raises Failure
    assert builds.engines[0].spec.output.asset_name == "emb"  # still bound to what it served


def test_same_engine_names_what_differs():
    base = InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "generate",
            "input": {"uri": "in/{partition_key}.jsonl"},
            "output": {"root": "out", "asset_name": "a"},
        }
    )
    per_run = base.model_copy(
        update={"sampling": base.sampling.model_copy(update={"temperature": 0.1})}
    )
    assert same_engine(base, per_run) is None  # sampling is bound per lease
    assert "model" in same_engine(base, base.model_copy(update={"model": "/other"}))
    bigger = base.model_copy(update={"tensor_parallel_size": 2})
    assert "tensor_parallel_size=1 here, 2 asked" in same_engine(base, bigger)
    embed = base.model_copy(update={"task": "embed"})
    assert "runner" in same_engine(base, embed)


# --------------------------------------------------------------------------- lost leases


def test_a_cancelled_job_stops_its_partition_and_the_worker_goes_on(tmp_path, queue):
    write_shards(tmp_path, ["slow", "next"], rows=120)
    slow = spec_dict(tmp_path, ["slow"])
    after = spec_dict(tmp_path, ["next"], asset="after")
    queue.submit(submission("run-1", slow, priority=1))
    queue.submit(submission("run-2", after))
    builds = Builds(step_seconds=0.01)
    loop = worker(queue, builds, lease_ttl_s=0.3)  # heartbeats every 0.1 s

    def cancel_after_a_chunk() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if markers(slow, "slow"):
                queue.cancel("run-1", "the run was terminated")
                return
            time.sleep(0.01)

    canceller = threading.Thread(target=cancel_after_a_chunk)
    canceller.start()
    assert loop.run() == 0
    canceller.join()

    (engine,) = builds.engines
    assert queue.job_progress("run-1").state == "cancelled"
    assert results(queue, "run-1") == {}  # never completed
    assert 1 <= markers(slow, "slow") < 30 and not committed(slow, "slow")  # stopped midway
    assert_every_row_once(after, "next", 120, 2)  # and went on to the next job, warm
    ((result,),) = [list(results(queue, "run-2").values())]
    assert result["pool"]["warm"] is True


def test_an_engine_death_fails_the_lease_and_exits_75(tmp_path, queue, monkeypatch):
    write_shards(tmp_path, ["p0"], rows=8)
    queue.submit(submission("run-1", spec_dict(tmp_path, ["p0"])))
    told: list[str] = []
    monkeypatch.setattr(lifecycle, "_notify", [told.append])

    class Dies(FakePoolEngine):
        def step(self):
            raise EngineDied("the vLLM engine process EngineCore (pid 1) is gone")

    loop = worker(queue, lambda spec, on_death: Dies(spec))
    assert loop.run() == lifecycle.EXIT_ENGINE_DIED == 75
    (item,) = queue.job_items("run-1")
    assert (item.state, item.failures) == ("queued", 1)
    assert "the engine died" in item.last_error and "EngineCore" in item.last_error
    assert told and "exit code 75" in told[0]


def test_a_worker_whose_engine_cannot_be_built_leaves_without_failing_the_other_items(
    tmp_path, queue
):
    """A build that fails (memory, a bad device, a startup timeout) fails the one lease and
    the worker exits 1: it does not fail every item of the pool in turn."""
    write_shards(tmp_path, ["p0", "p1", "p2"], rows=4)
    queue.submit(submission("run-1", spec_dict(tmp_path, ["p0", "p1", "p2"])))
    builds: list[str] = []

    def cannot_build(spec, on_death):
        builds.append(spec.model)
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    loop = worker(queue, cannot_build)
    assert loop.run() == EXIT_BUILD_FAILED == 1
    assert len(builds) == 1
    items = {item.key: item for item in queue.job_items("run-1")}
    assert [(i.state, i.failures) for i in items.values()] == [("queued", 1)] + [("queued", 0)] * 2
    assert "Engine core initialization failed" in items["p0"].last_error
    assert queue.pool_workers(POOL) == []


class Unreachable:
    """The queue, but `heartbeat` and the first `lease` fail as a store that went away."""

    def __init__(self, queue: LeaseQueue) -> None:
        self.queue = queue
        self.lease_failures = 1

    def heartbeat(self, lease, **kwargs):
        raise ConnectionError("cannot reach the lease queue")

    def lease(self, *args, **kwargs):
        if self.lease_failures:
            self.lease_failures -= 1
            raise ConnectionError("cannot reach the lease queue")
        return self.queue.lease(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.queue, name)


def test_a_heartbeat_that_cannot_reach_the_store_for_a_ttl_loses_the_lease(tmp_path, queue):
    from dagster_gpuinfer.worker.pool.keeper import LeaseKeeper

    queue.submit(submission("run-1", spec_dict(tmp_path, ["p0"])))
    # Timed from before the lease: its TTL runs from the moment it was granted, and on a
    # loaded machine the keeper may start well after that.
    started = time.monotonic()
    lease = queue.lease(POOL, worker_id="w", ttl_s=0.3)
    lost = threading.Event()
    reasons: list[str] = []
    keeper = LeaseKeeper(
        Unreachable(queue), lease, on_lost=lambda exc: (reasons.append(exc.reason), lost.set())
    ).start()
    assert lost.wait(5)
    assert time.monotonic() - started >= 0.3  # not before a whole TTL without a heartbeat
    keeper.stop()
    assert reasons == ["expired"]


def test_a_store_blip_while_polling_costs_no_warm_engine(tmp_path, queue):
    write_shards(tmp_path, ["p0"], rows=4)
    spec = spec_dict(tmp_path, ["p0"])
    queue.submit(submission("run-1", spec))
    flaky = Unreachable(queue)
    flaky.heartbeat = queue.heartbeat
    builds = Builds()
    loop = PoolWorkerLoop(
        flaky, POOL, worker_id="w1", engine_builder=builds, idle_ttl_s=0.3, poll_s=0.02
    )
    assert loop.run() == 0
    assert flaky.lease_failures == 0 and len(builds.engines) == 1
    assert_every_row_once(spec, "p0", 4, 1)


# --------------------------------------------------------------------------- real processes


def start_fake_worker(location: Path, worker_id: str, *, step_seconds: float, lease_ttl: float):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "pool_worker_fakes.py"),
            str(location),
            POOL,
            worker_id,
            str(step_seconds),
            "1.0",
            str(lease_ttl),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_markers(spec: dict, key: str, at_least: int, process, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = markers(spec, key)
        if found >= at_least:
            return found
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.01)
    raise AssertionError(f"fewer than {at_least} chunk markers after {timeout} s")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_a_stopped_worker_hands_its_partition_on_and_every_row_comes_once(tmp_path, signal_name):
    """SIGTERM: the worker drains, releases the lease (no attempt counted) and exits 143.
    SIGKILL: the lease expires. Either way a second worker leases the item again, skips the
    committed chunks and writes every row exactly once."""
    rows = 200
    write_shards(tmp_path, ["big"], rows=rows)
    spec = spec_dict(tmp_path, ["big"])
    location = tmp_path / "pools.db"
    with SqliteLeaseQueue(location) as queue:
        queue.submit(submission("run-1", spec))
    first = start_fake_worker(location, "first", step_seconds=0.02, lease_ttl=1.0)
    wait_for_markers(spec, "big", 3, first)
    first.send_signal(getattr(signal, signal_name))
    output = first.communicate(timeout=60)[0]
    expected = lifecycle.EXIT_DRAINED if signal_name == "SIGTERM" else -signal.SIGKILL
    assert first.returncode == expected, output
    assert 3 <= markers(spec, "big") < rows // 4 and not committed(spec, "big")

    with SqliteLeaseQueue(location) as queue:
        (item,) = queue.job_items("run-1")
        assert item.worker_id == "first"
        if signal_name == "SIGTERM":  # handed back at once, no attempt counted
            assert (item.state, item.failures) == ("queued", 0)
            assert "SIGTERM" in item.last_error
    second = start_fake_worker(location, "second", step_seconds=0.0, lease_ttl=1.0)
    output = second.communicate(timeout=120)[0]
    assert second.returncode == 0, output

    assert_every_row_once(spec, "big", rows, 1)
    with SqliteLeaseQueue(location) as queue:
        (item,) = queue.job_items("run-1")
        assert (item.state, item.leases, item.worker_id) == ("done", 2, "second")
        assert item.failures == (0 if signal_name == "SIGTERM" else 1)  # the expiry counted
        ((result,),) = [list(results(queue, "run-1").values())]
    (message,) = result["messages"]
    assert message["manifest"]["rows_resumed"] >= 3 * 4  # the first worker's chunks were kept
    assert result["pool"]["lease_attempt"] == 2


# --------------------------------------------------------------------------- the real engine


def _generate_spec(root: Path, model: str, asset: str, keys: list[str], tokens: int, **kw) -> dict:
    return InferenceSpec.model_validate(
        {
            "model": model,
            "task": "generate",
            "input": {"uri": str(root / "in" / "{partition_key}.jsonl"), "text_column": "prompt"},
            "output": {"root": str(root / "out"), "asset_name": asset},
            # A fixed KV cache, as the benchmarks give theirs: vLLM's default
            # gpu_memory_utilization (0.9) reserves 90% of NUMA node 0 on the CPU build
            # (21 GiB of 23.5 here), which no other engine of the suite can start beside.
            "engine": {
                "max_model_len": 256,
                "enforce_eager": True,
                "extra": {"kv_cache_memory_bytes": KV_CACHE_BYTES},
            },
            "sampling": {"max_tokens": tokens, "min_tokens": tokens, **kw},
            "partition_keys": keys,
            "chunk_size": 4,
        }
    ).model_dump(mode="json")


def _watch_family(process: subprocess.Popen) -> list:
    """Every process under `process` seen while it runs (polled until it exits)."""
    import psutil

    seen: dict[int, psutil.Process] = {}
    while process.poll() is None:
        try:
            for child in psutil.Process(process.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.Error:
            pass
        time.sleep(0.5)
    return list(seen.values())


@pytest.mark.engine
def test_the_worker_command_serves_two_jobs_on_one_real_engine(tmp_path, tiny_llama_dir):
    """`python -m dagster_gpuinfer.worker --pool`: two jobs of one pool with other sampling
    (3 and 6 tokens a row) on one engine build; the second job's rows follow its own
    sampling (the spec was bound to the warm engine); exit 0 after the idle TTL with no
    engine process left."""
    import psutil
    from support import write_prompts

    from dagster_gpuinfer.pools import pool_key

    for key, rows in (("p0", 6), ("p1", 5)):
        write_prompts(tmp_path / "in" / f"{key}.jsonl", rows)
    short = _generate_spec(tmp_path, tiny_llama_dir, "short", ["p0", "p1"], 3)
    long = _generate_spec(tmp_path, tiny_llama_dir, "long", ["p1"], 6, temperature=0.8)
    specs = {
        name: InferenceSpec.model_validate(s) for name, s in (("short", short), ("long", long))
    }
    key = pool_key(specs["short"], model_revision=model_version(specs["short"]))
    assert key == pool_key(specs["long"], model_revision=model_version(specs["long"]))
    location = tmp_path / "pools.db"
    with SqliteLeaseQueue(location) as queue:
        for name, spec in (("short", short), ("long", long)):
            job = submission(f"run-{name}", spec)
            queue.submit(type(job)(job.job_id, key, job.items, payload=job.payload))
    load_log = tmp_path / "loads.log"
    env = {**os.environ, "GPUINFER_MODEL_LOAD_LOG": str(load_log), "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("GPUINFER_LEASE_QUEUE", None)
    command = [sys.executable, "-m", "dagster_gpuinfer.worker", "--pool", key]
    command += ["--queue", str(location), "--worker-id", "real", "--idle-ttl", "3"]
    worker_process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output_lines: list[str] = []
    reader = threading.Thread(target=lambda: output_lines.extend(worker_process.stdout))
    reader.start()
    try:
        family = _watch_family(worker_process)
        worker_process.wait(timeout=600)
    finally:
        worker_process.kill()
        reader.join(timeout=30)
    output = "".join(output_lines)
    assert worker_process.returncode == 0, output[:6000] + "\n...\n" + output[-4000:]
    assert "no lease for" in output
    assert family, "the worker started no engine process"
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    assert load_log.exists(), f"no engine was built:\n{output[-5000:]}"
    assert len(load_log.read_text().splitlines()) == 1  # one engine for three leases
    with SqliteLeaseQueue(location) as queue:
        events = [e for job in ("run-short", "run-long") for e in queue.job_events(job)]
        assert queue.pool_workers(key) == []
    served = sorted((e for e in events if e.kind == "result"), key=lambda e: e.seq)
    assert [e.payload["pool"]["warm"] for e in served] == [False, True, True]
    assert served[0].payload["pool"]["engine_load_seconds"] > 0
    for event in served:
        (message,) = event.payload["messages"]
        assert message["type"] == "partition" and message["computed"], message
    for name, keys, tokens in (("short", ["p0", "p1"], 3), ("long", ["p1"], 6)):
        for partition in keys:
            spec = specs[name]
            assert committed_manifest(spec, partition, model=model_version(spec)) is not None
            table = read_partition(spec.output, partition)
            assert table.num_rows == (6 if partition == "p0" else 5)
            assert set(table.column("generated_tokens").to_pylist()) == {tokens}
