"""Tick Dagster's own sensor and backfill daemons in-process, over `tests/daemon_defs.py`.

The daemons are the real ones (`dagster dev` runs the same iterations on a timer); only
the loop is driven by the test, the way Dagster's own daemon tests drive it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.test_utils import (
    InProcessTestWorkspaceLoadTarget,
    create_test_daemon_workspace_context,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._daemon.backfill import execute_backfill_iteration
from dagster._daemon.sensor import execute_sensor_iteration

DEFS_FILE = Path(__file__).with_name("daemon_defs.py")
REPO_ROOT = Path(__file__).resolve().parent.parent
LOGGER = logging.getLogger("gpuinfer-test-daemon")


@contextmanager
def daemon_workspace(instance: dg.DagsterInstance) -> Iterator[WorkspaceProcessContext]:
    """A workspace over a fresh copy of `daemon_defs.py`: an in-process code location keeps
    the module it loaded, so a copy under a new name is what makes it read the environment
    of this test instead of an earlier one's."""
    with tempfile.TemporaryDirectory() as directory:
        defs_file = Path(directory) / f"daemon_defs_{uuid.uuid4().hex}.py"
        shutil.copyfile(DEFS_FILE, defs_file)
        origin = InProcessCodeLocationOrigin(
            LoadableTargetOrigin(
                python_file=str(defs_file), attribute="defs", working_directory=str(REPO_ROOT)
            ),
            location_name="gpuinfer_test",
        )
        with create_test_daemon_workspace_context(
            InProcessTestWorkspaceLoadTarget(origin), instance
        ) as context:
            yield context


def _raise_errors(results) -> None:
    for error in results:
        if error is not None and hasattr(error, "to_string"):
            raise AssertionError(f"daemon iteration failed:\n{error.to_string()}")


def tick_sensors(context: WorkspaceProcessContext) -> None:
    """One sensor daemon iteration: evaluate every running sensor and act on its result."""
    _raise_errors(
        execute_sensor_iteration(
            context, LOGGER, threadpool_executor=None, submit_threadpool_executor=None
        )
    )


def tick_backfills(context: WorkspaceProcessContext) -> None:
    """One backfill daemon iteration: plan and launch the runs of every requested backfill."""
    _raise_errors(execute_backfill_iteration(context, LOGGER))
