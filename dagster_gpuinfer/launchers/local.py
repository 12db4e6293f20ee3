"""The local launcher: the worker module as a subprocess in a Dagster Pipes session.

Used by default, on laptops and in CI. The worker is the very module a pod runs. The session
is `dagster.PipesSubprocessClient`'s (temp-file context and messages, stdio forwarded,
SIGINT forwarded on interruption), opened here so that the worker's messages survive its
non-zero exit after a refused spec (`EXIT_SPEC_REFUSED`): the client raises on any non-zero
exit and drops them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

import dagster as dg

from dagster_gpuinfer.messages import EXIT_SPEC_REFUSED
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.worker import WORKER_MODULE

TERMINATION_TIMEOUT_SECONDS = 20.0


class LocalLauncher:
    """`Launcher`: one worker subprocess per step (`run_local_worker`)."""

    def __init__(self, *, python_executable: str, env: Mapping[str, str]) -> None:
        self.python_executable = python_executable
        self.env = dict(env)

    def launch(
        self,
        *,
        context: dg.AssetExecutionContext,
        spec: InferenceSpec,
        extras: Mapping[str, Any],
        launch_attempt: int = 0,
    ) -> list[Any]:
        del spec, launch_attempt  # the spec travels in `extras`; no step-down locally
        return run_local_worker(
            context=context,
            extras=extras,
            python_executable=self.python_executable,
            env=self.env,
        )


def run_local_worker(
    *,
    context: dg.AssetExecutionContext,
    extras: Mapping[str, Any],
    python_executable: str,
    env: Mapping[str, str],
) -> list[Any]:
    """Run `python -m dagster_gpuinfer.worker` to completion; returns its Pipes messages.

    A refused spec (exit `EXIT_SPEC_REFUSED`) returns its messages, whose `fatal` one the
    resource turns into a non-retryable Failure. Any other non-zero exit (a crash, SIGKILL,
    out of memory, a dead engine) raises `DagsterPipesExecutionError`, which Dagster's retry
    policy may retry.
    """
    from dagster._core.errors import DagsterPipesExecutionError

    worker_env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **env}
    with dg.open_pipes_session(
        context=context,
        context_injector=dg.PipesTempFileContextInjector(),
        message_reader=dg.PipesTempFileMessageReader(),
        extras=dict(extras),
    ) as session:
        process = subprocess.Popen(
            [python_executable, "-m", WORKER_MODULE],
            env={**os.environ, **worker_env, **session.get_bootstrap_env_vars()},
        )
        try:
            code = process.wait()
        except dg.DagsterExecutionInterruptedError:
            context.log.info("[pipes] execution interrupted, sending SIGINT to the worker.")
            process.send_signal(signal.SIGINT)
            process.wait(timeout=TERMINATION_TIMEOUT_SECONDS)
            raise
    if code not in (0, EXIT_SPEC_REFUSED):
        raise DagsterPipesExecutionError(f"the worker process failed with exit code {code}")
    messages = session.get_custom_messages()
    if code == EXIT_SPEC_REFUSED and not any(_is_fatal(m) for m in messages):
        raise dg.Failure(
            description=f"the worker refused its job spec (exit code {code}) without saying "
            "why through Pipes; its log above names the problem. Not retried: fix the spec, "
            "then re-run.",
            allow_retries=False,
        )
    return messages


def _is_fatal(message: Any) -> bool:
    return isinstance(message, Mapping) and message.get("type") == "fatal"
