"""`build_pool_pod`: the Kubernetes pod of one engine pool worker, as a pure function.

A pool worker is the same worker in its long-lived mode (`python -m dagster_gpuinfer.worker
--pool KEY`): it builds its engine once, leases work items of its pool from the lease queue,
and exits 0 after `--idle-ttl` seconds without a lease. Its pod is a worker pod
(`k8s.pod`: image, GPUs, /dev/shm, the read-only model cache, non-root hardening, Secrets by
reference, Kueue queue and priority class, node placement) with these differences:

- labels `gpuinfer/pool=<pool key>` (pool keys are valid label values: `pools.keys`) and
  `app.kubernetes.io/component=pool-worker`, instead of a run's, partitions' and spec's;
- the command's arguments `--pool KEY --worker-id ID --idle-ttl S --lease-ttl S`;
- `GPUINFER_LEASE_QUEUE` from a Secret key (`k8s.pools.queue_secret`): a PostgreSQL URL
  carries a password, which must be in neither the manifest nor the command line;
- optionally a read-write volume at `/var/lib/gpuinfer/queue` for a SQLite queue
  (`k8s.pools.queue_pvc`; one-node clusters only).

Why plain pods under Kueue, not a Deployment (or a StatefulSet):

- A pool worker ends on its own: after its idle TTL it shuts its engine down and exits 0,
  and that is how an idle pool scales to zero. A Deployment's pods must have
  `restartPolicy: Always`: the kubelet would restart the exited worker (building an engine
  for no work), and scaling to zero would need a second controller to patch `replicas`.
- Kueue admits each plain pod against its ClusterQueue's GPU quota (the pod integration,
  deploy/kueue/kueue-manager-config.yaml), like every other worker pod: a pool cannot take
  GPUs the quota does not give, and pool workers queue behind runs of higher priority.
- The count belongs to the reconciler (`pools.reconciler`), which sizes each pool from the
  queue's backlog and the caps; a Deployment controller would be a second owner of the same
  number. A worker that dies (node lost, preempted, OOMKilled) is not restarted in place:
  its leases expire and the reconciler starts another if the backlog still needs one.

Like `k8s.pod`, this module imports only the standard library, pydantic and dagster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster_gpuinfer.k8s.config import (
    KUEUE_QUEUE_LABEL,
    LABEL_PREFIX,
    QUEUE_MOUNT,
    K8sLauncherConfig,
    PodSpecError,
)
from dagster_gpuinfer.k8s.names import LABEL_NAME, _short_hash, dns_label
from dagster_gpuinfer.k8s.pod import _container_env, _pod_spec, _volumes, _worker_container
from dagster_gpuinfer.k8s.validation import validate_launcher_config
from dagster_gpuinfer.pools import DEFAULT_IDLE_TTL_S, DEFAULT_LEASE_TTL_S, QUEUE_ENV
from dagster_gpuinfer.pools.reconciler import pool_worker_args

POOL_LABEL = "gpuinfer/pool"
"""The label that selects a pool's worker pods; its value is the pool key."""
POOL_COMPONENT = "pool-worker"
POD_NAME_ENV = "GPUINFER_POD_NAME"
_POD_NAME_PREFIX = "gpuinfer-pool-"


def pool_pod_name(worker_id: str) -> str:
    """`gpuinfer-pool-<worker id>` as a DNS label; a worker id that had to change (characters,
    length) gets a hash of itself, so two workers never share a pod name."""
    room = 63 - len(_POD_NAME_PREFIX)
    cleaned = dns_label(worker_id, room)
    if cleaned != worker_id:
        digest = _short_hash(worker_id, 8)
        cleaned = f"{dns_label(worker_id, room - len(digest) - 1)}-{digest}"
    return _POD_NAME_PREFIX + cleaned


def pool_selector(pool_key: str) -> str:
    """The label selector of `pool_key`'s worker pods."""
    return f"{POOL_LABEL}={pool_key}"


def build_pool_pod(
    pool_key: str,
    worker_id: str,
    config: K8sLauncherConfig,
    *,
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    gpus: int = 1,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pod manifest of pool worker `worker_id` of pool `pool_key`.

    A pure function: no I/O, no cluster, no clock, no randomness (the reconciler picks the
    worker id).

    Args:
        pool_key: The pool (`pools.pool_key(spec)`): a valid label value.
        worker_id: Unique among the pool's workers; names the pod and the worker's leases.
        config: The launcher configuration (image, placement, cache, security, secrets, and
            `pools`: the Secret with the lease queue's location).
        idle_ttl_s: Seconds without a lease after which the worker exits 0.
        lease_ttl_s: The TTL of the worker's leases (it heartbeats every third of it).
        gpus: GPUs of one engine of the pool (`tensor_parallel_size x
            pipeline_parallel_size`); ignored when `placement.gpu_resource_name` is None.
        extra_env: Plain environment of the resource (`GpuInferenceResource.env`).

    Returns:
        A `v1/Pod` manifest as a dict in the Kubernetes API's camelCase.

    Raises:
        PodSpecError: the pool key, worker id, TTLs or configuration cannot make a valid pod.
    """
    _check_pool_inputs(pool_key, worker_id, idle_ttl_s, lease_ttl_s, gpus)
    spec = _pool_pod_spec(pool_key, worker_id, config, idle_ttl_s, lease_ttl_s, gpus, extra_env)
    labels = pool_pod_labels(pool_key, config, gpus)
    labels[f"{LABEL_PREFIX}/worker-id"] = pool_pod_name(worker_id).removeprefix(_POD_NAME_PREFIX)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pool_pod_name(worker_id),
            "namespace": config.namespace,
            "labels": labels,
            "annotations": {
                f"{LABEL_PREFIX}/pool-key": pool_key,
                f"{LABEL_PREFIX}/worker-id": worker_id,
                **config.annotations,
            },
        },
        "spec": spec,
    }


def pool_pod_template(
    pool_key: str,
    config: K8sLauncherConfig,
    *,
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    gpus: int = 1,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pool pod as a pod template (`metadata` + `spec`) for a controller that names its
    pods itself (a KEDA ScaledJob's Jobs): the worker id is the pod's own name, which the
    kubelet puts in `--worker-id` from `GPUINFER_POD_NAME` (`$(VAR)` expansion).

    Same arguments as `build_pool_pod`, less the worker id.
    """
    worker_id = f"$({POD_NAME_ENV})"
    _check_pool_inputs(pool_key, worker_id, idle_ttl_s, lease_ttl_s, gpus)
    spec = _pool_pod_spec(pool_key, worker_id, config, idle_ttl_s, lease_ttl_s, gpus, extra_env)
    annotations = {f"{LABEL_PREFIX}/pool-key": pool_key, **config.annotations}
    return {
        "metadata": {"labels": pool_pod_labels(pool_key, config, gpus), "annotations": annotations},
        "spec": spec,
    }


def _pool_pod_spec(
    pool_key: str,
    worker_id: str,
    config: K8sLauncherConfig,
    idle_ttl_s: float,
    lease_ttl_s: float,
    gpus: int,
    extra_env: Mapping[str, str] | None,
) -> dict[str, Any]:
    """The worker pod's spec with the pool's arguments, the queue's Secret and volume."""
    extra_env = dict(extra_env or {})
    validate_launcher_config(config, extra_env)
    volumes, mounts = _volumes(config)
    if config.pools.queue_pvc:
        claim = {"claimName": config.pools.queue_pvc, "readOnly": False}
        volumes.append({"name": "lease-queue", "persistentVolumeClaim": claim})
        mounts.append({"name": "lease-queue", "mountPath": QUEUE_MOUNT})
    env = _container_env(config, extra_env, gpus) + _pool_env(config)
    container = _worker_container(config, env, gpus, mounts)
    container["args"] = pool_worker_args(
        pool_key, worker_id, idle_ttl_s=idle_ttl_s, lease_ttl_s=lease_ttl_s
    )
    return _pod_spec(config, container, volumes)


def pool_pod_labels(pool_key: str, config: K8sLauncherConfig, gpus: int) -> dict[str, str]:
    """Labels that find a pool's pods (`gpuinfer/pool`) and hand them to the Kueue queue."""
    labels = {
        "app.kubernetes.io/name": "dagster-gpuinfer",
        "app.kubernetes.io/component": POOL_COMPONENT,
        "app.kubernetes.io/managed-by": "dagster-gpuinfer",
        POOL_LABEL: pool_key,
        f"{LABEL_PREFIX}/gpus": str(gpus if config.placement.gpu_resource_name else 0),
    }
    if config.placement.kueue_queue:
        labels[KUEUE_QUEUE_LABEL] = config.placement.kueue_queue
    labels.update(config.labels)
    return labels


def _pool_env(config: K8sLauncherConfig) -> list[dict[str, Any]]:
    """The lease queue by Secret reference, and the pod's own name for the worker's report."""
    secret = {
        "name": config.pools.queue_secret,
        "key": config.pools.queue_secret_key,
        "optional": False,
    }
    return [
        {"name": QUEUE_ENV, "valueFrom": {"secretKeyRef": secret}},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]


def _check_pool_inputs(
    pool_key: str, worker_id: str, idle_ttl_s: float, lease_ttl_s: float, gpus: int
) -> None:
    if not pool_key or len(pool_key) > 63 or not LABEL_NAME.match(pool_key):
        raise PodSpecError(
            f"pool key {pool_key!r} is not a valid label value (at most 63 of [A-Za-z0-9._-], "
            "alphanumeric at both ends); make it with dagster_gpuinfer.pools.pool_key(spec)"
        )
    if not worker_id.strip():
        raise PodSpecError("a pool worker needs a non-empty worker id (it names the pod)")
    for name, value in (("idle_ttl_s", idle_ttl_s), ("lease_ttl_s", lease_ttl_s)):
        if not value > 0:
            raise PodSpecError(f"pool pod {name}={value!r} must be a positive number of seconds")
    if gpus < 1:
        raise PodSpecError(f"pool pod gpus={gpus} must be at least 1 (one engine's GPUs)")
