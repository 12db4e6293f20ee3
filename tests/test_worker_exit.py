"""The worker's exit after its protocol: no interpreter teardown, and no child left behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys
    from multiprocessing import resource_tracker, shared_memory
    from dagster_gpuinfer.worker.__main__ import exit_now

    # Shared memory left behind, as vLLM's message queues leave it: the tracker unlinks it.
    leaked = shared_memory.SharedMemory(create=True, size=4096)
    # A child that ignores nothing and would outlive us: as a hung engine process would.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, resource_tracker._resource_tracker._pid, leaked.name, flush=True)
    print("last words", end="")
    exit_now(7, grace_seconds=2)
    """
)


def test_exit_now_flushes_keeps_the_code_and_leaves_no_child_but_the_resource_tracker() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 7, done.stderr
    first, last = done.stdout.splitlines()
    child, tracker, shm_name = first.split()
    child_pid, tracker_pid = int(child), int(tracker)
    assert last == "last words"  # written without a newline, still flushed
    assert gone(child_pid)
    # The tracker is left to see our exit and clean up shared memory itself; it then exits.
    try:
        psutil.Process(tracker_pid).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass
    assert gone(tracker_pid)
    assert not (Path("/dev/shm") / shm_name.lstrip("/")).exists(), "the tracker was killed"


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for its new parent to reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_refused_spec_exits_78_after_its_fatal_message(tmp_path: Path) -> None:
    """A spec the worker refuses (here: no model directory) is reported as a `fatal` Pipes
    message, and the process exits EX_CONFIG (78), not 0: a pod that refused its job must
    not read as Succeeded, and the launchers fail the step without a retry."""
    import json

    from dagster_gpuinfer.worker.lifecycle import EXIT_SPEC_REFUSED

    missing = tmp_path / "models" / "nope"
    spec = {
        "model": str(missing),
        "task": "embed",
        "input": {"uri": str(tmp_path / "in" / "{partition_key}.parquet")},
        "output": {"root": str(tmp_path / "out"), "asset_name": "emb"},
        "partition_keys": ["p0"],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "dagster_gpuinfer.worker", "--spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    messages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [m["type"] for m in messages] == ["fatal"], done.stdout + done.stderr
    assert f"model directory {str(missing)!r} does not exist" in messages[0]["message"]
    assert done.returncode == EXIT_SPEC_REFUSED == 78, done.stderr
