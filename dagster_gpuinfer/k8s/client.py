"""The Kubernetes client: the worker in a GPU pod, through `dagster_k8s.PipesK8sClient`.

`GpuWorkerPipesClient` is a `PipesK8sClient` that keeps everything dagster-k8s already does
(Pipes bootstrap environment and `build_pod_body`, log streaming and message extraction,
`DagsterKubernetesClient.wait_for_pod` for readiness and termination) and adds what GPU batch
jobs need and dagster-k8s does not have:

- an injected `DagsterKubernetesClient` (core API, sleeper, timer), as dagster-k8s's own
  tests inject theirs, so every failure path runs against a fake API without a cluster;
- a start phase that knows Kueue: time behind Kueue's admission gate is queueing (bounded by
  `queue_timeout`, unbounded by default), time after it counts against `pod_pending_timeout`,
  and a pod past it fails with the scheduler's reason instead of waiting dagster-k8s's one-day
  launch timeout;
- a post-mortem: when the pod fails, its status, events and log tail are read *before* the
  pod is deleted and classified (`k8s.failures.classify_pod_failure`);
- deletion in every case (success, failure, a run cancelled in Dagster), tolerant of a pod
  that is already gone, so a 404 never hides the real error.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import kubernetes
from dagster_k8s.client import DEFAULT_WAIT_TIMEOUT, DagsterKubernetesClient, WaitForPodState
from dagster_k8s.pipes import PipesK8sClient, build_pod_body
from dagster_k8s.utils import apply_no_proxy_env_workaround

from dagster_gpuinfer.k8s.config import (
    KUEUE_QUEUE_LABEL,
    WORKER_CONTAINER,
    K8sLauncherConfig,
    PodSpecError,
)
from dagster_gpuinfer.k8s.failures import (
    PodFailure,
    WorkerPodFailed,
    api_error_failure,
    classify_pod_failure,
    pod_start_state,
    queue_timeout_failure,
    raise_for,
    start_timeout_failure,
)
from dagster_gpuinfer.k8s.metrics_port import with_metrics_port
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.k8s.timing import StartObserver, start_timing_message
from dagster_gpuinfer.spec import InferenceSpec

log = logging.getLogger("dagster_gpuinfer.k8s")

KubernetesClientFactory = Callable[[], DagsterKubernetesClient]
LOG_TAIL_LINES = 200


def production_kubernetes_client(config: K8sLauncherConfig) -> DagsterKubernetesClient:
    """A client for the real cluster, configured as `PipesK8sClient` configures its own.

    `load_incluster_config=True` (or nothing set, inside a pod): the pod's ServiceAccount.
    Otherwise `kubeconfig_file` and `kube_context` (None: `$KUBECONFIG`, then `~/.kube/config`).
    """
    nothing_set = (
        config.load_incluster_config is None
        and config.kubeconfig_file is None
        and config.kube_context is None
    )
    if config.load_incluster_config or (nothing_set and os.getenv("KUBERNETES_SERVICE_HOST")):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config(
            config_file=config.kubeconfig_file, context=config.kube_context
        )
    apply_no_proxy_env_workaround()
    return DagsterKubernetesClient.production_client()


class _DisruptionMemory:
    """The core API, remembering each pod last seen with a `DisruptionTarget` condition.

    A preempted or evicted pod carries the condition while it runs out its grace period;
    once its container ends, the API server removes it. Polling every few seconds, the
    launcher mostly finds it gone (404), and "deleted from outside or node lost" would hide
    the cluster's own reason. The last view that had the condition is the pod's record.
    """

    def __init__(self, api: Any) -> None:
        self._api = api
        self.disrupted: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def _note(self, pod: Any) -> Any:
        conditions = getattr(getattr(pod, "status", None), "conditions", None) or ()
        if any(c.type == "DisruptionTarget" and c.status == "True" for c in conditions):
            self.disrupted[pod.metadata.name] = pod
        return pod

    def list_namespaced_pod(self, *args: Any, **kwargs: Any) -> Any:
        result = self._api.list_namespaced_pod(*args, **kwargs)
        for pod in getattr(result, "items", None) or ():
            self._note(pod)
        return result

    def read_namespaced_pod(self, *args: Any, **kwargs: Any) -> Any:
        return self._note(self._api.read_namespaced_pod(*args, **kwargs))


def last_disrupted_view(client: DagsterKubernetesClient, name: str) -> Any:
    """The pod as last seen with a DisruptionTarget condition, or None."""
    memory = client.core_api
    return memory.disrupted.get(name) if isinstance(memory, _DisruptionMemory) else None


class _PromptPodClient(DagsterKubernetesClient):
    """dagster-k8s's client, but a pod that disappears fails the wait within a poll or two.

    `wait_for_pod` treats a missing pod as "not launched yet" for `pod_launch_timeout` (one
    day by default), which is right before creation and wrong after it: our pods exist
    before any wait starts, so a missing pod was deleted (from outside, or with its node).
    """

    def __init__(self, client: DagsterKubernetesClient, *, launch_timeout: float) -> None:
        super().__init__(
            batch_api=client.batch_api,
            core_api=_DisruptionMemory(client.core_api),
            logger=client.logger,
            sleeper=client.sleeper,
            timer=client.timer,
        )
        self.launch_timeout = launch_timeout

    def wait_for_pod(self, pod_name: str, namespace: str, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("pod_launch_timeout", self.launch_timeout)
        return super().wait_for_pod(pod_name, namespace, *args, **kwargs)


class GpuWorkerPipesClient(PipesK8sClient):
    """`PipesK8sClient` for worker pods built by `build_worker_pod`.

    Args:
        kubernetes_client: Returns the `DagsterKubernetesClient` to use (inject a fake in tests).
        pod_pending_timeout: Seconds a pod may take to start after Kueue admitted it.
        queue_timeout: Seconds a pod may wait for Kueue admission; None waits as needed.
        poll_interval: Seconds between status polls.
        pod_wait_timeout: Seconds to wait for a running pod to terminate.
    """

    def __init__(
        self,
        *,
        kubernetes_client: KubernetesClientFactory,
        pod_pending_timeout: float,
        queue_timeout: float | None = None,
        poll_interval: float = 5.0,
        pod_wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        super().__init__(poll_interval=poll_interval)
        self._kubernetes_client = kubernetes_client
        self.pod_pending_timeout = pod_pending_timeout
        self.queue_timeout = queue_timeout
        self.pod_wait_timeout = pod_wait_timeout
        self.start_timing = None  # k8s/timing.py: queued, scheduling, container start

    def run_worker_pod(
        self,
        *,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        extras: Mapping[str, Any],
        pod: Mapping[str, Any],
    ) -> dg.PipesClientCompletedInvocation:
        """Create the pod, stream its Pipes messages, wait for it to end, delete it.

        Raises:
            WorkerPodFailed: the pod failed (`failure` says why and if a retry can help);
                `WorkerOutOfMemory` when it ran out of memory.
        """
        client = _PromptPodClient(self._kubernetes_client(), launch_timeout=self.poll_interval)
        name = pod["metadata"]["name"]
        namespace = pod["metadata"]["namespace"]
        image = pod["spec"]["containers"][0]["image"]
        queue = pod["metadata"].get("labels", {}).get(KUEUE_QUEUE_LABEL)
        with dg.open_pipes_session(
            context=context,
            extras=dict(extras),
            context_injector=self.context_injector,
            message_reader=self.message_reader,
        ) as pipes_session:
            body = build_pod_body(
                pod_name=name,
                image=None,
                command=None,
                env_vars={**pipes_session.get_bootstrap_env_vars(), **(self.env or {})},
                base_pod_meta=copy.deepcopy(pod["metadata"]),
                base_pod_spec=copy.deepcopy(pod["spec"]),
            )
            try:
                client.core_api.create_namespaced_pod(namespace, body)
            except kubernetes.client.ApiException as exc:
                raise_for(
                    api_error_failure(
                        status=exc.status,
                        reason=str(exc.reason),
                        body=exc.body if isinstance(exc.body, str) else str(exc.body or ""),
                        pod_name=name,
                        namespace=namespace,
                    )
                )
            context.log.info(
                f"worker pod {name} created in namespace {namespace} "
                f"(image {image}, queue {queue or 'none'})"
            )
            try:
                self.wait_until_started(
                    client, name=name, namespace=namespace, image=image, queue=queue
                )
                with self.consume_pod_logs(
                    context=context, client=client, namespace=namespace, pod_name=name
                ):
                    client.wait_for_pod(
                        name,
                        namespace,
                        wait_for_state=WaitForPodState.Terminated,
                        wait_time_between_attempts=self.poll_interval,
                        wait_timeout=self.pod_wait_timeout,
                    )
            except WorkerPodFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - any watch error: read the pod, classify it
                raise_for(
                    self.diagnose(client, name=name, namespace=namespace, image=image, error=exc)
                )
            finally:
                delete_pod(client, name=name, namespace=namespace)
        return dg.PipesClientCompletedInvocation(pipes_session)

    # ------------------------------------------------------------------ start phase

    def wait_until_started(
        self,
        client: DagsterKubernetesClient,
        *,
        name: str,
        namespace: str,
        image: str,
        queue: str | None,
    ) -> None:
        """Wait until a container of the pod runs (or ran).

        Kueue's admission gate is queueing, bounded by `queue_timeout`. Everything after it
        (unschedulable, pulling, mounting, a missing Secret) counts against
        `pod_pending_timeout`. An image that cannot be pulled fails at once.

        Raises:
            WorkerPodFailed: the pod vanished, cannot pull its image, failed before starting,
                or did not start in time.
        """
        started_at = client.timer()
        pending_since: float | None = None
        observer = StartObserver(now=client.timer)
        while True:
            pod = read_pod(client, name=name, namespace=namespace)
            if pod is None:
                seen = last_disrupted_view(client, name)
                raise_for(classify_pod_failure(pod=seen, pod_name=name, image=image))
            state, detail = pod_start_state(pod)
            observer.observe(state)
            now = client.timer()
            if state == "started":
                self.start_timing = observer.timing(pod)
                return
            if state in ("image_error", "failed"):
                raise_for(
                    self.diagnose(client, name=name, namespace=namespace, image=image, pod=pod)
                )
            if state == "queued":
                pending_since = None
                if self.queue_timeout is not None and now - started_at > self.queue_timeout:
                    raise_for(
                        queue_timeout_failure(
                            pod_name=name, queue=queue, timeout=self.queue_timeout
                        )
                    )
            else:
                if pending_since is None:
                    pending_since = now
                elif now - pending_since > self.pod_pending_timeout:
                    raise_for(
                        start_timeout_failure(
                            state=state,
                            detail_text=detail,
                            pod_name=name,
                            timeout=self.pod_pending_timeout,
                            events=read_events(client, name=name, namespace=namespace),
                        )
                    )
            client.sleeper(self.poll_interval)

    # ------------------------------------------------------------------ post-mortem

    def diagnose(
        self,
        client: DagsterKubernetesClient,
        *,
        name: str,
        namespace: str,
        image: str,
        error: BaseException | None = None,
        pod: Any = None,
    ) -> PodFailure:
        """Read what the cluster knows about a failed pod and classify it; a pod already
        gone is classified by its last view with a DisruptionTarget condition, if any."""
        if pod is None:
            pod = read_pod(client, name=name, namespace=namespace)
            if pod is None and (seen := last_disrupted_view(client, name)) is not None:
                return classify_pod_failure(pod=seen, pod_name=name, image=image)
        return classify_pod_failure(
            pod=pod,
            pod_name=name,
            image=image,
            events=read_events(client, name=name, namespace=namespace) if pod is not None else (),
            log_text=read_log_tail(client, name=name, namespace=namespace)
            if pod is not None
            else "",
            error=str(error or ""),
        )


# --------------------------------------------------------------------------- API reads


def read_pod(client: DagsterKubernetesClient, *, name: str, namespace: str) -> Any:
    """The pod (`DagsterKubernetesClient.get_pod_by_name`), or None when it does not exist."""
    try:
        return client.get_pod_by_name(name, namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def read_events(client: DagsterKubernetesClient, *, name: str, namespace: str) -> list[Any]:
    """The pod's events; empty when the launcher may not list events."""
    try:
        return list(client.retrieve_pod_events(name, namespace))
    except kubernetes.client.ApiException as exc:
        log.info("cannot read events of pod %s: %s", name, exc.reason)
        return []


def read_log_tail(client: DagsterKubernetesClient, *, name: str, namespace: str) -> str:
    try:
        return client.retrieve_pod_logs(
            name, namespace, container_name=WORKER_CONTAINER, tail_lines=LOG_TAIL_LINES
        )
    except kubernetes.client.ApiException as exc:
        log.info("cannot read the log of pod %s: %s", name, exc.reason)
        return ""


def delete_pod(client: DagsterKubernetesClient, *, name: str, namespace: str) -> None:
    """Delete the pod; one that is already gone is fine."""
    try:
        client.core_api.delete_namespaced_pod(name, namespace, propagation_policy="Background")
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            log.warning("could not delete worker pod %s in %s: %s", name, namespace, exc)


# --------------------------------------------------------------------------- entry point


def run_k8s_worker(
    *,
    context: dg.AssetExecutionContext,
    spec: InferenceSpec,
    extras: Mapping[str, Any],
    config: K8sLauncherConfig,
    env: Mapping[str, str],
    kubernetes_client: KubernetesClientFactory,
    launch_attempt: int = 0,
) -> list[Any]:
    """Run the worker for `spec` in a pod to completion; returns its Pipes messages.

    Raises:
        dagster.Failure: the pod cannot be built, or it failed in a way the table in
            `k8s.failures` maps to a Failure (retryable or not, with the reason).
        WorkerOutOfMemory: the worker ran out of memory; the resource steps memory down once.
    """
    identity = RunIdentity(
        run_id=context.run_id,
        asset_key=context.asset_key.to_user_string(),
        job_name=context.job_name,
        retry_number=context.retry_number,
        launch_attempt=launch_attempt,
    )
    try:
        pod = with_metrics_port(build_worker_pod(spec, config, identity, extra_env=env), env)
    except PodSpecError as exc:
        raise dg.Failure(
            description=f"cannot build the worker pod: {exc}", allow_retries=False
        ) from None
    step_pool = getattr(context.op_def, "pool", None)
    if config.pool and step_pool != config.pool:
        context.log.warning(
            f"this step runs in pool {step_pool!r}, not in the GPU pool {config.pool!r}: its "
            "pods are not capped by the pool's limit. Pass pool="
            f"{config.pool!r} to inference_assets(...)"
        )
    client = GpuWorkerPipesClient(
        kubernetes_client=kubernetes_client,
        pod_pending_timeout=config.pod_pending_timeout,
        queue_timeout=config.queue_timeout,
        poll_interval=config.poll_interval,
        pod_wait_timeout=max(DEFAULT_WAIT_TIMEOUT, config.active_deadline_seconds + 600.0),
    )
    try:
        invocation = client.run_worker_pod(context=context, extras=extras, pod=pod)
    except WorkerPodFailed as exc:
        if exc.failure.kind == "out_of_memory":
            raise
        raise failure_for(exc.failure) from None
    return [*invocation.get_custom_messages(), start_timing_message(client.start_timing)]


def failure_for(failure: PodFailure) -> dg.Failure:
    """The Dagster Failure a pod failure becomes: retryable or not, with its facts."""
    return dg.Failure(
        description=failure.message,
        allow_retries=failure.retryable,
        metadata={
            "pod_failure": failure.kind,
            "pod": failure.pod_name,
            "retryable": failure.retryable,
            "pod_failure_detail": dg.MetadataValue.json(
                {k: v for k, v in failure.detail.items() if v is not None}
            ),
        },
    )
