"""The pod start split (queued behind Kueue, scheduling, container start) from real
`kubernetes.client` models, and the launcher's wait recording it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from dagster_k8s.client import DagsterKubernetesClient
from kubernetes.client import (
    CoreV1Event,
    V1Container,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSchedulingGate,
    V1PodSpec,
    V1PodStatus,
)

from dagster_gpuinfer.k8s.client import GpuWorkerPipesClient
from dagster_gpuinfer.k8s.timing import (
    StartObserver,
    pod_start_timing,
    start_timing_message,
)

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def pod(
    *,
    gated: bool = False,
    scheduled: float | None = None,
    running: float | None = None,
    terminated: bool = False,
) -> V1Pod:
    """A worker pod as the API returns it at some point of its start."""
    conditions = []
    statuses = []
    if gated:
        conditions.append(
            V1PodCondition(
                type="PodScheduled",
                status="False",
                reason="SchedulingGated",
                last_transition_time=at(0),
            )
        )
    elif scheduled is not None:
        conditions.append(
            V1PodCondition(type="PodScheduled", status="True", last_transition_time=at(scheduled))
        )
    if running is not None:
        state = (
            V1ContainerState(
                terminated=V1ContainerStateTerminated(
                    exit_code=0, started_at=at(running), finished_at=at(running + 100)
                )
            )
            if terminated
            else V1ContainerState(running=V1ContainerStateRunning(started_at=at(running)))
        )
        statuses.append(
            V1ContainerStatus(
                name="worker", image="w", image_id="", ready=True, restart_count=0, state=state
            )
        )
    elif scheduled is not None:
        statuses.append(
            V1ContainerStatus(
                name="worker",
                image="w",
                image_id="",
                ready=False,
                restart_count=0,
                state=V1ContainerState(waiting=V1ContainerStateWaiting(reason="ContainerCreating")),
            )
        )
    return V1Pod(
        metadata=V1ObjectMeta(
            name="gpuinfer-docs-abc-r0-a0", namespace="team-a", creation_timestamp=at(0)
        ),
        spec=V1PodSpec(
            containers=[V1Container(name="worker", image="w")],
            scheduling_gates=[V1PodSchedulingGate(name="kueue.x-k8s.io/admission")]
            if gated
            else None,
            node_name="gpu-node-1" if scheduled is not None else None,
        ),
        status=V1PodStatus(
            phase="Running" if running is not None else "Pending",
            conditions=conditions,
            container_statuses=statuses or None,
        ),
    )


def test_pod_without_kueue_gate_was_admitted_when_created():
    timing = pod_start_timing(pod(scheduled=2, running=47))
    assert not timing.gated_by_kueue
    assert timing.seconds() == {
        "queued_seconds": 0.0,
        "scheduling_seconds": 2.0,
        "container_start_seconds": 45.0,
        "admission_to_running_seconds": 47.0,
    }


def test_kueue_admission_observed_by_the_launcher_splits_queue_from_start():
    timing = pod_start_timing(
        pod(scheduled=605, running=650, terminated=True), admitted_at=at(600), was_gated=True
    )
    assert timing.gated_by_kueue
    assert timing.seconds() == {
        "queued_seconds": 600.0,
        "scheduling_seconds": 5.0,
        "container_start_seconds": 45.0,
        "admission_to_running_seconds": 50.0,
    }


def test_admission_seen_only_after_binding_is_capped_at_the_binding():
    """Admitted and bound between two polls: the observation comes late, the binding
    time bounds it (admission cannot follow the binding)."""
    timing = pod_start_timing(pod(scheduled=300, running=320), admitted_at=at(330), was_gated=True)
    assert timing.seconds()["queued_seconds"] == 300.0
    assert timing.seconds()["scheduling_seconds"] == 0.0


def test_scheduled_event_stands_in_for_a_missing_condition():
    bare = pod(running=30)
    event = CoreV1Event(
        metadata=V1ObjectMeta(name="e"),
        reason="Scheduled",
        involved_object=V1ObjectReference(kind="Pod", name="gpuinfer-docs-abc-r0-a0"),
        type="Normal",
        first_timestamp=at(4),
    )
    timing = pod_start_timing(bare, events=[event])
    assert timing.seconds()["scheduling_seconds"] == 4.0
    assert timing.seconds()["container_start_seconds"] == 26.0


def test_unknown_instants_stay_unknown():
    timing = pod_start_timing(V1Pod(metadata=V1ObjectMeta(name="p")))
    assert set(timing.seconds().values()) == {None}
    message = start_timing_message(None)
    assert message == {"type": "pod_start", "gated_by_kueue": False}


def test_observer_notes_the_poll_at_which_the_gate_went_away():
    clock = [T0.timestamp()]
    observer = StartObserver(now=lambda: clock[0])
    for state in ("queued", "queued"):
        observer.observe(state)
        clock[0] += 60
    observer.observe("unschedulable")  # admitted: gate gone, waiting for a node
    clock[0] += 60
    observer.observe("started")
    assert observer.was_gated
    assert observer.admitted_at == at(120)


class ScriptedPods:
    """A CoreV1Api that returns the next scripted pod at each poll."""

    def __init__(self, pods: list[V1Pod]) -> None:
        self.pods = pods

    def _next(self) -> V1Pod:
        return self.pods.pop(0) if len(self.pods) > 1 else self.pods[0]

    def list_namespaced_pod(self, namespace: str, field_selector: str = "", **_):
        return V1PodList(items=[self._next()])

    def read_namespaced_pod(self, name: str, namespace: str, **_):
        return self._next()


def test_launcher_wait_records_the_start_split():
    clock = [T0.timestamp()]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    polls = [pod(gated=True)] * 3 + [pod(scheduled=32)] + [pod(scheduled=32, running=75)]
    client = DagsterKubernetesClient(
        batch_api=None,
        core_api=ScriptedPods(polls),
        logger=lambda *a, **k: None,
        sleeper=sleep,
        timer=lambda: clock[0],
    )
    launcher = GpuWorkerPipesClient(
        kubernetes_client=lambda: client, pod_pending_timeout=600.0, poll_interval=10.0
    )
    launcher.wait_until_started(
        client, name="gpuinfer-docs-abc-r0-a0", namespace="team-a", image="w", queue="gpu-inference"
    )
    seconds = launcher.start_timing.seconds()
    # gated at the polls at 0, 10 and 20 s; the gate was seen gone at 30 s
    assert seconds["queued_seconds"] == 30.0
    assert seconds["scheduling_seconds"] == 2.0
    assert seconds["container_start_seconds"] == 43.0
    assert start_timing_message(launcher.start_timing)["gated_by_kueue"] is True


def test_the_launchers_message_becomes_the_runs_queue_and_start_metadata():
    from dagster_gpuinfer.resource import GpuInferenceResource, InferenceRunResult
    from dagster_gpuinfer.run_metrics import run_timing, run_timing_metadata

    timing = pod_start_timing(pod(scheduled=605, running=650), admitted_at=at(600), was_gated=True)
    result = InferenceRunResult()
    GpuInferenceResource._collect(
        [
            {"type": "run", "model_loads": 1, "model_load_seconds": 41.5},
            start_timing_message(timing),
        ],
        result,
    )
    assert run_timing(result) == {
        "queued_seconds": 600.0,
        "pod_start_seconds": 50.0,
        "start_seconds": "n/a",  # this run message carries no worker split
        "load_seconds": 41.5,
        "inference_seconds": "n/a",
        "commit_seconds": "n/a",  # no partition computed
        "shutdown_seconds": "n/a",
    }
    metadata = run_timing_metadata(result)
    assert metadata["run_queued_seconds"] == 600.0
    assert metadata["run_pod_start"].data["container_start_seconds"] == 45.0
