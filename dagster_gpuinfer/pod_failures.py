"""What went wrong with a worker pod, and whether a retry can help.

Pure functions over what the Kubernetes API reports about a pod (a `V1Pod`, its events, the
tail of its log): they never call the cluster, so every row of the failure table is tested
with plain objects. The launcher (`launchers/k8s.py`) reads those facts when a pod fails and
turns the verdict into a Dagster `Failure` (retryable or not) or an out-of-memory step-down.

| kind               | cause                                               | retryable |
|--------------------|-----------------------------------------------------|-----------|
| unschedulable      | Pending past `pod_pending_timeout` (no GPU capacity) | yes       |
| start_timeout      | scheduled, not started in time (slow pull, volume)   | yes       |
| queue_timeout      | Kueue did not admit within `queue_timeout`           | yes       |
| image_pull         | ErrImagePull, ImagePullBackOff, InvalidImageName     | no        |
| config_error       | CreateContainerConfigError (missing Secret or key)   | no        |
| out_of_memory      | OOMKilled, CUDA/KV-cache out of memory at start      | step-down |
| kv_cache_too_small | the KV cache cannot hold one max_model_len sequence  | no        |
| evicted            | evicted, preempted, drained, node lost               | yes       |
| deleted            | the pod was deleted from outside                     | yes       |
| deadline_exceeded  | ran past activeDeadlineSeconds                       | yes       |
| worker_crash       | the worker exited non-zero                           | yes       |
| api_error          | the API refused the pod (RBAC, admission, invalid)   | 5xx only  |
| unknown            | anything else                                        | yes       |

Retryable failures resume from committed chunks: a partition's finished chunks are never
recomputed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dagster_gpuinfer.spec import InferenceSpec

FailureKind = Literal[
    "unschedulable",
    "start_timeout",
    "queue_timeout",
    "image_pull",
    "config_error",
    "out_of_memory",
    "kv_cache_too_small",
    "evicted",
    "deleted",
    "deadline_exceeded",
    "worker_crash",
    "api_error",
    "unknown",
]

KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"

IMAGE_PULL_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RegistryUnavailable",
    }
)
CONFIG_ERROR_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})
# Pod-level reasons the kubelet or node lifecycle controllers set when they stop a pod.
NODE_LOSS_REASONS = frozenset(
    {"NodeLost", "NodeShutdown", "Shutdown", "Terminated", "NodeAffinity"}
)
RESUME_NOTE = "The step is retryable; a retry resumes from the committed chunks."

# vLLM and torch messages for memory that ran out at engine start or during a batch.
_GPU_MEMORY_MARKERS = (
    "cuda out of memory",
    "torch.outofmemoryerror",
    "outofmemoryerror",
    "out of memory",
    "no available memory for the cache blocks",
    "insufficient memory",
    "not enough memory",
)
# vLLM: the KV cache fits, but is smaller than one sequence of max_model_len tokens. Less
# memory cannot fix this, so it is not stepped down.
_KV_TOO_SMALL = re.compile(
    r"larger than the maximum number of tokens that can be stored in kv cache", re.IGNORECASE
)
_PIPES_FIELD = "__dagster_pipes_version"


@dataclass(frozen=True)
class PodFailure:
    """Why a worker pod failed, and what the user sees.

    Attributes:
        kind: The failure table row.
        retryable: Whether Dagster's retry policy may run the step again.
        message: What happened, to which pod, and what to do.
        pod_name: The pod.
        detail: Facts for metadata: reasons, exit code, scheduler message.
    """

    kind: FailureKind
    retryable: bool
    message: str
    pod_name: str
    detail: dict[str, Any] = field(default_factory=dict)


class WorkerPodFailed(Exception):
    """A worker pod ended without finishing its job; `failure` says why."""

    def __init__(self, failure: PodFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class WorkerOutOfMemory(WorkerPodFailed):
    """The worker ran out of memory (container or GPU): worth one retry with smaller batches."""


def raise_for(failure: PodFailure) -> None:
    """Raise the exception that matches `failure` (out-of-memory has its own class)."""
    if failure.kind == "out_of_memory":
        raise WorkerOutOfMemory(failure)
    raise WorkerPodFailed(failure)


# --------------------------------------------------------------------------- reading a pod


def _status(pod: Any) -> Any:
    return getattr(pod, "status", None)


def container_statuses(pod: Any) -> list[Any]:
    status = _status(pod)
    return list(getattr(status, "container_statuses", None) or [])


def _condition(pod: Any, kind: str) -> Any:
    for condition in getattr(_status(pod), "conditions", None) or []:
        if condition.type == kind:
            return condition
    return None


def is_gated_by_kueue(pod: Any) -> bool:
    """The pod waits for Kueue admission: it still carries Kueue's scheduling gate."""
    gates = getattr(getattr(pod, "spec", None), "scheduling_gates", None) or []
    return any(gate.name == KUEUE_ADMISSION_GATE for gate in gates)


def is_scheduled(pod: Any) -> bool:
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.status == "True":
        return True
    return bool(getattr(getattr(pod, "spec", None), "node_name", None))


StartState = Literal[
    "queued", "unschedulable", "starting", "config_error", "image_error", "started", "failed"
]


def pod_start_state(pod: Any) -> tuple[StartState, str]:
    """Where a pod is on its way to running, with the cluster's own words for it.

    Returns:
        (state, detail): `queued` (Kueue gate), `unschedulable` (the scheduler's message),
        `starting` (pulling, mounting), `config_error`, `image_error`, `started` (a container
        runs or ran) or `failed` (the pod failed before any container ran).
    """
    status = _status(pod)
    phase = getattr(status, "phase", None)
    statuses = container_statuses(pod)
    for cs in statuses:
        state = cs.state
        if state is not None and (state.running is not None or state.terminated is not None):
            return "started", f"container {cs.name} started"
    if phase in ("Failed", "Succeeded"):
        return (
            "failed",
            f"pod phase {phase}: {getattr(status, 'reason', None) or ''} {getattr(status, 'message', None) or ''}".strip(),
        )
    for cs in statuses:
        waiting = cs.state.waiting if cs.state is not None else None
        if waiting is None:
            continue
        if waiting.reason in IMAGE_PULL_REASONS:
            return "image_error", f"{waiting.reason}: {waiting.message or ''}".strip()
        if waiting.reason in CONFIG_ERROR_REASONS:
            return "config_error", f"{waiting.reason}: {waiting.message or ''}".strip()
    if is_gated_by_kueue(pod):
        return "queued", "waiting for Kueue admission (scheduling gate kueue.x-k8s.io/admission)"
    if not is_scheduled(pod):
        scheduled = _condition(pod, "PodScheduled")
        message = (getattr(scheduled, "message", None) or "").strip()
        reason = getattr(scheduled, "reason", None) or "not scheduled yet"
        return "unschedulable", f"{reason}: {message}" if message else reason
    waiting_reasons = [
        cs.state.waiting.reason
        for cs in statuses
        if cs.state is not None and cs.state.waiting is not None and cs.state.waiting.reason
    ]
    return "starting", ", ".join(waiting_reasons) or "scheduled, containers not created yet"


def scheduler_messages(events: Iterable[Any]) -> list[str]:
    """The scheduler's and autoscaler's warnings about a pod, newest last, without repeats."""
    seen: list[str] = []
    for event in events:
        if getattr(event, "type", None) != "Warning":
            continue
        if getattr(event, "reason", None) not in (
            "FailedScheduling",
            "NotTriggerScaleUp",
            "FailedMount",
            "FailedAttachVolume",
        ):
            continue
        text = f"{event.reason}: {event.message}"
        if text not in seen:
            seen.append(text)
    return seen


def last_error_lines(log_text: str, limit: int = 25) -> str:
    """The end of a worker log worth showing: the last traceback (or the last `limit`
    lines), without Dagster Pipes protocol messages."""
    lines = []
    for line in log_text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("{") and _PIPES_FIELD in stripped:
            try:
                if _PIPES_FIELD in json.loads(stripped):
                    continue
            except ValueError:
                pass
        lines.append(line.rstrip())
    starts = [
        i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")
    ]
    if starts:
        lines = lines[starts[-1] :]
    return "\n".join(lines[-limit:])


def memory_problem(log_text: str) -> Literal["gpu_out_of_memory", "kv_cache_too_small"] | None:
    """What the worker's log says about memory, if anything."""
    if _KV_TOO_SMALL.search(log_text):
        return "kv_cache_too_small"
    lowered = log_text.lower()
    if any(marker in lowered for marker in _GPU_MEMORY_MARKERS):
        return "gpu_out_of_memory"
    return None


# --------------------------------------------------------------------------- the verdict


def classify_pod_failure(
    *,
    pod: Any | None,
    pod_name: str,
    image: str,
    events: Sequence[Any] = (),
    log_text: str = "",
    error: str = "",
) -> PodFailure:
    """Why a worker pod that did not finish its job failed.

    Args:
        pod: The pod as the API last reported it (`V1Pod`), or None when it is gone.
        pod_name: Its name (the pod may be gone).
        image: The worker image, named in image-pull failures.
        events: The pod's events (`CoreV1Event`), for the scheduler's reasons.
        log_text: The tail of the worker container's log.
        error: What the watcher raised (dagster-k8s's message), as a last resort.

    Returns:
        The failure table row with a message that says what happened and what to do.
    """
    detail: dict[str, Any] = {"pod": pod_name}
    if pod is None:
        return PodFailure(
            "deleted",
            True,
            f"worker pod {pod_name} disappeared while running: it was deleted from outside "
            "(kubectl delete, a namespace cleanup) or its node was lost and the pod garbage-"
            f"collected. {RESUME_NOTE}",
            pod_name,
            detail,
        )
    status = _status(pod)
    pod_reason = getattr(status, "reason", None)
    pod_message = (getattr(status, "message", None) or "").strip()
    detail.update({"phase": getattr(status, "phase", None), "pod_reason": pod_reason})

    disruption = _condition(pod, "DisruptionTarget")
    if pod_reason == "Evicted" or (disruption is not None and disruption.status == "True"):
        why = pod_message or (getattr(disruption, "message", None) or "")
        reason = pod_reason if pod_reason == "Evicted" else getattr(disruption, "reason", None)
        detail["disruption_reason"] = reason
        return PodFailure(
            "evicted",
            True,
            f"worker pod {pod_name} was stopped by the cluster ({reason}): {why or 'no message'}. "
            f"This is preemption, eviction, a drain or a lost node, not a fault of the job. {RESUME_NOTE}",
            pod_name,
            detail,
        )
    if pod_reason in NODE_LOSS_REASONS:
        return PodFailure(
            "evicted",
            True,
            f"worker pod {pod_name} stopped because its node went away ({pod_reason}: "
            f"{pod_message or 'no message'}). {RESUME_NOTE}",
            pod_name,
            detail,
        )
    if pod_reason == "DeadlineExceeded":
        return PodFailure(
            "deadline_exceeded",
            True,
            f"worker pod {pod_name} ran past its activeDeadlineSeconds and was stopped. {RESUME_NOTE} "
            "If runs keep hitting it, raise k8s.active_deadline_seconds or put fewer partitions "
            "in a run (BackfillPolicy.multi_run(max_partitions_per_run=...)).",
            pod_name,
            detail,
        )

    for cs in container_statuses(pod):
        waiting = cs.state.waiting if cs.state is not None else None
        if waiting is not None and waiting.reason in IMAGE_PULL_REASONS:
            detail.update({"container_reason": waiting.reason, "image": image})
            return PodFailure(
                "image_pull",
                False,
                f"worker pod {pod_name} cannot pull image {image!r} ({waiting.reason}: "
                f"{(waiting.message or '').strip() or 'no message'}). Not retried: fix "
                "k8s.image (name, tag, registry) or add k8s.image_pull_secrets, then re-run.",
                pod_name,
                detail,
            )
        if waiting is not None and waiting.reason in CONFIG_ERROR_REASONS:
            detail["container_reason"] = waiting.reason
            return PodFailure(
                "config_error",
                False,
                f"worker pod {pod_name} could not create its container ({waiting.reason}: "
                f"{(waiting.message or '').strip()}). Usually a Secret or key named in "
                "k8s.secret_env / k8s.secret_env_from does not exist in namespace "
                f"{getattr(getattr(pod, 'metadata', None), 'namespace', None)!r}. Not retried: "
                "create it or fix the reference, then re-run.",
                pod_name,
                detail,
            )

    if getattr(getattr(pod, "metadata", None), "deletion_timestamp", None) is not None:
        return PodFailure(
            "deleted",
            True,
            f"worker pod {pod_name} was deleted from outside while it ran (it has a deletion "
            f"timestamp). {RESUME_NOTE}",
            pod_name,
            detail,
        )

    terminated = _terminated_state(pod)
    if terminated is not None:
        exit_code = terminated.exit_code
        detail.update({"exit_code": exit_code, "container_reason": terminated.reason})
        tail = last_error_lines(log_text)
        if terminated.reason == "OOMKilled":
            return PodFailure(
                "out_of_memory",
                True,
                f"worker pod {pod_name} was OOMKilled: the container used more than its memory "
                "limit (k8s.memory_limit).",
                pod_name,
                {**detail, "memory": "container_oom_killed"},
            )
        problem = memory_problem(log_text)
        if exit_code != 0 and problem == "kv_cache_too_small":
            return PodFailure(
                "kv_cache_too_small",
                False,
                f"worker pod {pod_name}: vLLM's KV cache cannot hold one sequence of "
                "max_model_len tokens. Not retried: lower engine max_model_len, raise "
                "gpu_memory_utilization, or raise tensor_parallel_size to spread the model "
                f"over more GPUs. Last lines of the worker:\n{tail}",
                pod_name,
                {**detail, "memory": problem},
            )
        if exit_code != 0 and problem == "gpu_out_of_memory":
            return PodFailure(
                "out_of_memory",
                True,
                f"worker pod {pod_name} ran out of GPU memory (exit code {exit_code}). Last lines "
                f"of the worker:\n{tail}",
                pod_name,
                {**detail, "memory": problem},
            )
        if exit_code != 0:
            killed = " (SIGKILL)" if exit_code == 137 else " (SIGTERM)" if exit_code == 143 else ""
            return PodFailure(
                "worker_crash",
                True,
                f"worker pod {pod_name} exited with code {exit_code}{killed}. {RESUME_NOTE} "
                f"Last lines of the worker:\n{tail or '(the log is empty)'}",
                pod_name,
                detail,
            )

    return PodFailure(
        "unknown",
        True,
        f"worker pod {pod_name} failed: {error.splitlines()[0] if error else 'no reason reported'}"
        f" (pod phase {getattr(status, 'phase', None)}). {RESUME_NOTE}",
        pod_name,
        detail,
    )


def _terminated_state(pod: Any) -> Any:
    for cs in container_statuses(pod):
        if cs.state is not None and cs.state.terminated is not None:
            return cs.state.terminated
        last = getattr(cs, "last_state", None)
        if last is not None and last.terminated is not None:
            return last.terminated
    return None


def start_timeout_failure(
    *,
    state: StartState,
    detail_text: str,
    pod_name: str,
    timeout: float,
    events: Sequence[Any] = (),
) -> PodFailure:
    """The verdict for a pod that did not start within `pod_pending_timeout`."""
    reasons = scheduler_messages(events)
    why = "; ".join(dict.fromkeys([detail_text, *reasons]))
    detail = {"pod": pod_name, "start_state": state, "scheduler": reasons}
    if state == "config_error":
        return PodFailure(
            "config_error",
            False,
            f"worker pod {pod_name} could not create its container within {timeout:.0f}s "
            f"({why}). Usually a Secret or key in k8s.secret_env / k8s.secret_env_from is "
            "missing. Not retried: create it or fix the reference, then re-run.",
            pod_name,
            detail,
        )
    if state == "unschedulable":
        return PodFailure(
            "unschedulable",
            True,
            f"worker pod {pod_name} stayed Pending for more than {timeout:.0f}s "
            f"(k8s.pod_pending_timeout); the scheduler says: {why}. The pod was deleted. The "
            "step is retryable: GPUs may free up. If it persists, check the GPU request "
            "(tensor_parallel_size x replicas), k8s.gpu_type, tolerations and node capacity.",
            pod_name,
            detail,
        )
    return PodFailure(
        "start_timeout",
        True,
        f"worker pod {pod_name} was scheduled but did not start within {timeout:.0f}s "
        f"(k8s.pod_pending_timeout): {why}. The pod was deleted. A first pull of a large "
        "worker image can take minutes: pre-pull it on GPU nodes or raise the timeout.",
        pod_name,
        detail,
    )


def queue_timeout_failure(*, pod_name: str, queue: str | None, timeout: float) -> PodFailure:
    return PodFailure(
        "queue_timeout",
        True,
        f"worker pod {pod_name} waited more than {timeout:.0f}s (k8s.queue_timeout) for Kueue "
        f"to admit it from LocalQueue {queue!r}: its ClusterQueue has no free quota for this "
        "GPU request. The pod was deleted; the step is retryable. See `kubectl get workloads` "
        "in the namespace for the queue position.",
        pod_name,
        {"pod": pod_name, "queue": queue},
    )


def api_error_failure(
    *, status: int | None, reason: str, body: str, pod_name: str, namespace: str
) -> PodFailure:
    """The verdict when the API server refuses to create the pod."""
    message = body
    try:
        message = json.loads(body).get("message", body)
    except (ValueError, AttributeError, TypeError):
        pass
    detail = {"pod": pod_name, "status": status, "reason": reason}
    if status == 403:
        return PodFailure(
            "api_error",
            False,
            f"the Kubernetes API refused to create worker pod {pod_name} in namespace "
            f"{namespace!r} (403 Forbidden: {message}). The launcher's ServiceAccount needs "
            "pods create/get/list/watch/delete and pods/log get there: apply deploy/rbac.yaml.",
            pod_name,
            detail,
        )
    if status is not None and 400 <= status < 500:
        return PodFailure(
            "api_error",
            False,
            f"the Kubernetes API rejected worker pod {pod_name} in namespace {namespace!r} "
            f"({status} {reason}: {message}). Not retried: fix the k8s launcher configuration "
            "(or the admission policy that rejected it), then re-run.",
            pod_name,
            detail,
        )
    return PodFailure(
        "api_error",
        True,
        f"the Kubernetes API failed to create worker pod {pod_name} ({status} {reason}: "
        f"{message}). The step is retryable.",
        pod_name,
        detail,
    )


# --------------------------------------------------------------------------- OOM step-down


DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's usual `max_num_seqs` when a spec leaves it unset; the step-down halves it."""


def step_down_memory(spec: InferenceSpec) -> tuple[InferenceSpec, dict[str, Any]]:
    """The spec with `max_num_seqs` halved and `gpu_memory_utilization` lowered.

    Both are performance-only engine fields, left out of `spec_hash()`, so committed chunks
    of the first attempt stay valid for the second.

    Returns:
        (stepped-down spec, what changed: `{field: {"from": old, "to": new}}`).
    """
    engine = spec.engine
    seqs_from = engine.max_num_seqs
    seqs_to = max(1, (seqs_from or DEFAULT_MAX_NUM_SEQS) // 2)
    util_from = engine.gpu_memory_utilization
    util_to = round(util_from - 0.1, 3) if util_from > 0.5 else round(util_from * 0.8, 3)
    util_to = max(0.05, util_to)
    stepped = spec.model_copy(
        update={
            "engine": engine.model_copy(
                update={"max_num_seqs": seqs_to, "gpu_memory_utilization": util_to}
            )
        }
    )
    change = {
        "max_num_seqs": {"from": seqs_from, "to": seqs_to},
        "gpu_memory_utilization": {"from": util_from, "to": util_to},
    }
    return stepped, change


def out_of_memory_hint(first: PodFailure, second: PodFailure, change: dict[str, Any]) -> str:
    """The message when the stepped-down retry ran out of memory too."""
    seqs = change["max_num_seqs"]["to"]
    util = change["gpu_memory_utilization"]["to"]
    container = "container_oom_killed" in (first.detail.get("memory"), second.detail.get("memory"))
    memory_advice = (
        "raise k8s.memory_limit (and memory_request) so the container can hold the model's "
        "weights while loading, "
        if container
        else ""
    )
    return (
        f"the worker ran out of memory twice: first {first.message.splitlines()[0]} Then, "
        f"retried with max_num_seqs={seqs} and gpu_memory_utilization={util}: "
        f"{second.message.splitlines()[0]} Not retried again. To fix: {memory_advice}lower "
        "engine max_num_seqs and gpu_memory_utilization further (InferenceRunConfig in the "
        "launchpad), lower max_model_len, or raise tensor_parallel_size to spread the model "
        "over more GPUs."
    )
