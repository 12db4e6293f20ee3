"""The worker's life around its engines: they die with it, it dies with them, SIGTERM drains.

- **Engines die with the worker.** Every process the worker starts through multiprocessing's
  spawn (vLLM's `EngineCore`, replica processes) starts through a small launcher that asks
  the kernel to SIGKILL it when its parent dies (`PR_SET_PDEATHSIG`) and puts it in its own
  process group (so a SIGTERM sent to the worker's group reaches the worker, which drains,
  and not the engines it still needs for the drain). Forked children get the same on fork.
  A SIGKILL'd worker therefore leaves no engine holding a GPU. The resource tracker is
  exempt: it must outlive the worker to unlink the shared memory the worker leaked.
- **The worker dies with its engines.** `EngineWatch` polls the engine's processes; when one
  is gone (OOM-killed, crashed, SIGKILL'd) the worker logs which one, tells Dagster through
  Pipes, kills what is left and exits with `EXIT_ENGINE_DIED` (a crash, so Dagster's retry
  policy retries it and the retry resumes from the committed chunks) within seconds, instead
  of waiting for ever on an engine that will never answer.
- **SIGTERM drains.** Kubernetes sends SIGTERM on preemption and deletion. The first one
  stops the admission of new chunks (`draining()`), lets the chunks in flight finish and
  commit, and the worker exits with `EXIT_DRAINED` and a message saying what was committed;
  if the drain takes longer than `DRAIN_GRACE_ENV` seconds (default 60; the pod's
  `terminationGracePeriodSeconds` leaves room for it), the worker kills its engines and
  exits at once. A second SIGTERM exits at once too. The handler is installed
  explicitly, so it also works when the worker is PID 1 in its container (where a signal
  without a handler is ignored).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.spawn
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from dagster_gpuinfer.messages import EXIT_SPEC_REFUSED as _EXIT_SPEC_REFUSED

log = logging.getLogger("dagster_gpuinfer.worker")

EXIT_ENGINE_DIED = 75  # EX_TEMPFAIL: try again
EXIT_SPEC_REFUSED = _EXIT_SPEC_REFUSED  # EX_CONFIG: the spec cannot run, after a `fatal`
EXIT_DRAINED = 143  # 128 + SIGTERM, as a process killed by SIGTERM would exit
DRAIN_GRACE_ENV = "GPUINFER_DRAIN_GRACE_SECONDS"
DEFAULT_DRAIN_GRACE_SECONDS = 60.0
WATCH_SECONDS = 0.5
PR_SET_PDEATHSIG = 1

_drain = threading.Event()
_notify: list[Callable[[str], None]] = []

# The launcher every spawned child starts through: parent-death signal, own process group,
# then the real interpreter (exec keeps the pid, the signal setting and the passed fds).
LAUNCHER = """\
import ctypes, os, signal, sys
args = sys.argv[1:]
if not any("resource_tracker" in a for a in args):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(os.environ.get("GPUINFER_PARENT_PID", os.getppid())):
        os._exit(1)  # the parent died before the signal was armed
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
os.execv({python!r}, [{python!r}, *args])
"""


_forking_parent = [0]


def _remember_parent() -> None:
    _forking_parent[0] = os.getpid()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; else nothing).
    A forked child whose parent died before the signal was armed exits at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if _forking_parent[0] and os.getppid() != _forking_parent[0]:
        os._exit(1)


def children_die_with_this_process() -> None:
    """From now on every child this process spawns or forks dies when it dies."""
    if not sys.platform.startswith("linux"):
        return
    os.environ["GPUINFER_PARENT_PID"] = str(os.getpid())
    directory = tempfile.mkdtemp(prefix="gpuinfer-launcher-")
    launcher = os.path.join(directory, "python")
    with open(launcher, "w") as handle:
        handle.write(f"#!{sys.executable}\n" + LAUNCHER.format(python=sys.executable))
    os.chmod(launcher, 0o755)
    multiprocessing.spawn.set_executable(launcher)
    os.register_at_fork(before=_remember_parent, after_in_child=die_with_parent)


# --------------------------------------------------------------------------- engine death


class EngineWatch:
    """Polls an engine's processes; calls `on_death` (once) with a message naming the first
    one that is gone. `stop()` before shutting the engine down on purpose."""

    def __init__(
        self, processes: list[Any], *, name: str, on_death: Callable[[str], None] | None = None
    ) -> None:
        self.processes = processes
        self.titles = {p.pid: _title(p) for p in processes}
        self.name = name
        self.on_death = on_death or engine_died
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpuinfer-engine-watch")
        self._thread.daemon = True

    def start(self) -> EngineWatch:
        if self.processes:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def dead(self) -> str | None:
        """What is wrong, when one of the engine's processes is gone; else None."""
        import psutil

        for process in self.processes:
            try:
                alive = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                return (
                    f"the vLLM engine process {self.titles[process.pid]} (pid {process.pid}"
                    f"{_exit_code(process)}) of {self.name} is gone"
                )
        return None

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_SECONDS):
            problem = self.dead()
            if problem is not None and not self._stopped.is_set():
                self.on_death(problem)
                return


def _title(process: Any) -> str:
    try:
        return (process.cmdline() or [process.name()])[0]
    except Exception:
        return "?"


def _exit_code(process: Any) -> str:
    try:
        code = process.wait(timeout=0)
    except Exception:
        return ""
    if code is None:
        return ""
    return f", killed by signal {-code}" if code < 0 else f", exit code {code}"


def engine_processes_started_by(build: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """Run `build` (an engine constructor); return its result and the engine processes it
    started: this process's new direct children that are vLLM's (`VLLM::EngineCore`, by
    their title) or, where no title was set, spawned interpreters. Grandchildren (tensor
    parallel workers, compile workers that come and go) are the engine process's to watch:
    vLLM's engine process exits when one of its workers dies."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    built = build()
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    started = [p for p in me.children() if p.pid not in before and p.pid != tracker]
    titled = [p for p in started if "VLLM" in _title(p) or "EngineCore" in _title(p)]
    spawned = [p for p in started if "spawn_main" in " ".join(_cmdline(p))]
    return built, titled or spawned


def _cmdline(process: Any) -> list[str]:
    try:
        return process.cmdline()
    except Exception:
        return []


def engine_died(message: str) -> None:
    """An engine is gone: say so (log, Pipes), kill what is left, exit for a retry."""
    report_engine_death(message)
    hard_exit(EXIT_ENGINE_DIED)


def engine_death_text(message: str) -> str:
    """What the worker says when an engine died. It must not read as an out-of-memory
    message itself (`out_of_memory.memory_problem`): the k8s launcher classifies a failed
    pod from its log tail, and a dead engine is retried, while a second out-of-memory in one
    step is final (found by the chaos backfill, bench/chaos)."""
    return (
        f"{message}: the worker stops now (exit code {EXIT_ENGINE_DIED}, retryable); "
        "committed chunks are kept and a retry resumes from them. If this repeats, look for "
        "the engine's own error above (memory exhausted, a device fault)"
    )


def report_engine_death(message: str) -> int:
    """Log and tell (Pipes) that an engine died, what happens now and what to look for;
    returns the exit code the worker leaves with (`EXIT_ENGINE_DIED`)."""
    text = engine_death_text(message)
    log.error("%s", text)
    tell(text)
    return EXIT_ENGINE_DIED


# --------------------------------------------------------------------------- signals


def draining() -> bool:
    """Whether a SIGTERM asked the worker to stop admitting work."""
    return _drain.is_set()


def tell(text: str) -> None:
    """Send `text` to whoever listens (the Pipes log of the run), never raising."""
    for notify in list(_notify):
        try:
            notify(text)
        except Exception:  # a closed Pipes channel must not stop the exit
            pass


def on_notice(notify: Callable[[str], None]) -> None:
    """Also send drain and engine-death notices to `notify` (e.g. the Pipes log)."""
    _notify.append(notify)


def drain_grace_seconds() -> float:
    return float(os.environ.get(DRAIN_GRACE_ENV, DEFAULT_DRAIN_GRACE_SECONDS))


def install_signal_handlers() -> None:
    """SIGTERM: drain (a second one: exit now). Main thread only; SIGINT keeps Python's
    KeyboardInterrupt."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if _drain.is_set():
        log.error("second SIGTERM: stopping now without waiting for the chunks in flight")
        hard_exit(EXIT_DRAINED)
    _drain.set()
    grace = drain_grace_seconds()
    text = (
        f"SIGTERM: the worker stops admitting rows, lets the chunks in flight finish and "
        f"commit (at most {grace:.0f} s), then exits; a rerun resumes from the committed chunks"
    )
    log.warning("%s", text)
    threading.Thread(target=_tell_later, args=(text,), daemon=True).start()
    timer = threading.Timer(grace, _grace_exceeded, args=(grace,))
    timer.daemon = True
    timer.start()


def _tell_later(text: str) -> None:
    tell(text)  # not from the signal handler: the Pipes writer may hold its lock


def _grace_exceeded(grace: float) -> None:
    text = (
        f"the drain took more than {grace:.0f} s ({DRAIN_GRACE_ENV}); the worker stops now. "
        "Chunks not committed are recomputed by the rerun"
    )
    log.error("%s", text)
    tell(text)
    hard_exit(EXIT_DRAINED)


def hard_exit(code: int, *, grace_seconds: float = 3.0) -> None:
    """Kill every child (but the resource tracker), flush, and leave now."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    kill_children(grace_seconds)
    os._exit(code)


def kill_children(grace_seconds: float) -> None:
    """Terminate this process's children (and theirs), then kill those still alive."""
    try:
        import psutil
    except ImportError:
        return
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    try:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid != tracker]
    except psutil.Error:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_seconds)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
