"""Engine pools end to end: real Dagster runs, real pool workers, one real vLLM engine.

Two assets on the same model share one pool: the first run's partition starts a pool worker
(a detached `python -m dagster_gpuinfer.worker --pool ...`) that builds the engine; the
second asset's run finds it warm. Both partitions are committed and materialized, the model
loads once, and the metadata says which partition found the engine warm.
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


def pipeline(tmp_path, model: str, name: str):
    return inference_assets(
        name=name,
        model=model,
        task="embed",
        input=InputSpec(uri=str(tmp_path / "in" / name / "{partition_key}.parquet")),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["s0"]),
        launch="pool",
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
    first, second = (pipeline(tmp_path, minilm_dir, name) for name in ("emb_a", "emb_b"))
    for name in ("emb_a", "emb_b"):
        write_parquet(
            tmp_path / "in" / name / "s0.parquet",
            {"id": [f"{name}-{i}" for i in range(20)], "text": [f"doc {i}" for i in range(20)]},
        )
    started = time.monotonic()
    try:
        one = materialize_partitions(first, ["s0"], resource=resource, instance=instance)
        two = materialize_partitions(second, ["s0"], resource=resource, instance=instance)
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
