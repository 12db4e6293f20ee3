"""Dagster's own daemons (backfill, sensors, run queue, run retries) on a timer in a thread, and run
workers in threads: the pods' cluster (the pod executor) lives in this process, so the run
workers that talk to it must too.

The daemons are the real ones (`dagster-daemon run` runs the same iterations); a "daemon
restart" stops the loop, closes its workspace and starts a new one, while runs in flight
continue, as run workers outlive a restarted daemon pod. Run workers here are threads, so a
run worker's crash is not among the faults.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster._core.execution.api import execute_run
from dagster._core.launcher import LaunchRunContext, RunLauncher
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.test_utils import (
    InProcessTestWorkspaceLoadTarget,
    create_test_daemon_workspace_context,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._daemon.auto_run_reexecution.event_log_consumer import EventLogConsumerDaemon
from dagster._daemon.backfill import execute_backfill_iteration
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
    QueuedRunCoordinatorDaemon,
)
from dagster._daemon.sensor import execute_sensor_iteration
from dagster._serdes import ConfigurableClass
from dagster._serdes.config_class import ConfigurableClassData
from dagster._utils.hosted_user_process import recon_job_from_origin

DEFS_FILE = Path(__file__).with_name("defs.py")
REPO = Path(__file__).resolve().parents[2]
LOGGER = logging.getLogger("gpuinfer-chaos-daemon")
RUN_THREADS: list[threading.Thread] = []


class ThreadRunLauncher(RunLauncher, ConfigurableClass):
    """Starts each run's worker as a thread of this process (the run worker of a pod)."""

    def __init__(self, inst_data: ConfigurableClassData | None = None) -> None:
        self._inst_data = inst_data
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping) -> Any:
        return cls(inst_data=inst_data)

    def launch_run(self, context: LaunchRunContext) -> None:
        recon_job = recon_job_from_origin(context.job_code_origin)  # type: ignore[arg-type]
        run, instance = context.dagster_run, self._instance
        thread = threading.Thread(
            target=lambda: execute_run(recon_job, run, instance),
            name=f"run-{run.run_id[:8]}",
            daemon=True,
        )
        RUN_THREADS.append(thread)
        thread.start()

    def terminate(self, run_id: str) -> bool:
        return False


def instance_overrides(max_concurrent_runs: int) -> dict[str, Any]:
    """deploy/dagster.yaml's run queue and run retries; the thread run launcher."""
    return {
        "run_launcher": {"module": "bench.chaos.daemon", "class": "ThreadRunLauncher"},
        "run_coordinator": {
            "module": "dagster._core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {"max_concurrent_runs": max_concurrent_runs},
        },
        "run_retries": {"enabled": True, "max_retries": 2, "retry_on_asset_or_op_failure": False},
        # Captured step logs go to `tail -F` helper processes that end with their run
        # worker's process; run workers are threads here, so they would outlive the runs.
        "compute_logs": {
            "module": "dagster._core.storage.noop_compute_log_manager",
            "class": "NoOpComputeLogManager",
        },
    }


class Daemon:
    """`start()`, `restart()`, `stop()`; `errors` holds what an iteration raised."""

    def __init__(self, instance: Any, interval: float = 1.0) -> None:
        self.instance = instance
        self.interval = interval
        self.errors: list[str] = []
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="gpuinfer-chaos-defs-"))

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="chaos-daemon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def restart(self, down_seconds: float = 2.0) -> None:
        self.stop()
        self._stop.wait(0)  # the old loop is gone; its workspace closed with it
        threading.Event().wait(down_seconds)
        self.restarts += 1
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _origin(self) -> InProcessCodeLocationOrigin:
        defs_file = self._folder / f"chaos_defs_{uuid.uuid4().hex}.py"
        shutil.copyfile(DEFS_FILE, defs_file)
        target = LoadableTargetOrigin(
            python_file=str(defs_file), attribute="defs", working_directory=str(REPO)
        )
        return InProcessCodeLocationOrigin(target, location_name="gpuinfer_chaos")

    def _loop(self) -> None:
        queue = QueuedRunCoordinatorDaemon(interval_seconds=self.interval)
        retries = EventLogConsumerDaemon()
        load = InProcessTestWorkspaceLoadTarget(self._origin())
        with create_test_daemon_workspace_context(load, self.instance) as context:
            while not self._stop.is_set():
                for step in (
                    lambda: list(execute_backfill_iteration(context, LOGGER)),
                    lambda: list(execute_sensor_iteration(context, LOGGER, None, None)),
                    lambda: list(queue.run_iteration(context)),
                    lambda: list(retries.run_iteration(context)),
                ):
                    try:
                        for error in step():
                            if error is not None and hasattr(error, "to_string"):
                                self.errors.append(error.to_string())
                    except Exception as exc:  # noqa: BLE001 - a daemon logs and goes on
                        self.errors.append(repr(exc))
                self._stop.wait(self.interval)
        queue._exit_stack.close()  # noqa: SLF001 - its thread pool, as the daemon's close does
