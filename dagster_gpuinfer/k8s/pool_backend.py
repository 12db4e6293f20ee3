"""`K8sPoolBackend`: the reconciler's backend that runs pool workers as Kubernetes pods.

The reconciler (`pools.reconciler`) decides how many workers a pool needs; a backend starts
them. This one creates the pod `build_pool_pod` makes, through the same injected
`DagsterKubernetesClient` the worker pods use (`GpuInferenceResource.kubernetes_client`; a
fake API or the pod executor in tests), and reads a pool's pods back by their label
`gpuinfer/pool=<key>`:

- `start` creates one pool worker pod (Kueue admits it against the GPU quota; it may wait
  there, Pending, which still counts as a worker of the pool: it will lease once admitted),
  after reaping the pool's pods that ended;
- `live_workers` lists the worker ids of the pool's pods that have not ended and are not
  being deleted;
- `reap` deletes the pool's pods that ended (`restartPolicy: Never` leaves them behind:
  exit 0 after the idle TTL, or a failure) and says how each ended;
- `stop` deletes one worker's pod: SIGTERM, the worker drains its chunks in flight and
  releases its lease within the pod's termination grace period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
from dagster_k8s.client import DagsterKubernetesClient

from dagster_gpuinfer.k8s.config import LABEL_PREFIX, K8sLauncherConfig
from dagster_gpuinfer.k8s.pool_pod import build_pool_pod, pool_selector
from dagster_gpuinfer.pools import QUEUE_ENV

log = logging.getLogger("dagster_gpuinfer.k8s")

ENDED_PHASES = ("Succeeded", "Failed")
GPUS_LABEL = f"{LABEL_PREFIX}/gpus"


@dataclass(frozen=True)
class EndedPoolPod:
    """A pool worker pod that ended, as `K8sPoolBackend.reap` found it.

    Attributes:
        pod_name: The pod.
        worker_id: The worker it ran.
        phase: `Succeeded` (exit 0: idle TTL reached) or `Failed`.
        exit_code: The worker container's exit code, when the kubelet reported one.
        reason: The container's or pod's reason (`Completed`, `Error`, `OOMKilled`,
            `DeadlineExceeded`, `Evicted`, ...), when given.
    """

    pod_name: str
    worker_id: str
    phase: str
    exit_code: int | None
    reason: str | None


class K8sPoolBackend:
    """Starts pool workers as pods built by `build_pool_pod` and counts them by label.

    Args:
        config: The launcher configuration of the worker pods (`GpuInferenceResource.k8s`).
        kubernetes_client: Returns the `DagsterKubernetesClient` to use
            (`GpuInferenceResource.kubernetes_client`); called once, on first use.
        gpus: GPUs of one pool worker's engine (`tensor_parallel_size x
            pipeline_parallel_size` of the pool's specs): one number for every pool, a
            function of the pool key, or None: as many as the pool's other pods have (a
            reconciler that has no spec at hand, the sensor), 1 when it has none.

    Examples:
        >>> backend = K8sPoolBackend(resource.k8s, resource.kubernetes_client)  # doctest: +SKIP
        >>> backend.start(key, "w-1", resource.pool, resource.worker_env())  # doctest: +SKIP
    """

    def __init__(
        self,
        config: K8sLauncherConfig,
        kubernetes_client: Callable[[], DagsterKubernetesClient],
        *,
        gpus: int | Callable[[str], int] | None = 1,
    ) -> None:
        self.config = config
        self._client_factory = kubernetes_client
        self._client: DagsterKubernetesClient | None = None
        self._gpus = gpus

    @property
    def core_api(self) -> Any:
        """The client's `CoreV1Api` (made on first use)."""
        if self._client is None:
            self._client = self._client_factory()
        return self._client.core_api

    def build_pod(
        self, pool_key: str, worker_id: str, settings: Any, env: Mapping[str, str]
    ) -> dict[str, Any]:
        """The pod `start` creates (pure): TTLs from `settings` (`PoolSettings`: `idle_ttl_s`,
        `lease_ttl_s`); `env` without the queue's location, which pods read from the Secret
        `k8s.pools.queue_secret` (a PostgreSQL URL holds a password)."""
        if self._gpus is None:
            gpus = self.pool_gpus(pool_key)
        else:
            gpus = self._gpus(pool_key) if callable(self._gpus) else self._gpus
        return build_pool_pod(
            pool_key,
            worker_id,
            self.config,
            idle_ttl_s=float(settings.idle_ttl_s),
            lease_ttl_s=float(settings.lease_ttl_s),
            gpus=gpus,
            extra_env={k: v for k, v in env.items() if k != QUEUE_ENV},
        )

    def start(self, pool_key: str, worker_id: str, settings: Any, env: Mapping[str, str]) -> str:
        """Create the pod of worker `worker_id` of `pool_key`; returns the pod's name.

        Raises:
            PodSpecError: the configuration cannot make a valid pod (names the field).
            kubernetes.client.ApiException: the API server refused the pod (quota, RBAC, a
                pod of that name exists).
        """
        pod = self.build_pod(pool_key, worker_id, settings, env)
        name = pod["metadata"]["name"]
        for ended in self.reap(pool_key):  # the pool's pods that ended stay until deleted
            level = logging.INFO if ended.phase == "Succeeded" else logging.WARNING
            log.log(level, "pool worker pod %s ended: %s", ended.pod_name, ended)
        self.core_api.create_namespaced_pod(self.config.namespace, pod)
        log.info("started pool worker %s of pool %s (pod %s)", worker_id, pool_key, name)
        return name

    def pool_gpus(self, pool_key: str) -> int:
        """GPUs of the pool's pods (the most any has: a step with the pool's spec started
        them), or 1 when the pool has no pod."""
        found = [
            int(labels[GPUS_LABEL])
            for pod in self._pods(pool_key)
            if (labels := pod.metadata.labels or {}).get(GPUS_LABEL, "").isdigit()
        ]
        if not found:
            log.warning("pool %s has no pod to take its GPU count from; starting with 1", pool_key)
        return max(found, default=0) or 1

    def _pods(self, pool_key: str) -> list[Any]:
        listing = self.core_api.list_namespaced_pod(
            self.config.namespace, label_selector=pool_selector(pool_key)
        )
        return list(listing.items or [])

    def live_workers(self, pool_key: str) -> list[str]:
        """Worker ids of the pool's pods that are Pending or Running and not being deleted."""
        return sorted(
            _worker_id(pod)
            for pod in self._pods(pool_key)
            if (pod.status is None or pod.status.phase not in ENDED_PHASES)
            and pod.metadata.deletion_timestamp is None
        )

    def reap(self, pool_key: str) -> list[EndedPoolPod]:
        """Delete the pool's pods that ended; how each ended, for the reconciler's log."""
        ended = []
        for pod in self._pods(pool_key):
            if pod.status is None or pod.status.phase not in ENDED_PHASES:
                continue
            ended.append(_ended(pod))
            self._delete(pod.metadata.name)
        return ended

    def stop(self, worker_id: str, pool_key: str) -> bool:
        """Delete `worker_id`'s pod (the worker drains and releases its lease). False when
        the pool has no pod of that worker."""
        for pod in self._pods(pool_key):
            if _worker_id(pod) == worker_id:
                return self._delete(pod.metadata.name)
        return False

    def _delete(self, name: str) -> bool:
        try:
            self.core_api.delete_namespaced_pod(name, self.config.namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:  # gone already: what we wanted
                return False
            raise
        return True


def _worker_id(pod: Any) -> str:
    annotations = pod.metadata.annotations or {}
    return annotations.get(f"{LABEL_PREFIX}/worker-id", pod.metadata.name)


def _ended(pod: Any) -> EndedPoolPod:
    exit_code = reason = None
    for status in pod.status.container_statuses or []:
        terminated = status.state.terminated if status.state else None
        if terminated is not None:
            exit_code, reason = terminated.exit_code, terminated.reason
    return EndedPoolPod(
        pod_name=pod.metadata.name,
        worker_id=_worker_id(pod),
        phase=pod.status.phase,
        exit_code=exit_code,
        reason=reason or pod.status.reason,
    )
