"""`LeaseWork`: one lease's partition on a bound engine, its events and its item result."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from dagster_gpuinfer.pools import Lease, LeaseLostError, LeaseQueue
from dagster_gpuinfer.pools.ranges import ChunkRange
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest
from dagster_gpuinfer.worker.errors import ShardError, SpecError, WorkerError
from dagster_gpuinfer.worker.loop.engine_loop import LoopEngine
from dagster_gpuinfer.worker.metrics import MeteredReporter, current_metrics
from dagster_gpuinfer.worker.run.job import PartitionStop, run_partition
from dagster_gpuinfer.worker.run.reporting import MessageReporter, parse_spec
from dagster_gpuinfer.worker.stage_messages import ChunkCommitted

log = logging.getLogger("dagster_gpuinfer.worker")

# Seconds between two progress events of one lease, at least.
PROGRESS_SECONDS = 2.0


def lease_spec(lease: Lease) -> tuple[InferenceSpec, str]:
    """The job's spec narrowed to the lease's partition, and that partition's key.

    Raises:
        SpecError: the job payload holds no spec, or one that does not validate.
    """
    spec = parse_spec(lease.job_payload.get("spec"))
    key = str(lease.item_payload.get("partition_key") or lease.item_key)
    # The partition keys stay out of the spec hash: the markers and manifests are the run's.
    return spec.model_copy(update={"partition_keys": [key]}), key


def lease_range(lease: Lease) -> ChunkRange | None:
    """The lease's chunk range (`pools/ranges.py`), or None for a whole partition.

    Raises:
        SpecError: the item names a chunk range that is not one.
    """
    try:
        return ChunkRange.of_item(lease.item_payload, lease.job_id)
    except ValueError as exc:
        raise SpecError(f"work item {lease.item_key!r} of job {lease.job_id}: {exc}") from None


class LeaseWork:
    """What a pool worker does with one lease once its engine is bound: compute the
    partition (`run_partition`, the path a run takes), post events while at it, and collect the
    worker messages for the item result.

    `lose` (any thread: the heartbeat was refused) stops the partition now.

    Args:
        queue: The lease queue (events are posted on it).
        lease: The lease.
        clock: Monotonic seconds, for progress pacing.
    """

    def __init__(self, queue: LeaseQueue, lease: Lease, *, clock: Any = time.monotonic) -> None:
        self.queue = queue
        self.lease = lease
        self.clock = clock
        self.messages: list[dict[str, Any]] = []
        # Failures counted in the worker's metrics, as a run's are.
        self.reporter = MeteredReporter(MessageReporter(self.messages.append), current_metrics())
        self.settled = False  # the partition was committed or failed, or the spec refused
        self.inference_seconds = 0.0
        self.rows_done = 0
        self.chunks_committed = 0
        self._last_progress = -PROGRESS_SECONDS
        self._lost: LeaseLostError | None = None
        self._lock = threading.Lock()
        self._stop = PartitionStop()

    @property
    def lost(self) -> LeaseLostError | None:
        """Why the lease was lost, once it was."""
        return self._lost

    def lose(self, exc: LeaseLostError) -> None:
        """The lease is gone: stop computing now (chunks not yet written are dropped)."""
        with self._lock:
            self._lost = self._lost or exc
        self._stop.pull()

    def refuse(self, exc: WorkerError) -> None:
        """The lease's spec cannot run here: its result is a `Fatal` message."""
        log.error("%s", exc)
        self.reporter.fatal(exc)
        self.settled = True

    def post(self, kind: str, payload: dict[str, Any]) -> None:
        """Post an event on the lease; a refusal means the lease is lost (never raises)."""
        try:
            self.queue.post_event(self.lease, kind, payload)
        except LeaseLostError as exc:
            self.lose(exc)
        except Exception as exc:  # noqa: BLE001 - events are best effort
            log.warning("could not post a %s event: %s", kind, exc)

    def log_event(self, message: str) -> None:
        """A notable line: logged here and posted for the step's log."""
        log.info("%s", message)
        self.post("log", {"level": "info", "message": message})

    def serve(
        self,
        engine: LoopEngine,
        spec: InferenceSpec,
        key: str,
        load_seconds: float,
        chunk_range: ChunkRange | None = None,
    ) -> None:
        """Compute partition `key` of `spec` on `engine` (bound to `spec`), or its
        `chunk_range`: skip it when committed already, report its shard when it fails,
        else serve it."""
        served = run_partition(
            spec,
            key,
            engine=engine,
            reporter=self,
            load_seconds=load_seconds,
            on_chunk=self._chunk,
            stop=self._stop,
            chunk_range=chunk_range,
        )
        self.inference_seconds = served.inference_seconds
        self.settled = served.done

    def result(self, *, worker_id: str, warm: bool, engine_load_seconds: float) -> dict[str, Any]:
        """The item result `complete` stores (see the contract in `worker/pool/`)."""
        return {
            "messages": list(self.messages),
            "pool": {
                "worker_id": worker_id,
                "warm": warm,
                "engine_load_seconds": round(0.0 if warm else engine_load_seconds, 3),
                "lease_attempt": self.lease.attempt,
                "inference_seconds": round(self.inference_seconds, 3),
            },
        }

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None:
        """`run_partition`'s reporter: the manifest goes to the item result, and a line to
        the step's log."""
        self.reporter.partition_committed(manifest, computed=computed)
        verb = "committed" if computed else "was committed already"
        self.log_event(f"partition {manifest.partition_key} {verb} ({manifest.rows_out} rows)")

    def partition_failed(self, exc: ShardError) -> None:
        self.reporter.partition_failed(exc)

    def _chunk(self, message: ChunkCommitted) -> None:
        """After each chunk marker (writer thread): progress, at most every few seconds."""
        self.rows_done += message.marker.rows_in
        self.chunks_committed += 1
        now = self.clock()
        if now - self._last_progress >= PROGRESS_SECONDS:
            self._last_progress = now
            self.post(
                "progress",
                {"rows_done": self.rows_done, "chunks_committed": self.chunks_committed},
            )
