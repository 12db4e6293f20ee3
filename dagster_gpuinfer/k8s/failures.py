"""What went wrong with a worker pod, and whether a retry can help.

Pure functions over what the Kubernetes API reports about a pod (a `V1Pod`, its events, the
tail of its log): they never call the cluster, so every row of the failure table is tested
with plain objects. The client (`k8s/client.py`) reads those facts when a pod fails and
turns the verdict into a Dagster `Failure` (retryable or not) or an out-of-memory step-down
(`k8s/memory.py`).

A failed pod is first read into `PodFacts`; `FAILURE_TABLE` is then matched in order, and
the first row whose `matches` holds gives the kind, whether it is retryable, and the message.

| kind               | cause                                               | retryable |
|--------------------|-----------------------------------------------------|-----------|
| unschedulable      | Pending past `pod_pending_timeout` (no GPU capacity) | yes       |
| start_timeout      | scheduled, not started in time (slow pull, volume)   | yes       |
| queue_timeout      | Kueue did not admit within `queue_timeout`           | yes       |
| image_pull         | ErrImagePull, ImagePullBackOff, InvalidImageName     | no        |
| config_error       | CreateContainerConfigError (missing Secret or key)   | no        |
| container_start    | StartError: the image cannot exec k8s.command        | no        |
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dagster_gpuinfer.messages import EXIT_SPEC_REFUSED
from dagster_gpuinfer.out_of_memory import memory_problem

FailureKind = Literal[
    "unschedulable",
    "start_timeout",
    "queue_timeout",
    "image_pull",
    "config_error",
    "container_start",
    "out_of_memory",
    "kv_cache_too_small",
    "evicted",
    "deleted",
    "deadline_exceeded",
    "worker_crash",
    "spec_refused",
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
# Terminated reasons of a container whose process never started (containerd: StartError,
# "exec: \"python3\": executable file not found in $PATH"; docker: ContainerCannotRun).
START_ERROR_REASONS = frozenset({"StartError", "ContainerCannotRun", "RunContainerError"})
# Pod-level reasons the kubelet or node lifecycle controllers set when they stop a pod.
NODE_LOSS_REASONS = frozenset(
    {"NodeLost", "NodeShutdown", "Shutdown", "Terminated", "NodeAffinity"}
)
RESUME_NOTE = "The step is retryable; a retry resumes from the committed chunks."
_PIPES_FIELD = "__dagster_pipes_version"
_MISSING_SECRET_HINT = (
    "Usually a Secret or key named in k8s.secrets.env / k8s.secrets.env_from does not exist"
)


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


def _waiting(container_status: Any) -> Any:
    return container_status.state.waiting if container_status.state is not None else None


def _with_message(reason: str, message: str | None) -> str:
    return f"{reason}: {message or ''}".strip()


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
        why = f"{getattr(status, 'reason', None) or ''} {getattr(status, 'message', None) or ''}"
        return "failed", f"pod phase {phase}: {why}".strip()
    for cs in statuses:
        waiting = _waiting(cs)
        if waiting is None:
            continue
        if waiting.reason in IMAGE_PULL_REASONS:
            return "image_error", _with_message(waiting.reason, waiting.message)
        if waiting.reason in CONFIG_ERROR_REASONS:
            return "config_error", _with_message(waiting.reason, waiting.message)
    if is_gated_by_kueue(pod):
        return "queued", "waiting for Kueue admission (scheduling gate kueue.x-k8s.io/admission)"
    if not is_scheduled(pod):
        scheduled = _condition(pod, "PodScheduled")
        message = (getattr(scheduled, "message", None) or "").strip()
        reason = getattr(scheduled, "reason", None) or "not scheduled yet"
        return "unschedulable", f"{reason}: {message}" if message else reason
    waiting_reasons = [
        waiting.reason
        for cs in statuses
        if (waiting := _waiting(cs)) is not None and waiting.reason
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


def _terminated_state(pod: Any) -> Any:
    for cs in container_statuses(pod):
        if cs.state is not None and cs.state.terminated is not None:
            return cs.state.terminated
        last = getattr(cs, "last_state", None)
        if last is not None and last.terminated is not None:
            return last.terminated
    return None


@dataclass(frozen=True)
class PodFacts:
    """What the cluster and the log say about a failed pod, read once, for the table.

    Every attribute is plain data; the table's messages are format strings over them
    (`{f.pod_name}`), and its `detail` names the ones that go to the failure's metadata.
    """

    pod: str
    image: str
    error: str = ""
    gone: bool = False
    namespace: str | None = None
    phase: str | None = None
    pod_reason: str | None = None
    pod_message: str = ""
    disrupted: bool = False
    disruption_reason: str | None = None
    disruption_message: str = ""
    waiting_reason: str | None = None
    waiting_message: str = ""
    deleting: bool = False
    exit_code: int | None = None
    container_reason: str | None = None
    container_message: str = ""
    memory: str | None = None
    tail: str = ""

    @property
    def pod_message_shown(self) -> str:
        return self.pod_message or "no message"

    @property
    def eviction_why(self) -> str:
        return self.pod_message or self.disruption_message or "no message"

    @property
    def waiting_message_shown(self) -> str:
        return self.waiting_message or "no message"

    @property
    def tail_shown(self) -> str:
        return self.tail or "(the log is empty)"

    @property
    def crashed(self) -> bool:
        return self.exit_code is not None and self.exit_code != 0

    @property
    def signal(self) -> str:
        return {137: " (SIGKILL)", 143: " (SIGTERM)"}.get(self.exit_code or 0, "")

    @property
    def error_line(self) -> str:
        return self.error.splitlines()[0] if self.error else "no reason reported"


def read_pod_facts(
    *, pod: Any | None, pod_name: str, image: str, log_text: str = "", error: str = ""
) -> PodFacts:
    """The facts of `pod` (None when it is gone) that the failure table matches on."""
    if pod is None:
        return PodFacts(pod=pod_name, image=image, error=error, gone=True)
    status = _status(pod)
    metadata = getattr(pod, "metadata", None)
    pod_reason = getattr(status, "reason", None)
    pod_message = (getattr(status, "message", None) or "").strip()
    disruption = _condition(pod, "DisruptionTarget")
    disrupted = pod_reason == "Evicted" or (disruption is not None and disruption.status == "True")
    disruption_reason = (
        pod_reason if pod_reason == "Evicted" else getattr(disruption, "reason", None)
    )
    waiting = next(
        (
            w
            for cs in container_statuses(pod)
            if (w := _waiting(cs)) is not None
            and w.reason in IMAGE_PULL_REASONS | CONFIG_ERROR_REASONS
        ),
        None,
    )
    terminated = _terminated_state(pod)
    exit_code = terminated.exit_code if terminated is not None else None
    container_reason = terminated.reason if terminated is not None else None
    memory = None
    if container_reason == "OOMKilled":
        memory = "container_oom_killed"
    elif exit_code:
        memory = memory_problem(log_text)
    return PodFacts(
        pod=pod_name,
        image=image,
        error=error,
        namespace=getattr(metadata, "namespace", None),
        phase=getattr(status, "phase", None),
        pod_reason=pod_reason,
        pod_message=pod_message,
        disrupted=disrupted,
        disruption_reason=disruption_reason,
        disruption_message=getattr(disruption, "message", None) or "",
        waiting_reason=waiting.reason if waiting is not None else None,
        waiting_message=(waiting.message or "").strip() if waiting is not None else "",
        deleting=getattr(metadata, "deletion_timestamp", None) is not None,
        exit_code=exit_code,
        container_reason=waiting.reason if waiting is not None else container_reason,
        container_message=(getattr(terminated, "message", None) or "").strip(),
        memory=memory,
        tail=last_error_lines(log_text) if terminated is not None else "",
    )


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class FailureRow:
    """One row of the failure table.

    Attributes:
        kind: The failure kind this row reports.
        retryable: Whether Dagster may retry the step.
        matches: Whether the row applies to a pod's facts.
        message: A format string over the facts (`f`) and `RESUME_NOTE` (`resume`).
        detail: Fact names copied into the failure's detail, besides the pod and phase.
    """

    kind: FailureKind
    retryable: bool
    matches: Callable[[PodFacts], bool]
    message: str
    detail: tuple[str, ...] = ()


_MEMORY_DETAIL = ("exit_code", "container_reason", "memory")

FAILURE_TABLE: tuple[FailureRow, ...] = (
    FailureRow(
        "deleted",
        True,
        lambda f: f.gone,
        "worker pod {f.pod} disappeared while running: it was deleted from outside "
        "(kubectl delete, a namespace cleanup) or its node was lost and the pod garbage-"
        "collected. {resume}",
    ),
    FailureRow(
        "evicted",
        True,
        lambda f: f.disrupted,
        "worker pod {f.pod} was stopped by the cluster ({f.disruption_reason}): "
        "{f.eviction_why}. This is preemption, eviction, a drain or a lost node, not a "
        "fault of the job. {resume}",
        ("disruption_reason",),
    ),
    FailureRow(
        "evicted",
        True,
        lambda f: f.pod_reason in NODE_LOSS_REASONS,
        "worker pod {f.pod} stopped because its node went away ({f.pod_reason}: "
        "{f.pod_message_shown}). {resume}",
    ),
    FailureRow(
        "deadline_exceeded",
        True,
        lambda f: f.pod_reason == "DeadlineExceeded",
        "worker pod {f.pod} ran past its activeDeadlineSeconds and was stopped. {resume} "
        "If runs keep hitting it, raise k8s.active_deadline_seconds or put fewer partitions "
        "in a run (BackfillPolicy.multi_run(max_partitions_per_run=...)).",
    ),
    FailureRow(
        "image_pull",
        False,
        lambda f: f.waiting_reason in IMAGE_PULL_REASONS,
        "worker pod {f.pod} cannot pull image {f.image!r} ({f.waiting_reason}: "
        "{f.waiting_message_shown}). Not retried: fix k8s.image (name, tag, registry) or add "
        "k8s.secrets.image_pull, then re-run.",
        ("container_reason", "image"),
    ),
    FailureRow(
        "config_error",
        False,
        lambda f: f.waiting_reason in CONFIG_ERROR_REASONS,
        "worker pod {f.pod} could not create its container ({f.waiting_reason}: "
        f"{{f.waiting_message}}). {_MISSING_SECRET_HINT} in namespace {{f.namespace!r}}. "
        "Not retried: create it or fix the reference, then re-run.",
        ("container_reason",),
    ),
    FailureRow(
        "container_start",
        False,
        lambda f: f.container_reason in START_ERROR_REASONS,
        "worker pod {f.pod} could not start its container ({f.container_reason}, exit code "
        "{f.exit_code}: {f.container_message}). The image {f.image!r} cannot run k8s.command "
        "(default: python3 -m dagster_gpuinfer.worker). Not retried: fix k8s.image or "
        "k8s.command, then re-run.",
        ("exit_code", "container_reason", "image"),
    ),
    FailureRow(
        "deleted",
        True,
        lambda f: f.deleting,
        "worker pod {f.pod} was deleted from outside while it ran (it has a deletion "
        "timestamp). {resume}",
    ),
    FailureRow(
        "spec_refused",
        False,
        lambda f: f.exit_code == EXIT_SPEC_REFUSED and f.container_reason != "OOMKilled",
        "worker pod {f.pod} refused its job spec (exit code {f.exit_code}): the spec cannot "
        "run as given. Not retried: fix what the worker names below, then re-run. Last lines "
        "of the worker:\n{f.tail_shown}",
        ("exit_code",),
    ),
    FailureRow(
        "out_of_memory",
        True,
        lambda f: f.memory == "container_oom_killed",
        "worker pod {f.pod} was OOMKilled: the container used more than its memory "
        "limit (k8s.memory_limit).",
        _MEMORY_DETAIL,
    ),
    FailureRow(
        "kv_cache_too_small",
        False,
        lambda f: f.memory == "kv_cache_too_small",
        "worker pod {f.pod}: vLLM's KV cache cannot hold one sequence of "
        "max_model_len tokens. Not retried: lower engine max_model_len, raise "
        "gpu_memory_utilization, or raise tensor_parallel_size to spread the model "
        "over more GPUs. Last lines of the worker:\n{f.tail}",
        _MEMORY_DETAIL,
    ),
    FailureRow(
        "out_of_memory",
        True,
        lambda f: f.memory == "gpu_out_of_memory",
        "worker pod {f.pod} ran out of GPU memory (exit code {f.exit_code}). Last lines "
        "of the worker:\n{f.tail}",
        _MEMORY_DETAIL,
    ),
    FailureRow(
        "worker_crash",
        True,
        lambda f: f.crashed,
        "worker pod {f.pod} exited with code {f.exit_code}{f.signal}. {resume} "
        "Last lines of the worker:\n{f.tail_shown}",
        ("exit_code", "container_reason"),
    ),
    FailureRow(
        "unknown",
        True,
        lambda f: True,
        "worker pod {f.pod} failed: {f.error_line} (pod phase {f.phase}). {resume}",
        ("exit_code", "container_reason"),
    ),
)
"""The failure table, matched in order: the first row whose `matches` holds decides."""


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
        The first matching row of `FAILURE_TABLE`, with a message that says what happened
        and what to do.
    """
    facts = read_pod_facts(pod=pod, pod_name=pod_name, image=image, log_text=log_text, error=error)
    row = next(row for row in FAILURE_TABLE if row.matches(facts))
    detail: dict[str, Any] = {"pod": pod_name}
    if not facts.gone:
        detail.update({"phase": facts.phase, "pod_reason": facts.pod_reason})
    detail.update({name: getattr(facts, name) for name in row.detail})
    return PodFailure(
        row.kind,
        row.retryable,
        row.message.format(f=facts, resume=RESUME_NOTE),
        pod_name,
        detail,
    )


# --------------------------------------------------------------------------- before the pod runs


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
            f"({why}). {_MISSING_SECRET_HINT}. Not retried: create it or fix the reference, "
            "then re-run.",
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
            "(tensor_parallel_size x replicas), k8s.placement.gpu_type, tolerations and node "
            "capacity.",
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
    """The verdict for a pod that Kueue did not admit within `queue_timeout`."""
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
