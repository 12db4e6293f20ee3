"""Prometheus metrics of engine pools, read from the lease queue.

What a pool looks like from the queue (`LeaseQueue.pool_stats`, `LeaseQueue.pool_workers`),
labelled by `pool` (the pool key):

| metric | labels | what |
|---|---|---|
| `gpuinfer_pool_workers` | pool, state | live workers by state (starting ... draining) |
| `gpuinfer_pool_queued_items` | pool, priority | items waiting for a lease (lapsed ones too) |
| `gpuinfer_pool_leased_items` | pool | work items under a live lease |
| `gpuinfer_pool_oldest_lease_age_seconds` | pool | age of the oldest live lease (0 when none) |
| `gpuinfer_pool_expired_leases` | pool | leases that lapsed, over the pool's stored jobs |
| `gpuinfer_pool_failed_items` | pool | items out of attempts, over the pool's stored jobs |
| `gpuinfer_pool_warm_hits` | pool | leases the live workers served on an engine already built |
| `gpuinfer_pool_cold_starts` | pool | engine builds of the live workers |

Warm hits and cold starts per partition, exactly, come with each run that used a pool: the
launcher pushes `gpuinfer_launcher_pool_partitions{engine="warm"|"cold"}`
(`run_metrics.py`). The gauges here are the live workers' own counts: what the pool's warm
engines are doing now.

The pool reconciler sensor pushes them to the Pushgateway on every tick (one group, job
`gpuinfer_pools`, replaced whole each time: a pool that is gone leaves no stale series); the
sensor passes the pools it saw before, so a pool whose work is done but whose idle workers
still hold GPUs is still shown until they leave. Never imports dagster, torch or vllm;
`prometheus_client` is imported when something is collected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from dagster_gpuinfer.pools.lease_queue import WORKER_STATES, LeaseQueue

log = logging.getLogger("dagster_gpuinfer")

PUSH_JOB = "gpuinfer_pools"
# Every metric of the pools' collector (the dashboard and rule tests check queries with it).
POOL_METRICS = (
    "gpuinfer_pool_workers",
    "gpuinfer_pool_queued_items",
    "gpuinfer_pool_leased_items",
    "gpuinfer_pool_oldest_lease_age_seconds",
    "gpuinfer_pool_expired_leases",
    "gpuinfer_pool_failed_items",
    "gpuinfer_pool_warm_hits",
    "gpuinfer_pool_cold_starts",
)
_HELP = {
    "gpuinfer_pool_workers": "Live pool workers, by state.",
    "gpuinfer_pool_queued_items": "Work items waiting for a lease, by job priority.",
    "gpuinfer_pool_leased_items": "Work items under a live lease.",
    "gpuinfer_pool_oldest_lease_age_seconds": "Age of the oldest live lease (0: none).",
    "gpuinfer_pool_expired_leases": "Leases that lapsed (a worker lost), over stored jobs.",
    "gpuinfer_pool_failed_items": "Work items out of attempts, over stored jobs.",
    "gpuinfer_pool_warm_hits": "Leases the live workers served on an engine already built.",
    "gpuinfer_pool_cold_starts": "Engine builds of the live workers.",
}


class PoolMetricsCollector:
    """A `prometheus_client` collector reading every pool's numbers from `queue` per scrape.

    Args:
        queue: The lease queue.
        pools: Pools to report besides those with unfinished jobs (`queue.pools()`), e.g.
            pools whose idle workers are still up.
    """

    def __init__(self, queue: LeaseQueue, pools: Iterable[str] = ()) -> None:
        self.queue = queue
        self.extra_pools = set(pools)
        self.seen: set[str] = set()  # pools with backlog or live workers at the last collect

    def describe(self) -> list[Any]:
        return []  # collected on demand: the registry must not collect at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families = {
            name: GaugeMetricFamily(name, _HELP[name], labels=_labels(name))
            for name in POOL_METRICS
        }
        self.seen = set()
        for pool in sorted(set(self.queue.pools()) | self.extra_pools):
            if self._add_pool(pool, families):
                self.seen.add(pool)
        yield from families.values()

    def _add_pool(self, pool: str, families: dict[str, Any]) -> bool:
        """Add one pool's samples; True when it has backlog or live workers."""
        stats = self.queue.pool_stats(pool)
        workers = self.queue.pool_workers(pool)
        states = dict.fromkeys(WORKER_STATES, 0)
        for worker in workers:
            states[worker.state] = states.get(worker.state, 0) + 1
        for state, count in states.items():
            families["gpuinfer_pool_workers"].add_metric([pool, state], count)
        for priority, count in (stats.queued_by_priority or {0: 0}).items():
            families["gpuinfer_pool_queued_items"].add_metric([pool, str(priority)], count)
        single = {
            "gpuinfer_pool_leased_items": stats.leased,
            "gpuinfer_pool_oldest_lease_age_seconds": stats.oldest_lease_age_s or 0.0,
            "gpuinfer_pool_expired_leases": stats.expired_leases,
            "gpuinfer_pool_failed_items": stats.failed,
            "gpuinfer_pool_warm_hits": _info_sum(workers, "warm_hits"),
            "gpuinfer_pool_cold_starts": _info_sum(workers, "cold_starts"),
        }
        for name, value in single.items():
            families[name].add_metric([pool], value)
        return stats.backlog > 0 or bool(workers)


def _labels(name: str) -> list[str]:
    if name == "gpuinfer_pool_workers":
        return ["pool", "state"]
    if name == "gpuinfer_pool_queued_items":
        return ["pool", "priority"]
    return ["pool"]


def _info_sum(workers: Iterable[Any], key: str) -> float:
    total = 0.0
    for worker in workers:
        value = worker.info.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            total += value
    return total


def pool_registry(queue: LeaseQueue, pools: Iterable[str] = ()) -> tuple[Any, PoolMetricsCollector]:
    """A fresh registry holding a `PoolMetricsCollector` of `queue`, and the collector."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    collector = PoolMetricsCollector(queue, pools)
    registry.register(collector)
    return registry, collector


def push_pool_metrics(
    pushgateway_url: str | None, queue: LeaseQueue, pools: Iterable[str] = ()
) -> list[str]:
    """Push every pool's numbers to the Pushgateway (when one is configured), replacing the
    last push; a Pushgateway that cannot be reached is logged, never raised.

    Returns:
        The pools that had backlog or live workers: pass them as `pools` next time, so a
        pool is reported until its last worker has left.
    """
    if not pushgateway_url:
        return []
    from prometheus_client import push_to_gateway

    registry, collector = pool_registry(queue, pools)
    try:
        push_to_gateway(pushgateway_url, job=PUSH_JOB, registry=registry, timeout=10)
    except Exception as exc:  # noqa: BLE001 - metrics never fail a tick
        log.warning("cannot push pool metrics to %s: %s", pushgateway_url, exc)
        return sorted(set(pools))
    return sorted(collector.seen)
