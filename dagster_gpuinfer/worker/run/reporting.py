"""`parse_spec` (the job spec a worker is handed) and `MessageReporter`: the worker's messages
(`dagster_gpuinfer.messages`) as dicts, handed to whoever carries them: Dagster Pipes
(`__main__`), stdout (`--spec`), or a pool worker's item result in the lease queue
(`worker/pool/`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dagster_gpuinfer.messages import (
    Fatal,
    PartitionCommitted,
    PartitionFailed,
    RunFinished,
    to_payload,
)
from dagster_gpuinfer.secrets import validation_problems
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest
from dagster_gpuinfer.worker.errors import SpecError, WorkerError, cap_message


class MessageReporter:
    """Sends the worker's messages (`dagster_gpuinfer.messages`) to `emit` (Pipes custom
    messages, or stdout)."""

    def __init__(self, emit: Any) -> None:
        self.emit = emit

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None:
        self.emit(to_payload(PartitionCommitted(computed=computed, manifest=manifest)))

    def partition_failed(self, exc: WorkerError) -> None:
        self.emit(to_payload(PartitionFailed(**_error_fields(exc))))

    def run_finished(self, summary: dict[str, Any]) -> None:
        self.emit(to_payload(RunFinished.model_validate(summary)))

    def fatal(self, exc: WorkerError) -> None:
        self.emit(to_payload(Fatal(**_error_fields(exc))))


def _error_fields(exc: WorkerError) -> dict[str, Any]:
    return {
        "error_type": exc.error_type,
        "message": cap_message(str(exc)),
        "partition_key": exc.partition_key,
    }


def parse_spec(raw: Any) -> InferenceSpec:
    if raw is None:
        raise SpecError(
            "the worker got no job spec: Pipes extras (or the lease's job payload) hold no 'spec'"
        )
    try:
        return InferenceSpec.model_validate(raw)
    except ValidationError as exc:
        # Never `str(exc)`: it would echo a refused value, which may be a credential.
        problems = "; ".join(validation_problems(exc))
        raise SpecError(f"the job spec does not validate: {problems}") from None
