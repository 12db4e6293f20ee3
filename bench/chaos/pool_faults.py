"""The chaos run's pool mode (`--mode pools`, `make chaos SEED=n MODE=pools`): beside the
reference `doc_embeddings` backfill, partitions of two more pipelines in the same backfill,
and two more fault kinds that hit them.

- `pool_embeddings`: the same embeddings on an engine pool (`launch="pool"`, 2 workers);
  the run's partitions are one job whose big partitions are leased as chunk ranges. The
  lease queue lives where production keeps it, in PostgreSQL: a database of the harness's
  server, so `postgres_restart` stops the queue under the pool's workers and its step
  (`--pool-queue sqlite`: a SQLite file on the pool pods' read-write volume instead, as
  tests/test_k8s_pool_e2e.py).
  Fault `pool_worker_kill`: SIGKILL to the main process of a pool worker pod that holds a
  lease, preferably on a partition with committed chunks and rows left (else any lease
  holder, `MID_PARTITION_WAIT_S` after the first was seen: a worker leases before its
  engine is built); the lease must lapse, another worker (or a new one the
  step's reconciler starts) take it, and the partition commit once.
- `group_generate`: generation on the tiny Llama with tensor parallel 2 across two pods
  (`nodes=2`: a leader worker pod and a follower pod, as tests/test_k8s_multinode_e2e.py).
  Fault `follower_kill`: SIGKILL to the follower pod's whole process group once the leader
  has committed a chunk of the group's partitions; the group must fail (the retryable
  "follower pod" error), the step's retry build a new group and commit every row once.

A 2-node group is two engines beside the pool's two: run the mode with both engine slots.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from psycopg2 import OperationalError

POOL_ASSET = "pool_embeddings"
GROUP_ASSET = "group_generate"
QUEUE_CLAIM = "gpuinfer-lease-queue"  # the pool pods' PVC (a host folder on the executor)
QUEUE_SECRET = "gpuinfer-lease-queue"
QUEUE_FILE = "pools.db"
POD_UID = 1000  # the production pods' runAsUser: the queue and models must be theirs to read
GROUP_MODEL = "tiny-llama"
MID_PARTITION_WAIT_S = 45.0  # then any lease holder will do
RANGE_MARK = "#chunks="  # launchers/pool.py: a chunk range's item key
QUEUE_DOWN = (OperationalError,)  # what reading the PostgreSQL queue raises while it is down


@dataclass
class PoolsSetup:
    """What pool mode adds to the code location (bench/chaos/defs.py) and the resource."""

    queue: str  # the lease queue: a postgresql:// URL, or the SQLite file on the PVC's folder
    pool_keys: list[str]
    group_keys: list[str]
    group_model: str = f"/models/{GROUP_MODEL}"
    max_workers: int = 2
    idle_ttl_s: float = 10.0
    lease_ttl_s: float = 15.0
    max_tokens: int = 32

    @property
    def on_postgres(self) -> bool:
        return self.queue.startswith("postgresql://")

    def targets(self) -> dict[str, list[str]]:
        """The extra assets of the backfill and their partitions."""
        return {POOL_ASSET: self.pool_keys, GROUP_ASSET: self.group_keys}


def split_keys(partitions: int, pool: int, group: int) -> dict[str, list[str]]:
    """`partitions` in all: the reference pipeline's, then `pool` and `group` partitions."""
    docs = partitions - pool - group
    if docs < 1 or pool < 1 or group < 1:
        raise ValueError(
            f"--partitions {partitions} leaves {docs} for doc_embeddings after --pool-partitions "
            f"{pool} and --group-partitions {group}: each needs at least 1; raise --partitions"
        )
    return {
        "doc_embeddings": [f"docs-{i:03d}" for i in range(docs)],
        POOL_ASSET: [f"pool-{i:03d}" for i in range(pool)],
        GROUP_ASSET: [f"group-{i:03d}" for i in range(group)],
    }


def prepare(
    executor: Any,
    workdir: Path,
    minilm: str,
    keys: dict[str, list[str]],
    queue_url: str | None = None,
) -> PoolsSetup:
    """A model cache holding MiniLM and the tiny Llama, readable by the pods' user; the
    lease queue, at `queue_url` (a PostgreSQL database) or else in a SQLite file on a PVC's
    folder that user may write; the queue's Secret (and PVC) on the executor.

    Returns the setup; the model cache is `workdir/models` (MiniLM at `models/model`)."""
    from assets.models import make_tiny_llama
    from dagster_gpuinfer.pools import open_lease_queue

    models = workdir / "models"
    if not (models / "model").exists():
        shutil.copytree(minilm, models / "model")
    make_tiny_llama(models / GROUP_MODEL)
    for path in [workdir, *workdir.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    queue = queue_url or _sqlite_queue(executor, workdir / "queue-pvc")
    with open_lease_queue(queue):
        pass  # its tables, made once, before the pods open it
    if queue_url:
        executor.secrets[QUEUE_SECRET] = {"url": queue_url}
    else:
        _pods_may_write(Path(queue).parent)
    return PoolsSetup(queue, keys[POOL_ASSET], keys[GROUP_ASSET])


def _sqlite_queue(executor: Any, folder: Path) -> str:
    """The SQLite queue's file in `folder`, the PVC `QUEUE_CLAIM` on the executor; the
    Secret names it where the pods mount the PVC."""
    from dagster_gpuinfer.k8s.config import QUEUE_MOUNT

    folder.mkdir(parents=True, exist_ok=True)
    executor.secrets[QUEUE_SECRET] = {"url": f"{QUEUE_MOUNT}/{QUEUE_FILE}"}
    executor.claims[QUEUE_CLAIM] = str(folder)
    return str(folder / QUEUE_FILE)


def _pods_may_write(folder: Path) -> None:
    for path in [folder, *folder.iterdir()]:
        os.chown(path, POD_UID, POD_UID)
        path.chmod(0o775 if path.is_dir() else 0o664)


def pipelines(setup: Any, retry_policy: Any) -> list[Any]:
    """The pool and group pipelines of the code location (`setup`: the chaos `Setup`)."""
    import dagster as dg

    from dagster_gpuinfer import EngineArgs, InputSpec, inference_assets

    pools: PoolsSetup = setup.pools

    def pipeline(name: str, keys: list[str], **specific: Any) -> Any:
        """One asset over `keys` of the chaos shards, one run for all its partitions."""
        return inference_assets(
            name=name,
            input=InputSpec(
                uri=f"{setup.input_root}/docs/{{partition_key}}.parquet", id_column="doc_id"
            ),
            output_root=setup.output_root,
            partitions_def=dg.StaticPartitionsDefinition(keys),
            chunk_size=setup.chunk_size,
            backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=len(keys)),
            retry_policy=retry_policy,
            **specific,
        )

    pool = pipeline(
        POOL_ASSET,
        pools.pool_keys,
        model=setup.model,
        task="embed",
        input_asset_key="pool_shards",
        engine=EngineArgs(dtype="float32"),
        launch="pool",
        group_name="pools",
    )
    group = pipeline(
        GROUP_ASSET,
        pools.group_keys,
        model=pools.group_model,
        task="generate",
        input_asset_key="group_prompts",
        # one chunk's rows in the engine at a time: chunks commit one after another, and
        # the follower is lost with chunks left (as tests/test_k8s_multinode_e2e.py)
        engine=EngineArgs(dtype="float32", max_num_seqs=setup.chunk_size),
        sampling={"max_tokens": pools.max_tokens},
        tensor_parallel_size=2,
        nodes=2,
        group_name="groups",
    )
    return [pool, group]


def resource_fields(config: Any, pools: PoolsSetup) -> tuple[Any, dict[str, Any]]:
    """The k8s config with the pool pods' queue volume, and the resource's pool and group
    settings (each rank of a group bound to its own core, as the multi-node tests do)."""
    from dagster_gpuinfer.k8s.config import PoolPods
    from dagster_gpuinfer.k8s.group import GroupConfig
    from dagster_gpuinfer.resource import PoolSettings

    pods = PoolPods() if pools.on_postgres else PoolPods(queue_pvc=QUEUE_CLAIM)
    config = config.model_copy(update={"pools": pods})
    return config, {
        "pool": PoolSettings(
            queue=pools.queue,
            max_workers=pools.max_workers,
            idle_ttl_s=pools.idle_ttl_s,
            lease_ttl_s=pools.lease_ttl_s,
        ),
        "k8s_group": GroupConfig(
            node_env=[{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}],
            follower_probe_interval=2.0,
        ),
    }


def pod_role(pod: Any) -> str:
    """`pool`, `leader`, `follower` or `run` (a per-run worker pod). By the exact label
    keys: every worker pod also carries `gpuinfer.dagster.io/pool` (its Dagster pool)."""
    from dagster_gpuinfer.k8s.group import ROLE_LABEL
    from dagster_gpuinfer.k8s.pool_pod import POOL_LABEL

    labels = pod.manifest["metadata"].get("labels", {})
    if POOL_LABEL in labels:
        return "pool"
    return labels.get(ROLE_LABEL, "run")


def pool_worker_id(pod: Any) -> str | None:
    annotations = pod.manifest["metadata"].get("annotations", {})
    return next((v for k, v in annotations.items() if k.endswith("/worker-id")), None)


def partition_of(item_key: str) -> str:
    return item_key.partition(RANGE_MARK)[0]


@dataclass
class PoolChaos:
    """Targets and hits for the pool kinds (the `Injector`'s `pools`): reads the lease queue
    and S3 (straight from moto, not through the proxy)."""

    pools: PoolsSetup
    client: Any
    bucket: str
    prefix: str
    clock: Any = time.monotonic
    _waiting_since: dict[str, float] = field(default_factory=dict)

    def targets(self, kind: str, pods: list[Any]) -> list[Any]:
        """The live pods `kind` may hit now: pool pods holding a lease (on a partition
        with committed chunks and rows left, else after `MID_PARTITION_WAIT_S` any), or
        followers whose group has committed a chunk."""
        if kind == "follower_kill":
            followers = [p for p in pods if pod_role(p) == "follower"]
            return followers if followers and self.chunks_committed(GROUP_ASSET) else []
        holders = self.lease_holders()
        pool_pods = [p for p in pods if pod_role(p) == "pool" and pool_worker_id(p) in holders]
        if not pool_pods:
            return []  # the wait for a mid-partition holder starts with the first holder
        since = self._waiting_since.setdefault(kind, self.clock())
        mid = [p for p in pool_pods if self.mid_partition(holders[pool_worker_id(p)])]
        if mid or self.clock() - since < MID_PARTITION_WAIT_S:
            return mid
        return pool_pods

    def hit(self, pod: Any, kind: str) -> str | None:
        """Do it; None when the pod went away first."""
        if kind == "follower_kill":
            if os.getpgid(pod.process.pid) != pod.process.pid:
                return None  # not a container's process group leader (gone, pid reused)
            os.killpg(pod.process.pid, signal.SIGKILL)
            return f"SIGKILL follower process group {pod.process.pid}"
        holders = self.lease_holders()
        items = holders.get(pool_worker_id(pod) or "")
        worker = _worker_process(pod)
        if not items or worker is None:
            return None
        worker.send_signal(signal.SIGKILL)
        self._waiting_since.pop(kind, None)
        return f"SIGKILL pool worker pid {worker.pid} holding {', '.join(sorted(items))}"

    def lease_holders(self) -> dict[str, list[str]]:
        """Worker id -> the item keys it holds under a live lease, over every pool job;
        none while the queue's server is down (a `postgres_restart`): ask again later."""
        try:
            return lease_holders(self.pools.queue)
        except QUEUE_DOWN:
            return {}

    @property
    def queue_on_store(self) -> bool:
        """Whether the lease queue is on the harness's PostgreSQL server (`postgres_restart`
        then waits for live leases: `live_leases`)."""
        return self.pools.on_postgres

    def live_leases(self) -> str | None:
        """The pool's live leases, named for a fault's note; None while there are none."""
        held = sorted(item for items in self.lease_holders().values() for item in items)
        if not held:
            return None
        return f"{len(held)} live pool lease(s): {', '.join(held)}"

    def mid_partition(self, items: list[str]) -> bool:
        """Whether one of `items` is on a partition with committed chunks and no manifest."""
        for key in {partition_of(i) for i in items}:
            folder = f"{self.prefix}/{POOL_ASSET}/{key}/"
            if self._listed(folder + "_SUCCESS"):
                continue
            if self._listed(folder + "_chunks/"):
                return True
        return False

    def chunks_committed(self, asset: str) -> bool:
        """Whether a partition of `asset` has a committed chunk (its marker under
        `_chunks/`): its engine is built and at work."""
        return any(
            key.endswith(".json") and "/_chunks/" in key
            for key in self._keys(f"{self.prefix}/{asset}/")
        )

    def _listed(self, prefix: str) -> bool:
        return bool(self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("KeyCount"))

    def _keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _read(queue: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """A read-only query of the lease queue, PostgreSQL or SQLite (`sql` with `?` markers;
    the harness watches the queue: its API reads one job at a time and cannot list a pool's
    jobs).

    Raises:
        QUEUE_DOWN: the queue's PostgreSQL server does not answer."""
    if queue.startswith("postgresql://"):
        import psycopg2

        with contextlib.closing(psycopg2.connect(queue, connect_timeout=10)) as db:
            db.set_session(readonly=True, autocommit=True)
            with db.cursor() as cursor:
                cursor.execute(sql.replace("?", "%s"), args)
                return cursor.fetchall()
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{queue}?mode=ro", uri=True, timeout=30)) as db:
        return db.execute(sql, args).fetchall()


def lease_holders(queue: str, now: float | None = None) -> dict[str, list[str]]:
    """Worker id -> the item keys it holds under a live (unexpired) lease."""
    from dagster_gpuinfer.pools.sql_queue import ITEMS

    rows = _read(
        queue,
        f"SELECT worker_id, item_key FROM {ITEMS} WHERE state = 'leased' AND expires_at > ?",
        time.time() if now is None else now,
    )
    held: dict[str, list[str]] = {}
    for worker_id, key in rows:
        held.setdefault(worker_id, []).append(key)
    return held


def _worker_process(pod: Any) -> psutil.Process | None:
    from bench.chaos.faults import _worker_process as worker_of

    return worker_of(pod)


def pool_facts(pools: PoolsSetup, since: float) -> dict[str, str]:
    """The pool's side of a phase for the summary: its jobs (submitted after `since`, a
    wall-clock time), their items and leases, items leased more than once, expired leases."""
    from dagster_gpuinfer.pools.sql_queue import ITEMS, JOBS

    [(jobs, items, leases, again, expired)] = _read(
        pools.queue,
        f"SELECT COUNT(DISTINCT j.job_id), COUNT(i.item_id), COALESCE(SUM(i.leases), 0), "
        f"COALESCE(SUM(CASE WHEN i.leases > 1 THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(i.expirations), 0) "
        f"FROM {JOBS} j JOIN {ITEMS} i ON i.job_id = j.job_id WHERE j.submitted_at >= ?",
        since,
    )
    return {
        "pool jobs / items / leases": f"{jobs} / {items} / {int(leases)}",
        "pool items leased again (leases expired)": f"{int(again)} ({int(expired)})",
    }
