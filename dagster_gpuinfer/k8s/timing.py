"""Where a worker pod's start time went: queued behind Kueue, then scheduling and container
start, computed from the pod object the Kubernetes API returns.

Pure functions over `V1Pod` / `CoreV1Event` objects (or anything shaped like them): no API
calls, so tests build real `kubernetes.client` models and check the split.

- created: `metadata.creationTimestamp`.
- admitted: when Kueue removed its scheduling gate (`kueue.x-k8s.io/admission`). The pod
  keeps no timestamp of that, so the launcher observes it at its poll interval
  (`StartObserver`); a pod that never carried the gate was admitted when it was created.
- scheduled: the `PodScheduled` condition's transition to True (or the scheduler's
  `Scheduled` event).
- running: the worker container's `state.running.startedAt` (or `terminated.startedAt`).

The split: `queued_seconds` = admitted - created, `scheduling_seconds` = scheduled -
admitted, `container_start_seconds` = running - scheduled (image pull, volume mounts),
`admission_to_running_seconds` = running - admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
WORKER_CONTAINER = "worker"


@dataclass(frozen=True)
class PodStartTiming:
    """The instants a worker pod went through on its way to running (UTC)."""

    created_at: datetime | None
    admitted_at: datetime | None
    scheduled_at: datetime | None
    running_at: datetime | None
    gated_by_kueue: bool

    def seconds(self) -> dict[str, float | None]:
        """The split in seconds; None where an instant is unknown."""
        return {
            "queued_seconds": _between(self.created_at, self.admitted_at),
            "scheduling_seconds": _between(self.admitted_at, self.scheduled_at),
            "container_start_seconds": _between(self.scheduled_at, self.running_at),
            "admission_to_running_seconds": _between(self.admitted_at, self.running_at),
        }


def _between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(0.0, (end - start).total_seconds()), 3)


def _utc(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):  # a pod read as JSON rather than deserialised
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def carries_kueue_gate(pod: Any) -> bool:
    gates = getattr(getattr(pod, "spec", None), "scheduling_gates", None) or []
    return any(gate.name == KUEUE_ADMISSION_GATE for gate in gates)


def scheduled_at(pod: Any, events: Iterable[Any] = ()) -> datetime | None:
    """When the scheduler bound the pod: its PodScheduled=True condition, else its event."""
    for condition in getattr(getattr(pod, "status", None), "conditions", None) or []:
        if condition.type == "PodScheduled" and condition.status == "True":
            return _utc(condition.last_transition_time)
    for event in events:
        if getattr(event, "reason", None) == "Scheduled":
            return _utc(
                getattr(event, "event_time", None) or getattr(event, "first_timestamp", None)
            )
    return None


def container_running_at(pod: Any, container: str = WORKER_CONTAINER) -> datetime | None:
    """When the worker container started (it may have ended since)."""
    for status in getattr(getattr(pod, "status", None), "container_statuses", None) or []:
        if status.name != container or status.state is None:
            continue
        for state in (status.state.running, status.state.terminated):
            if state is not None and state.started_at is not None:
                return _utc(state.started_at)
    return None


def pod_start_timing(
    pod: Any,
    *,
    events: Iterable[Any] = (),
    admitted_at: datetime | None = None,
    was_gated: bool = False,
) -> PodStartTiming:
    """The start timing of `pod` as the API reports it.

    Args:
        pod: The pod (`V1Pod`), read once its container runs.
        events: Its events (`CoreV1Event`), for the `Scheduled` event when the condition lacks.
        admitted_at: When the launcher saw Kueue's gate gone (None if it never saw it).
        was_gated: The launcher saw the pod gated by Kueue at least once.
    """
    created = _utc(getattr(getattr(pod, "metadata", None), "creation_timestamp", None))
    gated = was_gated or carries_kueue_gate(pod)
    if admitted_at is None and not gated:
        admitted_at = created  # no gate: nothing to be admitted by
    admitted_at = _utc(admitted_at)
    scheduled = scheduled_at(pod, events)
    if admitted_at is not None and scheduled is not None and admitted_at > scheduled:
        admitted_at = scheduled  # admitted between two polls: it cannot follow the binding
    return PodStartTiming(
        created_at=created,
        admitted_at=admitted_at,
        scheduled_at=scheduled,
        running_at=container_running_at(pod),
        gated_by_kueue=gated,
    )


class StartObserver:
    """Follows a pod through the launcher's polls and notes when Kueue admitted it.

    Call `observe(state)` with each poll's `pod_start_state` verdict (`queued` while the
    Kueue gate is on), then `timing(pod)` once it runs.

    Args:
        now: Wall-clock seconds since the epoch: the launcher's client timer (`time.time`
            in production, a fake clock in tests).
    """

    def __init__(self, now: Callable[[], float] = time.time):
        self.now = now
        self.was_gated = False
        self.admitted_at: datetime | None = None

    def observe(self, state: str) -> None:
        if state == "queued":
            self.was_gated = True
            self.admitted_at = None
        elif self.was_gated and self.admitted_at is None:
            self.admitted_at = datetime.fromtimestamp(self.now(), UTC)

    def timing(self, pod: Any, events: Iterable[Any] = ()) -> PodStartTiming:
        return pod_start_timing(
            pod, events=events, admitted_at=self.admitted_at, was_gated=self.was_gated
        )


def start_timing_message(timing: PodStartTiming | None) -> dict[str, Any]:
    """The launcher's own message beside the worker's Pipes messages: the pod start split."""
    seconds = timing.seconds() if timing is not None else {}
    return {
        "type": "pod_start",
        "gated_by_kueue": bool(timing and timing.gated_by_kueue),
        **seconds,
    }
