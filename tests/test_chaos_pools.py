"""The chaos run's pool mode (bench/chaos/pool_faults.py) without an engine: its schedule
and options, the backfill it asks for, which pods its injector may hit (a real lease queue,
on PostgreSQL as the harness runs it and on SQLite; a real loopback S3) and what it does to
them (real processes SIGKILLed).
`make chaos SEED=n MODE=pools` runs it end to end."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from support import fresh_postgres_database

from bench.chaos import pool_faults
from bench.chaos.__main__ import parse
from bench.chaos.faults import KINDS, POOL_KINDS, Fault, Injector, schedule
from bench.chaos.pool_faults import GROUP_ASSET, POOL_ASSET, PoolChaos, PoolsSetup
from bench.chaos.report import summary_table
from bench.chaos.run import Phase, backfill_params
from bench.chaos.store_faults import postgres
from dagster_gpuinfer.k8s.config import K8sLauncherConfig
from dagster_gpuinfer.pools import JobSubmission, WorkItem, open_lease_queue

POOL_KEY = "pool-a"
GONE_PID = 2**22 + 7  # above Linux's default pid_max: no such process, never hit
BUCKET = "chaos-pools"


def test_pool_mode_schedules_every_kind_once_and_run_mode_refuses_the_pool_kinds(capsys):
    options = parse(["--mode", "pools", "--seed", "4"])
    assert set(options.kinds.split(",")) == {*KINDS, *POOL_KINDS}
    assert options.faults == len(KINDS) + len(POOL_KINDS)
    planned = schedule(4, options.faults, 300.0, tuple(options.kinds.split(",")))
    assert sorted(f.kind for f in planned) == sorted((*KINDS, *POOL_KINDS))
    assert parse(["--seed", "4"]).kinds.split(",") == list(KINDS)  # run mode: as before
    with pytest.raises(SystemExit):
        parse(["--kinds", "pool_worker_kill"])
    assert "pool kinds need --mode pools" in capsys.readouterr().err


def test_the_partitions_are_split_between_the_pipelines_or_refused_by_flag():
    split = pool_faults.split_keys(50, 10, 4)
    assert [len(split[a]) for a in ("doc_embeddings", POOL_ASSET, GROUP_ASSET)] == [36, 10, 4]
    assert len({k for keys in split.values() for k in keys}) == 50
    with pytest.raises(ValueError, match="raise --partitions"):
        pool_faults.split_keys(10, 8, 4)


def test_one_asset_is_backfilled_by_name_several_by_their_own_ranges():
    assert backfill_params({"doc_embeddings": ["docs-000", "docs-001"]}) == {
        "partitionNames": ["docs-000", "docs-001"],
        "assetSelection": [{"path": ["doc_embeddings"]}],
    }
    params = backfill_params({"a": ["a-0", "a-1", "a-2"], "b": ["b-0"]})
    assert params["partitionsByAssets"] == [
        {"assetKey": {"path": ["a"]}, "partitions": {"range": {"start": "a-0", "end": "a-2"}}},
        {"assetKey": {"path": ["b"]}, "partitions": {"range": {"start": "b-0", "end": "b-0"}}},
    ]


def test_the_summary_shows_the_pool_rows_of_each_phase():
    base = Phase("baseline", extra={"pool jobs / items / leases": "1 / 4 / 4"})
    chaos = Phase("chaos", extra={"pool jobs / items / leases": "1 / 4 / 5"})
    lines = summary_table(base, chaos)
    assert "| pool jobs / items / leases | 1 / 4 / 4 | 1 / 4 / 5 |" in lines


# ------------------------------------------------------------- targets and hits


@pytest.fixture(params=["postgres", "sqlite"])
def queue_location(request, tmp_path) -> Iterator[str]:
    """A new lease queue's location: a database on the suite's PostgreSQL server (how the
    harness runs pool mode), or a SQLite file (`--pool-queue sqlite`)."""
    if request.param == "sqlite":
        yield str(tmp_path / pool_faults.QUEUE_FILE)
        return
    with fresh_postgres_database("chaos_pools") as url:
        yield url


@pytest.fixture
def pools(queue_location):
    """Pool mode's setup whose lease queue has one job: item 0 leased by w1 (live), item 1
    by w2 (live), item 2 by w3 whose lease lapsed, item 3 queued."""
    setup = PoolsSetup(queue=queue_location, pool_keys=[], group_keys=[])
    with open_lease_queue(setup.queue) as queue:
        keys = ["pool-000#chunks=0-1", "pool-001", "pool-002", "pool-003"]
        queue.submit(JobSubmission("job-1", POOL_KEY, [WorkItem(k, {}) for k in keys]))
        queue.lease(POOL_KEY, worker_id="w1", ttl_s=600)
        queue.lease(POOL_KEY, worker_id="w2", ttl_s=600)
        queue.lease(POOL_KEY, worker_id="w3", ttl_s=0.05)
    time.sleep(0.1)
    return setup


@pytest.fixture
def s3(s3_server):
    """The suite's loopback S3 (conftest.py), with this module's bucket emptied."""
    client = s3_server.client
    client.create_bucket(Bucket=BUCKET)
    for listed in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=listed["Key"])
    return client


@dataclass
class FakePod:
    """What the injector reads of an executor pod: its manifest, labels and process."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    process: Any = None
    terminated: bool = False
    deletion_requested_at: Any = None
    oom_injected: bool = False
    log: str = ""

    @property
    def manifest(self) -> dict[str, Any]:
        return {"metadata": {"labels": self.labels, "annotations": self.annotations}}

    def text(self) -> str:
        return self.log


def pool_pod(worker_id: str, process: Any = None) -> FakePod:
    return FakePod(
        f"gpuinfer-pool-{worker_id}",
        {"gpuinfer/pool": POOL_KEY, "gpuinfer.dagster.io/pool": "gpu"},
        {"gpuinfer/worker-id": worker_id},
        process or SimpleNamespace(pid=GONE_PID),
    )


def follower_pod(process: Any = None) -> FakePod:
    labels = {
        "gpuinfer.dagster.io/group-role": "follower",
        "gpuinfer.dagster.io/pool": "gpu",
        "dagster/run-id": "r1",
    }
    return FakePod("gpuinfer-gen-f", labels, process=process or SimpleNamespace(pid=GONE_PID))


def test_pods_are_told_apart_by_their_exact_labels():
    """Seen in seed 1 of pool mode: every worker pod carries `gpuinfer.dagster.io/pool` (its
    Dagster pool), which a suffix match took for the engine pool's label: the follower read
    as a pool pod and was never hit."""
    from dagster_gpuinfer.k8s.pool_pod import build_pool_pod
    from resources.k8s import k8s_launcher_config

    config = k8s_launcher_config({"GPUINFER_WORKER_IMAGE": "registry.example.com/w:1"})
    pool = build_pool_pod("model-abc", "w-1", config)
    assert pool_faults.pod_role(SimpleNamespace(manifest=pool)) == "pool"
    assert pool_faults.pool_worker_id(SimpleNamespace(manifest=pool)) == "w-1"
    run = {"gpuinfer.dagster.io/pool": "gpu", "dagster/run-id": "r1"}
    assert pool_faults.pod_role(FakePod("run", run)) == "run"
    follower = {**run, "gpuinfer.dagster.io/group-role": "follower"}
    assert pool_faults.pod_role(FakePod("f", follower)) == "follower"


def test_only_live_lease_holders_are_listed(pools):
    held = pool_faults.lease_holders(pools.queue)
    assert held == {"w1": ["pool-000#chunks=0-1"], "w2": ["pool-001"]}


def test_while_the_queues_server_is_down_no_pod_is_a_target_and_nothing_raises(s3):
    """A `postgres_restart` stops the queue's server under the injector: it waits."""
    with socket.socket() as sock:  # a port nobody listens on: the server is down
        sock.bind(("127.0.0.1", 0))
        down = f"postgresql://gpuinfer@127.0.0.1:{sock.getsockname()[1]}/queue"
    with pytest.raises(pool_faults.QUEUE_DOWN):
        pool_faults.lease_holders(down)
    chaos = PoolChaos(PoolsSetup(queue=down, pool_keys=[], group_keys=[]), s3, BUCKET, "chaos")
    assert chaos.lease_holders() == {}
    assert chaos.targets("pool_worker_kill", [pool_pod("w1")]) == []
    assert chaos.hit(pool_pod("w1"), "pool_worker_kill") is None


QUEUE_PROBE = """
import os
from dagster_gpuinfer.pools import open_lease_queue
with open_lease_queue(os.environ["GPUINFER_LEASE_QUEUE"]) as queue:
    print("pools:", queue.pools(), flush=True)
"""


def test_a_pool_pod_leases_from_the_harness_server_before_and_after_a_restart(pod_executor):
    """Pool mode's queue lives on the harness's server: a pod (its own network namespace)
    must reach it on the pod network's gateway, also after `postgres_restart`. (The first
    run of pool mode on PostgreSQL: every pool worker exited 1, the server listened on
    127.0.0.1 only.)"""
    from test_pod_executor import NS, pod, wait_phase

    with postgres(pod_executor.gateway) as server:
        url = server.database("chaos_pool_queue", pod_executor.gateway)
        with open_lease_queue(url) as queue:
            queue.submit(JobSubmission("job-1", POOL_KEY, [WorkItem("pool-000", {})]))
        pod_executor.secrets[pool_faults.QUEUE_SECRET] = {"url": url}
        env = [
            {
                "name": "GPUINFER_LEASE_QUEUE",
                "valueFrom": {"secretKeyRef": {"name": pool_faults.QUEUE_SECRET, "key": "url"}},
            }
        ]
        for name in ("before-restart", "after-restart"):
            pod_executor.create_namespaced_pod(NS, pod(name, QUEUE_PROBE, container={"env": env}))
            status = wait_phase(pod_executor, name)
            assert status.phase == "Succeeded", pod_executor.logs(name)
            assert pod_executor.logs(name).strip().splitlines()[-1] == f"pools: ['{POOL_KEY}']"
            server.restart(0.2, "fast")


def _models_in_place(workdir: Path) -> None:
    """`prepare`'s models, already there (it reuses complete ones): no copy, no weights."""
    (workdir / "models" / "model").mkdir(parents=True)
    llama = workdir / "models" / pool_faults.GROUP_MODEL
    llama.mkdir()
    (llama / "config.json").write_text("{}")
    (llama / "model.safetensors").write_bytes(b"")


def test_prepare_puts_the_queue_in_postgres_with_its_url_in_the_secret(tmp_path):
    _models_in_place(tmp_path)
    executor = SimpleNamespace(secrets={}, claims={})
    keys = {POOL_ASSET: ["pool-000"], GROUP_ASSET: ["group-000"]}
    with fresh_postgres_database("chaos_prepare") as url:
        setup = pool_faults.prepare(executor, tmp_path, "unused", keys, queue_url=url)
        assert setup.queue == url and setup.on_postgres
        assert executor.secrets == {pool_faults.QUEUE_SECRET: {"url": url}}
        assert executor.claims == {}  # no volume: the pods reach the server
        assert pool_faults.lease_holders(url) == {}  # the queue's tables are there
        config, _ = pool_faults.resource_fields(K8sLauncherConfig(image="i"), setup)
        assert config.pools.queue_pvc is None


def test_prepare_puts_a_sqlite_queue_on_the_pods_volume(tmp_path):
    from dagster_gpuinfer.k8s.config import QUEUE_MOUNT

    _models_in_place(tmp_path)
    executor = SimpleNamespace(secrets={}, claims={})
    keys = {POOL_ASSET: ["pool-000"], GROUP_ASSET: ["group-000"]}
    setup = pool_faults.prepare(executor, tmp_path, "unused", keys)
    folder = tmp_path / "queue-pvc"
    assert setup.queue == str(folder / pool_faults.QUEUE_FILE) and not setup.on_postgres
    url = f"{QUEUE_MOUNT}/{pool_faults.QUEUE_FILE}"
    assert executor.secrets == {pool_faults.QUEUE_SECRET: {"url": url}}
    assert executor.claims == {pool_faults.QUEUE_CLAIM: str(folder)}
    assert Path(setup.queue).stat().st_uid == pool_faults.POD_UID
    config, _ = pool_faults.resource_fields(K8sLauncherConfig(image="i"), setup)
    assert config.pools.queue_pvc == pool_faults.QUEUE_CLAIM


def test_a_pool_worker_mid_partition_is_hit_first_then_any_lease_holder(pools, s3):
    clock = SimpleNamespace(now=0.0)
    chaos = PoolChaos(pools, s3, BUCKET, "chaos", clock=lambda: clock.now)
    assert chaos.targets("pool_worker_kill", [follower_pod()]) == []  # no pool pod yet
    clock.now += 2 * pool_faults.MID_PARTITION_WAIT_S  # waiting for the pool's run
    pods = [pool_pod("w1"), pool_pod("w2"), pool_pod("w3"), follower_pod()]
    assert chaos.targets("pool_worker_kill", pods) == []  # no chunk committed anywhere
    s3.put_object(Bucket=BUCKET, Key=f"chaos/{POOL_ASSET}/pool-000/_chunks/00000.json", Body=b"{}")
    assert [p.name for p in chaos.targets("pool_worker_kill", pods)] == ["gpuinfer-pool-w1"]
    s3.put_object(Bucket=BUCKET, Key=f"chaos/{POOL_ASSET}/pool-000/_SUCCESS", Body=b"{}")
    assert chaos.targets("pool_worker_kill", pods) == []  # committed: not mid-partition
    clock.now += pool_faults.MID_PARTITION_WAIT_S
    names = [p.name for p in chaos.targets("pool_worker_kill", pods)]
    assert names == ["gpuinfer-pool-w1", "gpuinfer-pool-w2"]  # w3's lease lapsed: not held


def test_a_follower_is_hit_once_its_group_committed_a_chunk(pools, s3):
    chaos = PoolChaos(pools, s3, BUCKET, "chaos")
    pods = [
        pool_pod("w1"),
        follower_pod(),
        FakePod("leader", {"gpuinfer.dagster.io/group-role": "leader"}),
    ]
    assert chaos.targets("follower_kill", pods) == []
    s3.put_object(Bucket=BUCKET, Key=f"base/{GROUP_ASSET}/g-0/_chunks/00000.json", Body=b"{}")
    assert chaos.targets("follower_kill", pods) == []  # another phase's prefix
    s3.put_object(Bucket=BUCKET, Key=f"chaos/{GROUP_ASSET}/g-0/_chunks/00000.json", Body=b"{}")
    assert [p.name for p in chaos.targets("follower_kill", pods)] == ["gpuinfer-gen-f"]


class FakeExecutor:
    def __init__(self, pods: list[FakePod]) -> None:
        self._lock = threading.Lock()
        self.pods = {p.name: p for p in pods}


def run_injector(
    faults: list[Fault], executor: FakeExecutor, pools: Any, daemon: Any = None, give_up_s=20
) -> Injector:
    """Until every fault is done or skipped (a pool kind waits in its own thread)."""
    injector = Injector(faults, executor, None, daemon, seed=1, give_up_s=give_up_s)
    injector.pools = pools
    injector.run(time.monotonic()).join(30)
    deadline = time.monotonic() + 30
    while len(injector.done) + len(injector.skipped) < len(faults):
        assert time.monotonic() < deadline, f"{injector.done}, {injector.skipped}"
        time.sleep(0.05)
    injector.stop()
    return injector


def test_the_injector_sigkills_the_worker_process_that_holds_the_lease(pools, s3):
    # The pod's top process (a shell) runs the worker (a process named as the worker's
    # module): the worker is the one killed, and only the worker holding a lease.
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", "dagster_gpuinfer.worker"]
    env = {"PY": sys.executable, "WORKER": sleeper[-1]}  # not on the shell's command line
    script = '"$PY" -c "import time; time.sleep(120)" "$WORKER" & wait $!'
    top = subprocess.Popen(["sh", "-c", script], env=env)
    idle = subprocess.Popen(sleeper)
    try:
        while pool_faults._worker_process(pool_pod("w", top)) is None:  # noqa: SLF001
            time.sleep(0.05)  # until the shell has started it
        s3.put_object(
            Bucket=BUCKET, Key=f"chaos/{POOL_ASSET}/pool-001/_chunks/00000.json", Body=b"{}"
        )
        chaos = PoolChaos(pools, s3, BUCKET, "chaos")
        executor = FakeExecutor([pool_pod("w2", top), pool_pod("w9", idle)])
        injector = run_injector([Fault(0.0, "pool_worker_kill")], executor, chaos)
        [done] = injector.done
        assert done.target == "gpuinfer-pool-w2"
        assert "SIGKILL pool worker pid" in done.note and "holding pool-001" in done.note
        assert top.wait(20) == 128 + signal.SIGKILL  # the shell: its worker died of SIGKILL
        assert idle.poll() is None  # w9 holds no lease: untouched
    finally:
        for process in (top, idle):
            process.kill()
            process.wait()


def test_the_injector_kills_the_followers_whole_process_group(pools, s3):
    follower = subprocess.Popen(
        ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' & wait"],
        start_new_session=True,  # the pod's container: its own process group
    )
    s3.put_object(Bucket=BUCKET, Key=f"chaos/{GROUP_ASSET}/g-0/_chunks/00000.json", Body=b"{}")
    chaos = PoolChaos(pools, s3, BUCKET, "chaos")
    executor = FakeExecutor([follower_pod(follower)])
    injector = run_injector([Fault(0.0, "follower_kill")], executor, chaos)
    assert [i.target for i in injector.done] == ["gpuinfer-gen-f"]
    assert follower.wait(20) == -signal.SIGKILL
    assert live_in_group(follower.pid) == []  # the sleeping child went with it


def live_in_group(pgid: int, wait_s: float = 10.0) -> list[int]:
    """Processes of group `pgid` that are not zombies (a killed child is reaped by init
    a moment later), after waiting up to `wait_s` for them to go."""
    deadline = time.monotonic() + wait_s
    while True:
        live = []
        for process in psutil.process_iter(["pid", "status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                    live.append(process.pid)
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def test_a_pool_kind_without_pool_mode_is_skipped_not_raised():
    executor = FakeExecutor([pool_pod("w1")])
    injector = run_injector([Fault(0.0, "pool_worker_kill")], executor, None, give_up_s=1)
    assert injector.done == [] and [f.kind for f in injector.skipped] == ["pool_worker_kill"]


def test_a_pool_kind_waiting_for_its_run_does_not_hold_back_the_faults_after_it(pools, s3):
    """Seen in a pool-mode smoke run: a follower kill waited for the group's run, which came
    last, and the pool worker kill behind it in the schedule never happened."""
    restarts: list[float] = []
    daemon = SimpleNamespace(restart=restarts.append)
    chaos = PoolChaos(pools, s3, BUCKET, "chaos")  # no chunk committed: no follower to hit yet
    faults = [Fault(0.0, "follower_kill"), Fault(0.1, "daemon_restart", seconds=2.0)]
    executor = FakeExecutor([follower_pod()])
    injector = Injector(faults, executor, None, daemon, seed=1, give_up_s=600)
    injector.pools = chaos
    injector.run(time.monotonic())
    deadline = time.monotonic() + 20
    while not restarts and time.monotonic() < deadline:
        time.sleep(0.05)
    injector.stop()  # the backfill ended: the follower kill is skipped
    assert restarts == [2.0], "the daemon restart waited behind the follower kill"
    assert [i.fault.kind for i in injector.done] == ["daemon_restart"]
    while not injector.skipped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [f.kind for f in injector.skipped] == ["follower_kill"]


@dataclass
class FakeStores:
    """The injector's `stores`: records each store fault it is told to do."""

    done: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def inject(self, kind: str, down_s: float, rng: Any) -> str:
        self.done.append(kind)
        return f"{kind} {down_s:.1f} s"


def test_a_store_restart_waits_for_live_leases_when_the_queue_is_on_the_store(s3):
    """Pool mode on the PostgreSQL queue: `postgres_restart` restarts the queue's server
    under live leases (seed 1's first run on it restarted the server before the pool's run
    began), waiting in its own thread; the faults after it go on meanwhile."""
    restarts: list[float] = []
    daemon = SimpleNamespace(restart=restarts.append)
    with fresh_postgres_database("chaos_store_leases") as url:
        with open_lease_queue(url) as queue:
            queue.submit(JobSubmission("job-1", POOL_KEY, [WorkItem("pool-000", {})]))
        chaos = PoolChaos(PoolsSetup(queue=url, pool_keys=[], group_keys=[]), s3, BUCKET, "c")
        faults = [Fault(0.0, "postgres_restart", seconds=3.0), Fault(0.1, "daemon_restart", 2.0)]
        injector = Injector(faults, FakeExecutor([]), None, daemon, seed=1, give_up_s=600)
        injector.stores, injector.pools = FakeStores(), chaos
        injector.run(time.monotonic())
        deadline = time.monotonic() + 20
        while not restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # two more looks at the queue: no lease yet
        assert restarts == [2.0] and injector.stores.done == []
        with open_lease_queue(url) as queue:
            queue.lease(POOL_KEY, worker_id="w1", ttl_s=600)
        while not injector.stores.done and time.monotonic() < deadline:
            time.sleep(0.05)
        injector.stop()
    assert injector.stores.done == ["postgres_restart"]
    [restart] = [i for i in injector.done if i.fault.kind == "postgres_restart"]
    assert restart.note == "postgres_restart 3.0 s, under 1 live pool lease(s): pool-000"


def test_a_store_restart_does_not_wait_for_a_sqlite_queue(tmp_path, s3):
    chaos = PoolChaos(PoolsSetup(str(tmp_path / "q.db"), [], []), s3, BUCKET, "c")
    assert not chaos.queue_on_store
    injector = Injector([Fault(0.0, "postgres_restart", seconds=3.0)], None, None, None, seed=1)
    injector.stores, injector.pools = FakeStores(), chaos
    injector.run(time.monotonic()).join(10)
    assert [i.note for i in injector.done] == ["postgres_restart 3.0 s"]


def test_pool_facts_count_leases_and_the_items_leased_again(pools):
    with open_lease_queue(pools.queue) as queue:
        queue.lease(POOL_KEY, worker_id="w4", ttl_s=600)  # pool-002 again, after w3's lapsed
    facts = pool_faults.pool_facts(pools, since=0.0)
    assert facts["pool jobs / items / leases"] == "1 / 4 / 4"
    assert facts["pool items leased again (leases expired)"] == "1 (1)"


def test_an_s3_window_spends_one_retry_of_the_run_at_work():
    """Seeds 1 and 2 of pool mode: a run met an S3 window that failed an attempt, then two
    pod faults, three failures against two retries: its partitions were lost. A window now
    counts against the runs at work, like a failing pod fault."""
    pod = FakePod("run-pod", {"dagster/run-id": "r1"}, process=SimpleNamespace(pid=GONE_PID))
    pod.log = "engine ready in 30.0s"
    executor = FakeExecutor([pod])
    preempted: list[str] = []
    executor.preempt = preempted.append
    windows: list[str] = []
    proxy = SimpleNamespace(open_window=lambda kind, seconds, rate: windows.append(kind))
    faults = [Fault(0.0, "s3_5xx", 10, 0.3), Fault(0.1, "pod_delete"), Fault(0.2, "pod_delete")]
    injector = Injector(faults, executor, proxy, None, seed=1, give_up_s=2)
    injector.run(time.monotonic()).join(30)
    assert windows == ["s3_5xx"]
    assert preempted == ["run-pod"]  # the run's second retry went to the window
    assert [f.kind for f in injector.skipped] == ["pod_delete"]
