"""`Launcher`: the one interface the resource launches through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import dagster as dg

from dagster_gpuinfer.spec import InferenceSpec


class Launcher(Protocol):
    """Runs one job spec to its end and returns the worker messages it produced."""

    def launch(
        self,
        *,
        context: dg.AssetExecutionContext,
        spec: InferenceSpec,
        extras: Mapping[str, Any],
        launch_attempt: int = 0,
    ) -> list[Any]:
        """Run `spec` (its `partition_keys` are the partitions to commit).

        Args:
            context: The step's context: logs, run id and tags, interruption.
            spec: The job spec as the resource prepared it.
            extras: The Pipes extras (`{"spec": spec as JSON}`).
            launch_attempt: 0, or 1 for the relaunch after an out-of-memory step-down.

        Returns:
            The worker messages (JSON dicts: `partition`, `partition_failed`, `run`,
            `fatal`, and the launcher's own `pod_start` / `pool_lease`).

        Raises:
            dagster.DagsterExecutionInterruptedError: the run was interrupted; the launcher
                stopped its work first.
        """
        ...
