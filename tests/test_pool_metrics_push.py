"""The pool reconciler sensor pushes the pools' numbers to a real Pushgateway, which a real
Prometheus scrapes (servers from `deploy/local/test-prometheus.sh`, as `make test` starts
them): queue depth per pool and priority lands in Prometheus, a pool whose work is done is
still pushed (at zero) on the next tick, then drops out of the group."""

from __future__ import annotations

import json
import time

import dagster as dg
from test_observability_e2e import query, query_until, server_url

from dagster_gpuinfer import GpuInferenceResource
from dagster_gpuinfer.launchers.pool import pool_reconciler_sensor
from dagster_gpuinfer.pools import JobSubmission, SqliteLeaseQueue, WorkItem
from dagster_gpuinfer.resource import PoolSettings

POOL = "pushed-0123456789ab"


def tick(resource: GpuInferenceResource, cursor: str | None) -> str | None:
    sensor = pool_reconciler_sensor()
    context = dg.build_sensor_context(resources={"gpu": resource}, cursor=cursor)
    sensor(context)
    return context.cursor


def test_the_reconciler_sensor_pushes_pool_depth_to_prometheus_and_forgets_done_pools(tmp_path):
    prometheus = server_url("GPUINFER_TEST_PROMETHEUS_URL")
    pushgateway = server_url("GPUINFER_TEST_PUSHGATEWAY_URL")
    location = str(tmp_path / "pools.db")
    # max_workers=0: the sensor starts no worker, so the backlog stays as submitted.
    resource = GpuInferenceResource(
        pushgateway_url=pushgateway, pool=PoolSettings(queue=location, max_workers=0)
    )
    with SqliteLeaseQueue(location) as queue:
        items = [WorkItem(f"p{i}") for i in range(3)]
        queue.submit(JobSubmission("low", POOL, items, priority=0))
        queue.submit(JobSubmission("high", POOL, [WorkItem("x")], priority=5))
        cursor = tick(resource, None)
        assert json.loads(cursor) == [POOL]
        series = f'gpuinfer_pool_queued_items{{job="gpuinfer_pools",pool="{POOL}"'
        assert query_until(prometheus, series + ',priority="0"}', expect=3.0)
        assert query_until(prometheus, series + ',priority="5"}', expect=1.0)
        while (lease := queue.lease(POOL, worker_id="w", ttl_s=30)) is not None:
            queue.complete(lease)
    cursor = tick(resource, cursor)  # done: pushed once more at zero, then forgotten
    assert json.loads(cursor) == []
    assert query_until(prometheus, series + ',priority="0"}', expect=0.0)
    assert tick(resource, cursor) == "[]"
    for _ in range(60):
        if not query(prometheus, f'gpuinfer_pool_leased_items{{pool="{POOL}"}}'):
            break
        time.sleep(1)
    assert query(prometheus, f'gpuinfer_pool_leased_items{{pool="{POOL}"}}') == []
