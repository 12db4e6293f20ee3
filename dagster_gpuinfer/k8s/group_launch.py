"""The life of a pod group (`k8s.group`): created as one, failed as one, deleted as one.

`run_k8s_group` creates the leader's headless Service and the follower pods, then runs the
leader pod through `GpuWorkerPipesClient` exactly as a one-pod worker runs (Pipes messages
from its log, Kueue-aware start, post-mortem, failure table). Kueue admits the group only
once all its pods exist, so creating the followers first costs nothing.

While the leader runs, every poll of the launcher also reads the followers (the client's
sleeper is wrapped, so no thread and no second clock): a follower that is gone or Failed
fails the group at once. The leader is deleted (its engine cannot finish without the lost
ranks, and vLLM would wait on the collective), and the step fails with a retryable
`dagster.Failure` (`group_member_lost`); the retry builds a new group and resumes from the
committed chunks. A follower that Succeeded has seen the leader's port close: that is the
leader ending, not a loss.

However the leader ends (success, failure, a cancelled run), the followers and the Service
are deleted before `run_k8s_group` returns; the followers would also end themselves within
`probe_interval x probe_failures + grace` seconds of the leader (worker/follower.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import kubernetes
from dagster_k8s.client import DEFAULT_WAIT_TIMEOUT, DagsterKubernetesClient

from dagster_gpuinfer.k8s.client import (
    GpuWorkerPipesClient,
    KubernetesClientFactory,
    delete_pod,
    failure_for,
    read_log_tail,
    read_pod,
)
from dagster_gpuinfer.k8s.config import K8sLauncherConfig, PodSpecError
from dagster_gpuinfer.k8s.failures import PodFailure, WorkerPodFailed, last_error_lines
from dagster_gpuinfer.k8s.group import GroupConfig, WorkerGroup, build_worker_group
from dagster_gpuinfer.k8s.metrics_port import with_metrics_port
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.timing import start_timing_message
from dagster_gpuinfer.spec import InferenceSpec

log = logging.getLogger("dagster_gpuinfer.k8s")


class FollowerWatch:
    """Reads the followers on every poll; on the first loss deletes the leader once.

    Args:
        client: The cluster client.
        group: The group being watched.
    """

    def __init__(self, client: DagsterKubernetesClient, group: WorkerGroup) -> None:
        self.client = client
        self.group = group
        self.namespace = group.leader["metadata"]["namespace"]
        self.lost: PodFailure | None = None

    def check(self) -> None:
        """On the first follower found lost, note it and delete the leader."""
        if self.lost is not None:
            return
        self.lost = self.find_lost()
        if self.lost is not None:
            leader = self.group.leader["metadata"]["name"]
            log.warning("%s; deleting the leader %s", self.lost.message, leader)
            delete_pod(self.client, name=leader, namespace=self.namespace)

    def find_lost(self) -> PodFailure | None:
        """The first follower that is gone or Failed, read now (nothing is deleted)."""
        for follower in self.group.followers:
            name = follower["metadata"]["name"]
            pod = read_pod(self.client, name=name, namespace=self.namespace)
            phase = None if pod is None else getattr(pod.status, "phase", None)
            if pod is None or phase == "Failed":
                return self._failure(name, pod)
        return None

    def _failure(self, name: str, pod: Any) -> PodFailure:
        rank = self.group.followers.index(
            next(f for f in self.group.followers if f["metadata"]["name"] == name)
        )
        what = "was deleted (preempted, or its node went away)" if pod is None else "failed"
        tail = ""
        if pod is not None:
            tail = last_error_lines(read_log_tail(self.client, name=name, namespace=self.namespace))
        message = (
            f"follower pod {name} (node rank {rank + 1}) of worker group {self.group.name} "
            f"{what} while the leader ran: the engine cannot go on without its ranks, so the "
            "group was stopped. Retryable: the retry starts a new group and resumes from the "
            "committed chunks" + (f". Follower log:\n{tail}" if tail else "")
        )
        return PodFailure(
            kind="worker_crash",
            retryable=True,
            message=message,
            pod_name=name,
            detail={"group": self.group.name, "node_rank": rank + 1, "lost": what},
        )

    def sleeper(self, sleep: Callable[[float], None]) -> Callable[[float], None]:
        """`sleep`, with the followers read before each wait."""

        def watched(seconds: float) -> None:
            self.check()
            sleep(seconds)

        return watched


def watched_client_factory(
    factory: KubernetesClientFactory, watch_for: Callable[[DagsterKubernetesClient], FollowerWatch]
) -> KubernetesClientFactory:
    def make() -> DagsterKubernetesClient:
        client = factory()
        watch = watch_for(client)
        return DagsterKubernetesClient(
            batch_api=client.batch_api,
            core_api=client.core_api,
            logger=client.logger,
            sleeper=watch.sleeper(client.sleeper),
            timer=client.timer,
        )

    return make


def create_group_members(client: DagsterKubernetesClient, group: WorkerGroup) -> None:
    """The Service and the followers; the leader comes through PipesK8sClient."""
    namespace = group.leader["metadata"]["namespace"]
    client.core_api.create_namespaced_service(namespace, group.service)
    for follower in group.followers:
        client.core_api.create_namespaced_pod(namespace, follower)


def delete_group_members(
    client: DagsterKubernetesClient, group: WorkerGroup, *, poll_interval: float
) -> None:
    """Delete the followers and the Service, and wait (bounded by the pods' grace period)
    until the followers are gone, so no rank outlives the step; ones already gone are fine."""
    namespace = group.leader["metadata"]["namespace"]
    names = [follower["metadata"]["name"] for follower in group.followers]
    for name in names:
        delete_pod(client, name=name, namespace=namespace)
    try:
        client.core_api.delete_namespaced_service(group.service["metadata"]["name"], namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            log.warning("could not delete the Service of group %s: %s", group.name, exc)
    grace = max(f["spec"].get("terminationGracePeriodSeconds", 30) for f in group.followers)
    deadline = client.timer() + grace + 2 * poll_interval
    while names and client.timer() < deadline:
        names = [n for n in names if read_pod(client, name=n, namespace=namespace) is not None]
        if names:
            client.sleeper(poll_interval)
    if names:
        log.warning("followers %s of group %s are still terminating", names, group.name)


def run_k8s_group(
    *,
    context: dg.AssetExecutionContext,
    spec: InferenceSpec,
    extras: Mapping[str, Any],
    config: K8sLauncherConfig,
    group_config: GroupConfig,
    env: Mapping[str, str],
    kubernetes_client: KubernetesClientFactory,
    launch_attempt: int = 0,
) -> list[Any]:
    """Run the engine of `spec` across `spec.nodes` pods to completion; the leader's messages.

    Raises:
        dagster.Failure: the group cannot be built, a member was lost (retryable), or the
            leader failed as the failure table says.
        WorkerOutOfMemory: the leader ran out of memory; the resource steps memory down once.
    """
    identity = RunIdentity(
        run_id=context.run_id,
        asset_key=context.asset_key.to_user_string(),
        job_name=context.job_name,
        retry_number=context.retry_number,
        launch_attempt=launch_attempt,
    )
    try:
        group = build_worker_group(spec, config, identity, group_config, extra_env=env)
    except PodSpecError as exc:
        raise dg.Failure(
            description=f"cannot build the worker group: {exc}", allow_retries=False
        ) from None
    group = WorkerGroup(
        name=group.name,
        service=group.service,
        leader=with_metrics_port(group.leader, env),
        followers=group.followers,
    )
    cluster = kubernetes_client()
    watch = FollowerWatch(cluster, group)
    client = GpuWorkerPipesClient(
        kubernetes_client=watched_client_factory(lambda: cluster, lambda _: watch),
        pod_pending_timeout=config.pod_pending_timeout,
        queue_timeout=config.queue_timeout,
        poll_interval=config.poll_interval,
        pod_wait_timeout=max(DEFAULT_WAIT_TIMEOUT, config.active_deadline_seconds + 600.0),
    )
    context.log.info(
        f"worker group {group.name}: {spec.nodes} pods x {spec.ranks_per_node()} ranks "
        f"(tensor_parallel_size={spec.tensor_parallel_size}, "
        f"pipeline_parallel_size={spec.pipeline_parallel_size})"
    )
    try:
        create_group_members(cluster, group)
        invocation = client.run_worker_pod(context=context, extras=extras, pod=group.leader)
    except WorkerPodFailed as exc:
        # A rank lost between two polls usually takes the leader down first (its collective
        # breaks: gloo "Connection reset by peer"); the root cause is the follower, so it is
        # read once more before the leader's own failure is reported.
        lost = watch.lost or watch.find_lost()
        if lost is not None:
            raise failure_for(lost) from None
        if exc.failure.kind == "out_of_memory":
            raise
        raise failure_for(exc.failure) from None
    finally:
        delete_group_members(cluster, group, poll_interval=config.poll_interval)
    return [*invocation.get_custom_messages(), start_timing_message(client.start_timing)]
