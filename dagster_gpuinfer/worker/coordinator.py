"""The run's coordinator: reads the run's shards in order, hands their chunks to the engines,
and commits each partition once all its chunks are in.

One coordinator per worker, whatever the number of engines: it is the one reader of each
shard, so ids are screened in shard order (the first occurrence of an id wins, whichever
engine serves which chunk), and the one committer of each partition (`errors.parquet`, then
the exclusive `_SUCCESS`), so engines that share a shard never race on its commit. Engines
pull chunks from one queue, so a single large shard keeps every engine busy.

The number of chunks handed out and not yet committed is bounded (`max_outstanding`): the
reader stays a bounded distance ahead of the engines, and the worker's memory is bounded by
that distance, never by the shard.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    ChunkMarker,
    CommitConflict,
    Manifest,
    RowCounts,
    read_chunk_markers,
)
from dagster_gpuinfer.worker.commit import (
    PartitionOutput,
    PartitionTimes,
    commit_chunks,
    committed_ids,
)
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.readers import ShardReader
from dagster_gpuinfer.worker.stream import ChunkCommitted, WorkChunk
from dagster_gpuinfer.worker.validate import screen_ids

log = logging.getLogger("dagster_gpuinfer.worker")

POLL_SECONDS = 0.2


@dataclass
class _PartitionRun:
    where: PartitionOutput
    attempt: str
    markers: dict[int, ChunkMarker]
    rows_resumed: int
    started_at: float  # Unix time: chunk intervals, written by any process, use this clock
    pending: set[int] = field(default_factory=set)
    computed: set[int] = field(default_factory=set)
    replicas: set[int] = field(default_factory=set)
    fully_read: bool = False
    settled: bool = False
    failed: ShardError | None = None
    committed_elsewhere: Manifest | None = None


class RunCoordinator:
    """Feeds the chunks of `partition_keys` to `put` and commits each partition.

    Args:
        spec: The job spec.
        partition_keys: The partitions to compute, in order (preflighted).
        on_committed: Called with (manifest, computed) for each committed partition.
        on_failed: Called with (error, key) for each shard that cannot be processed.
        put: Hands a chunk to the engines; None (once per engine) says there are no more.
        engines: How many engines take from `put`'s queue.
        max_outstanding: Chunks handed out and not yet committed, at most.
    """

    def __init__(
        self,
        spec: InferenceSpec,
        partition_keys: list[str],
        *,
        on_committed: Callable[[Manifest, bool], None],
        on_failed: Callable[[ShardError, str], None],
        put: Callable[[WorkChunk | None], None],
        engines: int,
        max_outstanding: int,
    ) -> None:
        self.spec = spec
        self.partition_keys = partition_keys
        self.on_committed = on_committed
        self.on_failed = on_failed
        self.put = put
        self.engines = engines
        self.model_load_seconds = 0.0
        self.error: BaseException | None = None
        self._slots = threading.Semaphore(max_outstanding)
        self._lock = threading.RLock()
        self._partitions: dict[str, _PartitionRun] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="gpuinfer-read", daemon=True)
        self.started: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, model_load_seconds: float) -> None:
        """Start reading (once an engine is ready: partition times exclude the model load)."""
        self.model_load_seconds = model_load_seconds
        self.started = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def done(self) -> bool:
        """Every partition handed out is settled (committed, yielded or failed).

        Called once the engines are through: the reader has handed out its last chunk by
        then, and may only be returning from its last `put`."""
        if self.started is not None:
            self._thread.join(timeout=30)
        with self._lock:
            return (
                not self._thread.is_alive()
                and self.started is not None
                and all(run.settled for run in self._partitions.values())
            )

    def check(self) -> None:
        """Raise what the reader died of, if it died."""
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ reading

    def _feed(self) -> None:
        try:
            for key in self.partition_keys:
                if self._stopping.is_set():
                    return
                self._feed_partition(key)
        except BaseException as exc:  # raised in the main thread by `check`
            self.error = exc
        finally:
            for _ in range(self.engines):
                self.put(None)

    def _feed_partition(self, key: str) -> None:
        where = PartitionOutput.of(self.spec, key)
        try:
            existing = where.committed()
            if existing is not None:
                self._report(existing, computed=False)
                return
            markers = read_chunk_markers(where.fs, where.path, where.spec_hash)
            seen_ids = committed_ids(where, markers)
        except OSError:
            # A concurrent worker that commits first removes the chunk files it does not
            # need, which can pull a file from under this one: then this one stops.
            concurrent = where.committed()
            if concurrent is None:
                raise
            self._report(concurrent, computed=False)
            return
        run = _PartitionRun(
            where=where,
            attempt=uuid.uuid4().hex[:8],
            markers=markers,
            rows_resumed=RowCounts.total(markers.values()).rows_in,
            started_at=time.time(),
        )
        with self._lock:
            self._partitions[key] = run
        current_metrics().partition_started(key)
        try:
            for chunk in ShardReader(self.spec, key).chunks(self.spec.chunk_size):
                if chunk.index in markers:
                    continue
                concurrent = where.committed()
                if concurrent is not None:
                    run.committed_elsewhere = concurrent
                    break
                screened = screen_ids(chunk, seen_ids)
                while not self._slots.acquire(timeout=POLL_SECONDS):
                    if self._stopping.is_set():
                        return
                with self._lock:
                    run.pending.add(chunk.index)
                self.put(WorkChunk(partition_key=key, attempt=run.attempt, chunk=screened))
        except ShardError as exc:
            exc.partition_key = exc.partition_key or key
            run.failed = exc
        with self._lock:
            run.fully_read = True
        self._settle(run)

    # ------------------------------------------------------------------ committing

    def chunk_committed(self, message: ChunkCommitted) -> None:
        """An engine committed a chunk: count it, and commit its partition if it was the last."""
        with self._lock:
            run = self._partitions[message.partition_key]
            run.pending.discard(message.marker.index)
            run.computed.add(message.marker.index)
            run.markers[message.marker.index] = message.marker
            run.replicas.add(message.replica)
        self._slots.release()
        self._settle(run)

    def _settle(self, run: _PartitionRun) -> None:
        with self._lock:
            if run.settled or not run.fully_read or run.pending:
                return
            run.settled = True
            where = run.where
            if run.failed is not None:  # `on_failed` logs it
                self.on_failed(run.failed, where.partition_key)
                return
            if run.committed_elsewhere is not None:
                self._report(where.yield_to(run.committed_elsewhere, run.attempt), computed=False)
                return
            try:
                concurrent = where.committed()
                if concurrent is not None:
                    raise CommitConflict(concurrent)
                manifest = commit_chunks(
                    where,
                    self.spec,
                    run.markers,
                    computed=run.computed,
                    rows_resumed=run.rows_resumed,
                    times=PartitionTimes(run.started_at, self.model_load_seconds),
                    worker=self._worker_info(run),
                )
            except CommitConflict as conflict:
                self._report(where.yield_to(conflict.manifest, run.attempt), computed=False)
                return
            except OSError:
                concurrent = where.committed()
                if concurrent is None:
                    raise
                self._report(where.yield_to(concurrent, run.attempt), computed=False)
                return
            self._report(manifest, computed=True)

    def _worker_info(self, run: _PartitionRun) -> dict[str, Any]:
        replicas = sorted(run.replicas)
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": run.attempt,
            # The engines that wrote this run's chunks of the partition.
            "replicas": replicas,
            "replica": replicas[0] if len(replicas) == 1 else None,
        }

    def _report(self, manifest: Manifest, *, computed: bool) -> None:
        with self._lock:
            self.on_committed(manifest, computed)
