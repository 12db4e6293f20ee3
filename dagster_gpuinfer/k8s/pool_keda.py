"""`build_pool_scaled_job`: a KEDA `ScaledJob` that sizes one engine pool, as a pure function.

The kit's alternative to the reconciler for clusters that run KEDA
(deploy/pools/keda-scaledjob.yaml is this function's output for the Helm values): KEDA polls
the pool's backlog in the lease queue's PostgreSQL database (`pools.backlog.backlog_query`:
queued + leased items of the pool's active jobs) and starts Jobs whose pod is the pool pod
`build_pool_pod` makes (`pool_pod_template`), so the two ways of running a pool start the
same worker. With the `default` scaling strategy KEDA starts
`min(ceil(backlog / target), maxReplicaCount) - running` Jobs per poll, and none while the
backlog is 0; each worker exits 0 after its idle TTL, so an idle pool goes back to zero.

- The scaler reads the queue's URL from the worker container's `GPUINFER_LEASE_QUEUE`
  (`connectionFromEnv`), which comes from the same Secret the pods read: one Secret, no
  TriggerAuthentication to keep in step.
- Each Job runs one pod, once (`backoffLimit: 0`): a failed worker's leases expire and the
  next poll starts another worker if the backlog still needs one.
- Kueue admits the Jobs (its `batch/job` integration) by the queue-name label, which KEDA
  copies from the ScaledJob's labels to each Job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster_gpuinfer.k8s.config import KUEUE_QUEUE_LABEL, K8sLauncherConfig
from dagster_gpuinfer.k8s.names import dns_label
from dagster_gpuinfer.k8s.pool_pod import (
    POOL_COMPONENT,
    POOL_LABEL,
    pool_pod_template,
)
from dagster_gpuinfer.pools import DEFAULT_IDLE_TTL_S, DEFAULT_LEASE_TTL_S, QUEUE_ENV
from dagster_gpuinfer.pools.backlog import backlog_query

KEDA_API_VERSION = "keda.sh/v1alpha1"


def build_pool_scaled_job(
    pool_key: str,
    config: K8sLauncherConfig,
    *,
    max_workers: int = 1,
    items_per_worker: int = 1,
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    gpus: int = 1,
    polling_interval_s: int = 15,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The `ScaledJob` that runs `pool_key`'s workers from its backlog.

    Args:
        pool_key: The pool (`pools.pool_key(spec)`).
        config: The launcher configuration of the worker pods.
        max_workers: At most this many workers at once (`maxReplicaCount`).
        items_per_worker: Backlog items per worker (`targetQueryValue`): 1 starts a worker
            per waiting item up to `max_workers`; more saves engine builds on small work.
        idle_ttl_s: Seconds without a lease after which a worker exits 0.
        lease_ttl_s: The TTL of a worker's leases.
        gpus: GPUs of one engine of the pool.
        polling_interval_s: Seconds between KEDA's backlog queries.
        extra_env: Plain environment of the worker.

    Returns:
        A `keda.sh/v1alpha1` `ScaledJob` manifest as a dict.

    Raises:
        PodSpecError: the configuration cannot make a valid pool pod.
        ValueError: a count or interval is below 1.
    """
    for name, value in (
        ("max_workers", max_workers),
        ("items_per_worker", items_per_worker),
        ("polling_interval_s", polling_interval_s),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    template = pool_pod_template(
        pool_key,
        config,
        idle_ttl_s=idle_ttl_s,
        lease_ttl_s=lease_ttl_s,
        gpus=gpus,
        extra_env=extra_env,
    )
    labels = {
        "app.kubernetes.io/name": "dagster-gpuinfer",
        "app.kubernetes.io/component": POOL_COMPONENT,
        POOL_LABEL: pool_key,
    }
    if config.placement.kueue_queue:
        labels[KUEUE_QUEUE_LABEL] = config.placement.kueue_queue
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledJob",
        "metadata": {
            "name": f"gpuinfer-pool-{dns_label(pool_key, 49)}",
            "namespace": config.namespace,
            "labels": labels,
        },
        "spec": {
            "jobTargetRef": {
                "parallelism": 1,
                "completions": 1,
                "backoffLimit": 0,
                "template": template,
            },
            "pollingInterval": polling_interval_s,
            "maxReplicaCount": max_workers,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 5,
            "scalingStrategy": {"strategy": "default"},
            "triggers": [
                {
                    "type": "postgresql",
                    "name": "backlog",
                    "metadata": {
                        "query": backlog_query(pool_key),
                        "targetQueryValue": str(items_per_worker),
                        "activationTargetQueryValue": "0",
                        "connectionFromEnv": QUEUE_ENV,
                    },
                }
            ],
        },
    }
