"""`PoolWorkerLoop`: a pool worker's life, from its first poll to its exit code."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from dagster_gpuinfer.pools import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_LEASE_TTL_S,
    QUEUE_ENV,
    Lease,
    LeaseLostError,
    LeaseQueue,
    QueueUnavailable,
    default_queue_location,
    open_lease_queue,
)
from dagster_gpuinfer.pools.doorbell import Listener, pool_channel
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.worker import lifecycle
from dagster_gpuinfer.worker.errors import WorkerError, cap_message, engine_death_in
from dagster_gpuinfer.worker.loop.engine import InferenceEngine, check_model_dir
from dagster_gpuinfer.worker.metrics import current_metrics, start_worker_metrics
from dagster_gpuinfer.worker.pool.keeper import LeaseKeeper
from dagster_gpuinfer.worker.pool.lease_work import LeaseWork, lease_range, lease_spec
from dagster_gpuinfer.worker.run.engine_version import check_engine_version

log = logging.getLogger("dagster_gpuinfer.worker")

DEFAULT_POLL_S = 0.5

# Builds the engine for a spec; the callable it is given is called (from a watch thread)
# when an engine process dies.
EngineBuilder = Callable[[InferenceSpec, Callable[[str], None]], Any]


def build_engine(spec: InferenceSpec, on_death: Callable[[str], None]) -> InferenceEngine:
    """The vLLM engine for `spec`, after the checks a run makes before its build.

    Raises:
        SpecError: no model folder there, or another vLLM pinned, or vLLM refused it.
    """
    check_model_dir(spec)
    check_engine_version(spec)
    return InferenceEngine(spec, on_death=on_death)


def default_worker_id() -> str:
    """`<host>-<pid>`: unique among the pool's live workers."""
    return f"{socket.gethostname()}-{os.getpid()}"


class PoolWorkerLoop:
    """Serves the leases of one pool with one engine until idle, drained or dead.

    Args:
        queue: The lease queue.
        pool_key: The pool to serve (`pools.pool_key(spec)`).
        worker_id: This worker's id in the queue (leases, reports).
        idle_ttl_s: Seconds without a lease after which the worker exits 0.
        lease_ttl_s: Each lease's TTL (heartbeats every third of it); also the TTL of
            the worker's own record.
        poll_s: Seconds between two polls for a lease while idle; a job submitted to the
            pool wakes the worker before (the queue's doorbell).
        engine_builder: Builds the engine on the first lease (`build_engine`; tests pass
            a fake).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        queue: LeaseQueue,
        pool_key: str,
        *,
        worker_id: str | None = None,
        idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        poll_s: float = DEFAULT_POLL_S,
        engine_builder: EngineBuilder = build_engine,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.pool_key = pool_key
        self.worker_id = worker_id or default_worker_id()
        self.idle_ttl_s = idle_ttl_s
        self.lease_ttl_s = lease_ttl_s
        self.poll_s = poll_s
        self.engine_builder = engine_builder
        self.clock = clock
        self.engine: Any = None
        self.engine_load_seconds = 0.0
        self.leases_served = 0
        self.warm_hits = 0
        self.cold_starts = 0
        self.state = "starting"
        self._current: Lease | None = None

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Serve until idle for `idle_ttl_s` (0), SIGTERM (`EXIT_DRAINED`) or an engine
        death (`EXIT_ENGINE_DIED`); the engine is shut down and the worker's record removed
        on the way out."""
        log.info("pool worker %s serves pool %s", self.worker_id, self.pool_key)
        self.report("starting")
        try:
            return self._serve_until_idle()
        finally:
            self.shutdown_engine()
            try:
                self.queue.remove_worker(self.worker_id)
            except Exception as exc:  # noqa: BLE001 - it expires from the read-outs anyway
                log.warning("could not remove worker %s from the queue: %s", self.worker_id, exc)

    def _serve_until_idle(self) -> int:
        # Listening before the first look at the queue: a job submitted in between rings.
        with self.queue.doorbell().listen(pool_channel(self.pool_key)) as bell:
            return self._serve(bell)

    def _serve(self, bell: Listener) -> int:
        idle_since = self.clock()
        while True:
            if lifecycle.draining():
                self.report("draining")
                return lifecycle.EXIT_DRAINED
            lease = self._next_lease()
            if lease is None:
                idle = self.clock() - idle_since
                if idle >= self.idle_ttl_s:
                    log.info("no lease for %.0f s: the pool worker exits", idle)
                    return 0
                self.report("idle")
                bell.wait(self.poll_s)  # a submit rings it: no poll interval lost
                continue
            code = self.serve(lease)
            if code is not None:
                return code
            idle_since = self.clock()

    def _next_lease(self) -> Lease | None:
        """The pool's next lease, or None when none waits or the store cannot be reached
        (a blip must not cost a warm engine: the worker polls again, within its idle TTL)."""
        try:
            return self.queue.lease(self.pool_key, worker_id=self.worker_id, ttl_s=self.lease_ttl_s)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not lease from the queue (polling again): %s", exc)
            return None

    def shutdown_engine(self) -> None:
        """Shut the engine down (when one was built)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def report(self, state: str) -> None:
        """Upsert this worker's record (never raises: a report is best effort)."""
        self.state = state
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pod": os.environ.get("HOSTNAME")
            if os.environ.get("KUBERNETES_SERVICE_HOST")
            else None,
            "warm": self.engine is not None,
            "engine_load_seconds": round(self.engine_load_seconds, 3),
            "leases_served": self.leases_served,
            "warm_hits": self.warm_hits,
            "cold_starts": self.cold_starts,
            "job_id": self._current.job_id if self._current else None,
        }
        try:
            self.queue.report_worker(
                self.pool_key, self.worker_id, state=state, ttl_s=self.lease_ttl_s, info=info
            )
        except Exception as exc:  # noqa: BLE001
            log.warning("could not report worker %s: %s", self.worker_id, exc)

    # ------------------------------------------------------------------ one lease

    def serve(self, lease: Lease) -> int | None:
        """Work on one lease and settle it; returns an exit code when the worker must stop
        (drained, engine dead), else None (go on to the next lease)."""
        self._current = lease
        work = LeaseWork(self.queue, lease, clock=self.clock)
        keeper = LeaseKeeper(
            self.queue, lease, on_lost=work.lose, on_beat=lambda: self.report(self.state)
        ).start()
        warm = self.engine is not None
        try:
            self._work_on(lease, work)
        except WorkerError as exc:
            work.refuse(exc)
        except Exception as exc:
            keeper.stop()
            return self._after_crash(lease, work, exc)
        finally:
            keeper.stop()
            self._current = None
        return self._settle(lease, work, warm=warm)

    def _work_on(self, lease: Lease, work: LeaseWork) -> None:
        """Bind (or build) the engine for the lease's spec and compute its partition.

        Raises:
            WorkerError: the spec cannot run (does not validate, needs another engine).
        """
        spec, key = lease_spec(lease)
        chunk_range = lease_range(lease)
        self.report("busy" if self.engine is not None else "loading")
        if self.engine is not None:
            self.engine.bind(spec)
            self.warm_hits += 1
            load_seconds = 0.0
        else:
            self.engine = self.engine_builder(spec, self._engine_died)
            self.engine_load_seconds = load_seconds = float(self.engine.load_seconds)
            self.cold_starts += 1
            work.log_event(f"engine built in {load_seconds:.1f} s on worker {self.worker_id}")
            self.report("busy")
        current_metrics().serves_task(spec.task)
        if work.lost is None:
            work.serve(self.engine, spec, key, load_seconds, chunk_range)

    def _settle(self, lease: Lease, work: LeaseWork, *, warm: bool) -> int | None:
        """Complete, release or give up the lease after its work ended without a crash."""
        if work.lost is not None:
            self._abort_in_flight()
            log.warning("stopped item %s: %s", lease.item_key, work.lost)
            return None
        if not work.settled:
            self._abort_in_flight()
            reason = "SIGTERM" if lifecycle.draining() else "stopped before its partition settled"
            self._give_back(lease, reason, fail=not lifecycle.draining())
            if lifecycle.draining():
                self.report("draining")
                return lifecycle.EXIT_DRAINED
            return None
        result = work.result(
            worker_id=self.worker_id, warm=warm, engine_load_seconds=self.engine_load_seconds
        )
        self._complete(lease, result)
        return None

    def _complete(self, lease: Lease, result: dict[str, Any]) -> None:
        """Complete the lease, waiting out an unreachable queue for as long as the lease
        lives; past that it lapses and the item is leased again (its partition is
        committed: found, not computed again), and the warm engine stays."""
        deadline = self.clock() + self.lease_ttl_s
        wait_s = 0.5
        while True:
            try:
                self.queue.complete(lease, result)
                self.leases_served += 1
                return
            except LeaseLostError as exc:
                key = lease.item_key
                log.warning("item %s was done, but its lease was lost first: %s", key, exc)
                return
            except QueueUnavailable as exc:
                if self.clock() >= deadline:
                    log.warning(
                        "item %s is done, but the queue stayed unreachable for its "
                        "lease's TTL: it lapses (%s)",
                        lease.item_key,
                        exc,
                    )
                    return
                log.warning("completing item %s: %s (trying again)", lease.item_key, exc)
                time.sleep(wait_s)
                wait_s = min(wait_s * 2, 5.0)

    def _after_crash(self, lease: Lease, work: LeaseWork, exc: Exception) -> int | None:
        """The lease's work raised: an engine death exits, anything else fails the lease."""
        death = engine_death_in(exc)
        reason = f"{type(exc).__name__}: {cap_message(str(exc), 500)}"
        if death is not None:
            self._give_back(lease, f"the engine died ({reason})", fail=True)
            self.engine = None  # dead: nothing to shut down but its leftovers (exit kills them)
            return lifecycle.report_engine_death(cap_message(str(death), 600) or reason)
        if work.lost is not None:
            log.warning("item %s stopped after its lease was lost: %s", lease.item_key, reason)
        else:
            log.exception("serving item %s failed; the lease is failed", lease.item_key)
            self._give_back(lease, reason, fail=True)
        if self.engine is None:
            # The engine could not be built here (out of memory, a bad device, a startup
            # timeout): this worker leaves rather than fail every item of the pool in turn;
            # the reconciler starts another, and each item keeps its other attempts.
            log.error("the engine could not be built on this worker; it exits: %s", reason)
            return EXIT_BUILD_FAILED
        self._abort_in_flight()
        return None

    def _give_back(self, lease: Lease, reason: str, *, fail: bool) -> None:
        try:
            if fail:
                self.queue.fail(lease, reason)
            else:
                self.queue.release(lease, reason)
        except Exception as exc:  # noqa: BLE001 - lost already, or the store is down: it lapses
            log.warning("could not hand item %s back: %s", lease.item_key, exc)

    def _abort_in_flight(self) -> None:
        if self.engine is not None:
            aborted = self.engine.abort_in_flight()
            if aborted:
                log.info("aborted %d requests the stopped loop left in the engine", aborted)

    def _engine_died(self, message: str) -> None:
        """An engine process is gone (the engine's watch thread): fail the lease, exit 75."""
        lease = self._current
        if lease is not None:
            self._give_back(lease, message, fail=True)
        try:
            self.queue.remove_worker(self.worker_id)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        lifecycle.engine_died(message)


# A pool worker whose engine could not be built exits with this (a crash, as a pod sees it).
EXIT_BUILD_FAILED = 1


def run_pool_worker(
    pool_key: str,
    *,
    location: str | None = None,
    worker_id: str | None = None,
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    poll_s: float = DEFAULT_POLL_S,
) -> int:
    """`python -m dagster_gpuinfer.worker --pool KEY`: open the queue (`location`, else
    `GPUINFER_LEASE_QUEUE`, else the default), start the worker's metrics (labelled with
    the pool key as the asset and `pool-<worker id>` as the run) and serve; returns the
    exit code."""
    worker_id = worker_id or default_worker_id()
    location = location or os.environ.get(QUEUE_ENV) or default_queue_location()
    metrics = start_worker_metrics(asset=pool_key, run_id=f"pool-{worker_id}")
    queue = open_lease_queue(location)
    log.info("lease queue: %s", getattr(queue, "location", "?"))
    try:
        return PoolWorkerLoop(
            queue,
            pool_key,
            worker_id=worker_id,
            idle_ttl_s=idle_ttl_s,
            lease_ttl_s=lease_ttl_s,
            poll_s=poll_s,
        ).run()
    finally:
        queue.close()
        metrics.close()
