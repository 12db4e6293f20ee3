"""The local launcher: the worker module as a subprocess, through `dagster.PipesSubprocessClient`.

Used by default, on laptops and in CI. The worker is the very module a pod runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dagster as dg

from dagster_gpuinfer.worker import WORKER_MODULE


def run_local_worker(
    *,
    context: dg.AssetExecutionContext,
    extras: Mapping[str, Any],
    python_executable: str,
    env: Mapping[str, str],
) -> list[Any]:
    """Run `python -m dagster_gpuinfer.worker` to completion; returns its Pipes messages.

    A non-zero exit (a crash, SIGKILL, out of memory) raises `DagsterPipesExecutionError`,
    which Dagster's retry policy may retry; user errors come back as a `fatal` message.
    """
    worker_env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **env}
    client = dg.PipesSubprocessClient(env=worker_env)
    invocation = client.run(
        context=context,
        command=[python_executable, "-m", WORKER_MODULE],
        extras=dict(extras),
    )
    return invocation.get_custom_messages()
