"""The worker's Pipes messages: written by `worker/__main__.py`, read by `resource.py`.

Each message is a pydantic model with a literal `type`, the key Dagster Pipes custom
messages carry them under. Both sides import this module (pydantic and `storage` only), so
a field added here is written and read the same way. To add a message, add a model with a
new `type` to `WorkerMessage`; a control plane that does not know a type skips it.

- `partition`: one partition committed (its manifest), computed now or found committed;
- `partition_failed`: one shard that cannot be processed; the other partitions go on;
- `run`: once, the run's summary (model loads, timings);
- `fatal`: the spec cannot run; the control plane fails the step, not retried;
- `pod_start`: written by the Kubernetes launcher, not the worker: the pod's start split;
- `pool_lease`: written by the pool launcher, not the worker: how one partition ran on an
  engine pool (warm engine or not, queue wait, leases).

After a `fatal` message the worker exits `EXIT_SPEC_REFUSED` (78, EX_CONFIG), so a pod or
process that refused its job never reads as succeeded; the launchers fail the step without
a retry on it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from dagster_gpuinfer.storage import Manifest

# The worker's exit code after a `fatal` message (sysexits' EX_CONFIG): the job spec cannot
# run; retrying will not help.
EXIT_SPEC_REFUSED = 78


class PartitionCommitted(BaseModel):
    """A partition is committed: `computed` now, or found committed for this spec."""

    type: Literal["partition"] = "partition"
    computed: bool
    manifest: Manifest


class _WorkerErrorMessage(BaseModel):
    error_type: str = Field(description="The worker error's kind, e.g. bad_shard, bad_spec.")
    message: str = Field(description="What happened, which input, and what to do.")
    partition_key: str | None = None


class PartitionFailed(_WorkerErrorMessage):
    """A shard cannot be processed (missing, unreadable, missing a column)."""

    type: Literal["partition_failed"] = "partition_failed"


class Fatal(_WorkerErrorMessage):
    """The spec cannot run (model directory, engine arguments); the worker stops."""

    type: Literal["fatal"] = "fatal"


class RunFinished(BaseModel):
    """The run's summary, sent once at the end. Fields beyond these are kept as they come."""

    model_config = ConfigDict(extra="allow")

    type: Literal["run"] = "run"
    partitions: int = 0
    partitions_computed: int = 0
    partitions_failed: int = 0
    partitions_skipped: int = 0
    replicas: int = 0
    model_loads: int = 0
    load_seconds: float | None = None  # slowest engine build; older workers: model_load_seconds
    wall_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The summary as a plain dict, without `type` (what run metadata is built from)."""
        return self.model_dump(mode="json", exclude={"type"})


class PodStart(BaseModel):
    """The Kubernetes launcher's own message (k8s/timing.py): how long the worker pod queued
    behind Kueue admission, was scheduled and started. Fields are kept as they come."""

    model_config = ConfigDict(extra="allow")

    type: Literal["pod_start"] = "pod_start"

    def timing(self) -> dict[str, Any]:
        """The timing as a plain dict, without `type`."""
        return self.model_dump(mode="json", exclude={"type"})


class PoolLease(BaseModel):
    """The pool launcher's own message (launchers/pool.py): how one partition ran on an
    engine pool, from the queue's item status and the worker's item result."""

    type: Literal["pool_lease"] = "pool_lease"
    partition_key: str
    worker_id: str | None = None
    warm: bool = Field(description="The engine was already built when the lease came.")
    engine_load_seconds: float = Field(0.0, description="Engine build for this lease; 0 warm.")
    queue_wait_s: float | None = Field(None, description="Submission to first lease.")
    leases: int = Field(description="Times the item was leased (above 1: redone leases).")

    def facts(self) -> dict[str, Any]:
        """The facts as a plain dict, without `type` and `partition_key`."""
        return self.model_dump(mode="json", exclude={"type", "partition_key"})


_MESSAGE_MODELS = (PartitionCommitted, PartitionFailed, RunFinished, Fatal, PodStart, PoolLease)
WorkerMessage = Annotated[
    PartitionCommitted | PartitionFailed | RunFinished | Fatal | PodStart | PoolLease,
    Field(discriminator="type"),
]
_WORKER_MESSAGE: TypeAdapter[Any] = TypeAdapter(WorkerMessage)
KNOWN_TYPES = frozenset(model.model_fields["type"].default for model in _MESSAGE_MODELS)


def to_payload(message: BaseModel) -> dict[str, Any]:
    """`message` as the JSON-ready dict a Pipes custom message carries."""
    return message.model_dump(mode="json")


def parse_message(payload: Any) -> WorkerMessage | None:
    """The worker message in a Pipes custom message payload; None for anything else (not a
    dict, or a `type` this control plane does not know, from a newer worker).

    Raises:
        pydantic.ValidationError: a known message type with missing or malformed fields.
    """
    if not isinstance(payload, dict) or payload.get("type") not in KNOWN_TYPES:
        return None
    return _WORKER_MESSAGE.validate_python(payload)
