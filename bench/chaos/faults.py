"""The seeded fault schedule and the injector that carries it out during a backfill.

Kinds (every one a thing a fleet meets):
- `pod_delete`: preemption: the DisruptionTarget condition, then a graceful delete
  (SIGTERM, the pod's grace period, SIGKILL);
- `engine_kill`: SIGKILL to the vLLM engine process (EngineCore) inside a worker pod;
- `worker_kill`: SIGKILL to the worker's main process (the container ends 137, not OOM);
- `oom`: the kernel's OOM killer: every process of the pod SIGKILLed, reason OOMKilled;
- `s3_5xx`, `s3_slow`, `s3_reset`: a window of S3 faults from the proxy (bench/chaos/s3_proxy.py),
  opened once a worker pod has built its engine (when S3 is in use);
- `daemon_restart`: the Dagster daemon stopped and started again (runs in flight go on);
- `postgres_restart`, `batch_api_restart`: bench/chaos/store_faults.py.
- `pool_worker_kill`, `follower_kill` (`--mode pools` only, bench/chaos/pool_faults.py):
  SIGKILL to a pool worker holding a lease; the follower pod of a 2-node group lost.

The schedule is a pure function of the seed: times, kinds and parameters. A pod fault waits
for a worker pod to hit (chosen by the seeded generator among the live ones) and keeps within
what the deployment promises to absorb: at most `max_retries` failing faults per run (the
assets' RetryPolicy; an S3 window counts against the runs at work when it opens) and one
OOMKilled per run (a second out-of-memory in one step is, by design, a non-retryable
Failure: the step-down did not help).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.chaos import store_faults
from bench.chaos.store_faults import STORE_FAULTS

POD_FAULTS = ("pod_delete", "engine_kill", "worker_kill", "oom")
S3_FAULTS = ("s3_5xx", "s3_slow", "s3_reset")
KINDS = (*POD_FAULTS, *S3_FAULTS, "daemon_restart", *STORE_FAULTS)
POOL_KINDS = ("pool_worker_kill", "follower_kill")  # --mode pools (bench/chaos/pool_faults.py)
READY = "engine ready in"  # the worker's log line once its engine is built


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the backfill was requested
    kind: str
    seconds: float = 0.0  # S3 window length, daemon down time
    rate: float = 0.0  # S3: share of requests hit in the window


def schedule(seed: int, count: int, span_s: float, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """`count` faults over `span_s` seconds: every kind once while `count` allows (in a seeded
    order), the rest drawn at random; sorted by time."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    chosen = order[:count] + [rng.choice(kinds) for _ in range(count - len(order))]
    times = sorted(rng.uniform(0.08, 0.85) * span_s for _ in chosen)
    faults = []
    for at, kind in zip(times, chosen, strict=True):
        seconds = rng.uniform(8, 20) if kind in S3_FAULTS else rng.uniform(1, 5)
        rate = rng.uniform(0.15, 0.4) if kind in S3_FAULTS else 0.0
        faults.append(Fault(round(at, 1), kind, round(seconds, 1), round(rate, 2)))
    return faults


@dataclass
class Injected:
    fault: Fault
    at: float  # when it was done, seconds after the start
    target: str  # pod name, "proxy" or "daemon"
    note: str = ""


@dataclass
class Injector:
    """Carries out `faults` against the cluster's executor, the proxy and the daemon."""

    faults: list[Fault]
    executor: Any
    proxy: Any
    daemon: Any
    seed: int
    max_pod_faults_per_run: int = 2
    give_up_s: float = 600.0
    stores: Any = None  # bench/chaos/store_faults.py's Stores: STORE_FAULTS' target
    pools: Any = None  # pool_faults.PoolChaos in --mode pools: targets and hits of POOL_KINDS
    done: list[Injected] = field(default_factory=list)
    skipped: list[Fault] = field(default_factory=list)
    _per_run: Counter = field(default_factory=Counter)
    _oom_runs: set = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, started: float) -> threading.Thread:
        thread = threading.Thread(target=self._loop, args=(started,), daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def _loop(self, started: float) -> None:
        rng = random.Random(self.seed * 7919 + 1)
        for index, fault in enumerate(self.faults):
            if self._stop.wait(max(0.0, started + fault.at - time.monotonic())):
                self.skipped += self.faults[index:]  # the backfill ended first
                return
            if fault.kind in S3_FAULTS:
                self._s3_window(fault, started)
            elif fault.kind == "postgres_restart" and self.pools and self.pools.queue_on_store:
                # the pool's lease queue is on the restarted server: restart it under live
                # leases, waiting in its own thread (the pool's run may come later)
                child = random.Random(rng.random())
                ready = self.pools.live_leases
                args = (self, fault, child, started, ready)
                threading.Thread(target=store_faults.inject, args=args, daemon=True).start()
            elif fault.kind in STORE_FAULTS:
                store_faults.inject(self, fault, rng, started)
            elif fault.kind in POOL_KINDS:  # waits in its own thread: its run may come later
                child = random.Random(rng.random())
                args = (fault, child, started)
                threading.Thread(target=self._pod_fault, args=args, daemon=True).start()
            elif fault.kind == "daemon_restart":
                self.daemon.restart(fault.seconds)
                self.done.append(Injected(fault, time.monotonic() - started, "daemon"))
            else:
                self._pod_fault(fault, rng, started)

    def _s3_window(self, fault: Fault, started: float) -> None:
        """Open the window once a worker is past its engine build (reading and writing S3):
        a window during an engine build would meet no request."""
        deadline = time.monotonic() + self.give_up_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            working = [p for p in self._targets(fault.kind) if READY in p.text()]
            if working:
                self.proxy.open_window(fault.kind, fault.seconds, fault.rate)
                # A window can fail an attempt of the runs at work (a worker's or the step's
                # own S3 call past its retries): it spends one of their retries.
                for run in {p.labels.get("dagster/run-id", p.name) for p in working}:
                    self._per_run[run] += 1
                elapsed = time.monotonic() - started
                note = f"while {working[0].name} works"
                self.done.append(Injected(fault, elapsed, "proxy", note))
                return
            self._stop.wait(0.5)
        self.skipped.append(fault)

    def _pod_fault(self, fault: Fault, rng: random.Random, started: float) -> None:
        deadline = time.monotonic() + self.give_up_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            candidates = [pod for pod in self._targets(fault.kind) if self._allowed(pod, fault)]
            if candidates:
                pod = rng.choice(sorted(candidates, key=lambda p: p.name))
                note = self._hit(pod, fault.kind)
                if note is not None:
                    self._count(pod, fault)
                    self.done.append(Injected(fault, time.monotonic() - started, pod.name, note))
                    return
            self._stop.wait(0.5)
        self.skipped.append(fault)

    def _targets(self, kind: str) -> list[Any]:
        with self.executor._lock:  # noqa: SLF001 - the executor's own state lock
            pods = list(self.executor.pods.values())
        live = [
            pod
            for pod in pods
            if pod.process is not None
            and not pod.terminated
            and pod.deletion_requested_at is None
            and not pod.oom_injected
            and (kind != "engine_kill" or _engine_processes(pod))
        ]
        if kind in POOL_KINDS:
            return self.pools.targets(kind, live) if self.pools is not None else []
        return live

    def _allowed(self, pod: Any, fault: Fault) -> bool:
        run = pod.labels.get("dagster/run-id", pod.name)
        if fault.kind == "oom":
            return run not in self._oom_runs
        return self._per_run[run] < self.max_pod_faults_per_run

    def _count(self, pod: Any, fault: Fault) -> None:
        run = pod.labels.get("dagster/run-id", pod.name)
        if fault.kind == "oom":
            self._oom_runs.add(run)
        else:
            self._per_run[run] += 1

    def _hit(self, pod: Any, kind: str) -> str | None:
        """Do it; None when the pod went away first (the injector tries another)."""
        try:
            if kind in POOL_KINDS:
                return self.pools.hit(pod, kind)
            if kind == "pod_delete":
                self.executor.preempt(pod.name)
                return "DisruptionTarget, graceful delete"
            if kind == "oom":
                self.executor.oom_kill(pod.name)
                return "OOMKilled"
            if kind == "worker_kill":
                worker = _worker_process(pod)
                if worker is None:
                    return None
                worker.send_signal(signal.SIGKILL)
                return f"SIGKILL worker pid {worker.pid}"
            engines = _engine_processes(pod)
            if not engines:
                return None
            engines[0].send_signal(signal.SIGKILL)
            return f"SIGKILL EngineCore pid {engines[0].pid}"
        except (ProcessLookupError, psutil.NoSuchProcess, KeyError):
            return None


def _worker_process(pod: Any) -> psutil.Process | None:
    """The worker's main process (`python -m dagster_gpuinfer.worker`), the pod's top one."""
    try:
        top = psutil.Process(pod.process.pid)
        for process in [top, *top.children(recursive=True)]:
            if "dagster_gpuinfer.worker" in " ".join(process.cmdline()):
                return process
    except psutil.NoSuchProcess:
        return None
    return None


def _engine_processes(pod: Any) -> list[psutil.Process]:
    try:
        family = psutil.Process(pod.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for process in family:
        try:
            if "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found
