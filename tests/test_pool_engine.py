"""Engine pools end to end: real Dagster runs, real pool workers, one real vLLM engine.

Two assets on the same model share one pool: the first run's partition starts a pool worker
(a detached `python -m dagster_gpuinfer.worker --pool ...`) that builds the engine; the
second asset (per-run launch, its run asking for the pool in its config) finds it warm.
Both partitions are committed and materialized, the model loads once, and the metadata
says which partition found the engine warm.
"""

from __future__ import annotations

import os
import signal
import time

import dagster as dg
import pytest
from support import (
    cpu_resource,
    materialize_partitions,
    model_loads,
    partition_metadata,
    write_parquet,
)

from dagster_gpuinfer import InputSpec, inference_assets
from dagster_gpuinfer.pools import open_lease_queue

pytestmark = pytest.mark.engine


def pipeline(tmp_path, model: str, name: str, launch: str = "pool"):
    return inference_assets(
        name=name,
        model=model,
        task="embed",
        input=InputSpec(uri=str(tmp_path / "in" / name / "{partition_key}.parquet")),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["s0"]),
        launch=launch,
        chunk_size=8,
    )


def live_workers(queue_path: str) -> list:
    with open_lease_queue(queue_path) as queue:
        return [w for key in _pool_keys(queue_path) for w in queue.pool_workers(key)]


def stop_pool_workers(queue_path: str) -> None:
    """Kill what the test's pools still run (their idle TTL would, later): each worker
    runs in its own session, its engine's processes in its group."""
    for worker in live_workers(queue_path):
        kill(worker.info.get("pid"))


def kill(pid: int | None) -> None:
    if not pid:
        return
    try:
        os.killpg(int(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def test_two_assets_share_one_pool_and_one_engine_build(tmp_path, instance, minilm_dir):
    queue_path = str(tmp_path / "pools.db")
    load_log = tmp_path / "loads.log"
    resource = cpu_resource(
        load_log, pool={"queue": queue_path, "max_workers": 1, "idle_ttl_s": 120}
    )
    first = pipeline(tmp_path, minilm_dir, "emb_a")
    second = pipeline(tmp_path, minilm_dir, "emb_b", launch="run")  # the run asks for the pool
    for name in ("emb_a", "emb_b"):
        write_parquet(
            tmp_path / "in" / name / "s0.parquet",
            {"id": [f"{name}-{i}" for i in range(20)], "text": [f"doc {i}" for i in range(20)]},
        )
    started = time.monotonic()
    try:
        one = materialize_partitions(first, ["s0"], resource=resource, instance=instance)
        two = materialize_partitions(
            second,
            ["s0"],
            resource=resource,
            instance=instance,
            run_config={"ops": {"emb_b": {"config": {"launch": "pool"}}}},
        )
        live = live_workers(queue_path)
    finally:
        stop_pool_workers(queue_path)
    assert one.success and two.success
    assert model_loads(load_log) == 1, "the second asset's run must find the engine warm"
    a = partition_metadata(instance, first.output_asset.key, "s0")
    b = partition_metadata(instance, second.output_asset.key, "s0")
    assert (a["rows_out"], b["rows_out"]) == (20, 20)
    assert (a["pool_warm_engine"], b["pool_warm_engine"]) == (False, True)
    assert a["pool_leases"] == b["pool_leases"] == 1
    assert 0 <= b["pool_queue_wait_s"] < a["pool_queue_wait_s"] + 1
    assert a["pool_worker"] == b["pool_worker"]
    assert (a["run_model_loads"], b["run_model_loads"]) == (1, 0)
    assert len({w.worker_id for w in live}) <= 1
    assert time.monotonic() - started < 600


def _pool_keys(queue_path: str) -> list[str]:
    import sqlite3

    from dagster_gpuinfer.pools.sql_queue import WORKERS

    with sqlite3.connect(queue_path) as db:
        return [row[0] for row in db.execute(f"SELECT DISTINCT pool_key FROM {WORKERS}")]


def first_progress(queue_path: str, timeout: float = 300.0) -> tuple[str, dict]:
    """The first worker that says it committed a chunk, and its report's info."""
    import json
    import sqlite3

    from dagster_gpuinfer.pools.sql_queue import EVENTS, WORKERS

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(queue_path):
            with sqlite3.connect(queue_path) as db:
                for worker_id, payload in db.execute(
                    f"SELECT worker_id, payload FROM {EVENTS} WHERE kind = 'progress'"
                ):
                    if json.loads(payload).get("chunks_committed", 0) >= 1:
                        (info,) = db.execute(
                            f"SELECT info FROM {WORKERS} WHERE worker_id = ?", (worker_id,)
                        ).fetchone()
                        return worker_id, json.loads(info)
        time.sleep(0.1)
    raise AssertionError("no pool worker committed a chunk")


@pytest.mark.slow
def test_a_worker_killed_mid_partition_is_replaced_and_the_partition_finishes(
    tmp_path, instance, minilm_dir
):
    """SIGKILL the pool worker after its first committed chunk: its lease and report lapse
    (lease TTL 6 s), the waiting step's reconcile starts another worker, which redoes only
    the uncommitted chunks; the partition is committed once, on its second lease."""
    import threading

    queue_path = str(tmp_path / "pools.db")
    resource = cpu_resource(
        pool={"queue": queue_path, "max_workers": 1, "idle_ttl_s": 60, "lease_ttl_s": 6}
    )
    emb = pipeline(tmp_path, minilm_dir, "emb_k")
    rows = 3000
    write_parquet(
        tmp_path / "in" / "emb_k" / "s0.parquet",
        {"id": [f"r{i}" for i in range(rows)], "text": [f"doc {i} " * 8 for i in range(rows)]},
    )
    killed: list[str] = []

    def killer() -> None:
        worker_id, info = first_progress(queue_path)
        kill(info.get("pid"))
        killed.append(worker_id)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        result = materialize_partitions(emb, ["s0"], resource=resource, instance=instance)
    finally:
        thread.join(timeout=5)
        stop_pool_workers(queue_path)
    assert result.success and killed
    meta = partition_metadata(instance, emb.output_asset.key, "s0")
    assert meta["rows_out"] == rows and meta["rows_resumed"] > 0
    assert meta["pool_leases"] == 2 and meta["pool_worker"] != killed[0]
    assert meta["pool_warm_engine"] is False  # the new worker built its own
