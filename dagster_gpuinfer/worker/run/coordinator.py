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

Two threads: the reader (`gpuinfer-read`) reads and hands out chunks; the committer
(`gpuinfer-commit`) owns every partition's state and is the only one that writes a partition's
commit or calls `on_committed` / `on_failed`. The reader and the engines (`chunk_committed`,
called from an engine's writer thread or a replica's message loop) hand it events through one
queue, so no storage write happens under a lock that another thread waits on.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dagster_gpuinfer.pools.ranges import ChunkRange
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    ChunkMarker,
    CommitConflict,
    Manifest,
    PartitionOutput,
    RowCounts,
    clear_unnamed,
    input_version,
)
from dagster_gpuinfer.worker.commit import PartitionTimes, commit_chunks, partition_reading
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.rows.readers import RawChunk, ShardReader
from dagster_gpuinfer.worker.rows.validate import screen_ids
from dagster_gpuinfer.worker.run.engine_version import engine_versions
from dagster_gpuinfer.worker.stage_messages import POLL_SECONDS, ChunkCommitted, WorkChunk

log = logging.getLogger("dagster_gpuinfer.worker")


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


@dataclass
class _ChunkHandedOut:
    """The reader handed chunk `index` of `run` to the engines."""

    run: _PartitionRun
    index: int


@dataclass
class _PartitionRead:
    """The reader is through `run`'s shard (`failed`: it could not be read to the end;
    `committed_elsewhere`: another worker committed it meanwhile)."""

    run: _PartitionRun
    failed: ShardError | None = None
    committed_elsewhere: Manifest | None = None


@dataclass
class _ShardGone:
    """The partition's shard vanished between the run's preflight and its reading."""

    error: ShardError


@dataclass
class _AlreadyCommitted:
    """The partition was committed before this run read it."""

    manifest: Manifest


_END = object()  # the committer's last event: every event before it is handled


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
        model_version: The local model folder's version (`storage.model_version`, read
            once per run), recorded with every chunk and partition; None for a hub id.
        chunk_range: A chunk-range lease's range of its one partition (`pools/ranges.py`):
            only those chunks are handed out, and the partition is committed only when
            every chunk of it, of any range, is in.
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
        model_version: str | None,
        chunk_range: ChunkRange | None = None,
    ) -> None:
        if chunk_range is not None and len(partition_keys) != 1:
            raise ValueError(f"a chunk range is of one partition, not of {partition_keys}")
        self.spec = spec
        self.partition_keys = partition_keys
        self.chunk_range = chunk_range
        self.on_committed = on_committed
        self.on_failed = on_failed
        self.put = put
        self.engines = engines
        self.model_load_seconds = 0.0
        self.model_version = model_version
        self.error: BaseException | None = None
        self._slots = threading.Semaphore(max_outstanding)
        self._partitions: dict[str, _PartitionRun] = {}  # the committer's (after the reader's)
        self._events: queue.Queue[Any] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="gpuinfer-read", daemon=True)
        self._committer = threading.Thread(
            target=self._commit_events, name="gpuinfer-commit", daemon=True
        )
        self.started: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, model_load_seconds: float) -> None:
        """Start reading (once an engine is ready: partition times exclude the model load)."""
        self.model_load_seconds = model_load_seconds
        self.started = time.perf_counter()
        self._committer.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop reading (the committer still commits what the engines hand it)."""
        self._stopping.set()

    def done(self) -> bool:
        """Every partition handed out is settled (committed, yielded or failed).

        Called once the engines are through: the reader has handed out its last chunk by
        then, and may only be returning from its last `put`; the committer then handles
        every event handed to it, and ends.

        Raises:
            Exception: what the reader or the committer died of.
        """
        if self.started is None:
            return False
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            return False
        if self._committer.is_alive():
            self._events.put(_END)
            self._committer.join()
        self.check()
        return all(run.settled for run in self._partitions.values())

    def check(self) -> None:
        """Raise what the reader or the committer died of, if one died."""
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
        try:
            where = partition_reading(self.spec, key, model=self.model_version)
            if self.chunk_range is not None:
                check_range_source(self.spec, self.chunk_range, where)
        except ShardError as exc:
            self._events.put(_ShardGone(exc))
            return
        try:
            existing = where.committed()
            if existing is not None:
                self._events.put(_AlreadyCommitted(existing))
                return
            markers = where.markers()
        except OSError:
            # A concurrent worker that commits first removes the chunk files it does not
            # need, which can pull a file from under this one: then this one stops.
            concurrent = where.committed()
            if concurrent is None:
                raise
            self._events.put(_AlreadyCommitted(concurrent))
            return
        run = _PartitionRun(
            where=where,
            attempt=uuid.uuid4().hex[:8],
            markers=markers,
            rows_resumed=RowCounts.total(markers.values()).rows_in,
            started_at=time.time(),
        )
        self._partitions[key] = run  # before any event of it: the committer reads it after
        current_metrics().partition_started(key)
        read = _PartitionRead(run)
        try:
            for screened in self._chunks_to_compute(key, markers):
                concurrent = where.committed()
                if concurrent is not None:
                    read.committed_elsewhere = concurrent
                    break
                while not self._slots.acquire(timeout=POLL_SECONDS):
                    if self._stopping.is_set():
                        return
                self._events.put(_ChunkHandedOut(run, screened.index))  # before engines see it
                self.put(
                    WorkChunk(
                        partition_key=key,
                        attempt=run.attempt,
                        chunk=screened,
                        source=where.source,
                        job=self.chunk_range.job if self.chunk_range else None,
                    )
                )
            if read.committed_elsewhere is None:
                check_shard_unchanged(self.spec, where)
        except ShardError as exc:
            exc.partition_key = exc.partition_key or key
            read.failed = exc
        self._events.put(read)

    def _chunks_to_compute(self, key: str, markers: dict[int, ChunkMarker]) -> Iterator[RawChunk]:
        """The chunks of `key` not committed yet (within the chunk range, if any), their
        ids screened in shard order: every chunk from the shard's start is screened,
        committed or not, so the first occurrence of an id wins exactly as in one
        uninterrupted run. (Chunks commit out of order: taking the committed chunks' ids
        instead would quarantine a first occurrence in an uncommitted chunk whose later
        duplicate was committed, and the id would be lost.) A range stops after its last
        chunk.

        Raises:
            ShardError: the shard does not have the chunks the range was counted from.
        """
        span = self.chunk_range
        seen = 0
        seen_ids: set[str] = set()
        for chunk in ShardReader(self.spec, key).chunks(self.spec.chunk_size):
            seen = chunk.index + 1
            if span is None:
                screened = screen_ids(chunk, seen_ids)
                if chunk.index not in markers:
                    yield screened
                continue
            if chunk.index >= span.total:
                raise range_count_error(self.spec, key, span, "more")
            screened = screen_ids(chunk, seen_ids)
            if chunk.index >= span.start and chunk.index not in markers:
                yield screened
            if seen >= span.end and span.end < span.total:
                return
        if span is not None and seen != span.total:
            raise range_count_error(self.spec, key, span, f"{seen}")

    # ------------------------------------------------------------------ committing

    def chunk_committed(self, message: ChunkCommitted) -> None:
        """An engine wrote a chunk and its marker: hand it to the committer (any thread).

        Raises:
            Exception: what the reader or the committer died of (the engine stops).
        """
        self.check()
        self._slots.release()
        self._events.put(message)

    def _commit_events(self) -> None:
        """The committer thread: handle each event in turn until `_END`, or until the reader
        is gone after a stop and nothing is left; what it dies of goes to `check`."""
        try:
            while True:
                try:
                    event = self._events.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if self._stopping.is_set() and not self._thread.is_alive():
                        return
                    continue
                if event is _END:
                    return
                self._handle(event)
        except BaseException as exc:
            self.error = self.error or exc
            self._stopping.set()

    def _handle(self, event: Any) -> None:
        if isinstance(event, _AlreadyCommitted):
            self.on_committed(event.manifest, False)
            return
        if isinstance(event, _ShardGone):
            self.on_failed(event.error, str(event.error.partition_key))
            return
        if isinstance(event, _ChunkHandedOut):
            event.run.pending.add(event.index)
            return
        if isinstance(event, _PartitionRead):
            run = event.run
            run.fully_read, run.failed = True, event.failed
            run.committed_elsewhere = event.committed_elsewhere
        else:
            run = self._partitions[event.partition_key]
            run.pending.discard(event.marker.index)
            run.computed.add(event.marker.index)
            run.markers[event.marker.index] = event.marker
            run.replicas.add(event.replica)
        if not run.settled and run.fully_read and not run.pending:
            run.settled = True
            self._settle(run)

    def _settle(self, run: _PartitionRun) -> None:
        """Commit `run`'s partition (all its chunks are in), or yield it, or fail it."""
        where = run.where
        if run.failed is not None:  # `on_failed` logs it
            self.on_failed(run.failed, where.partition_key)
            return
        if run.committed_elsewhere is not None:
            self.on_committed(where.yield_to(run.committed_elsewhere, run.attempt), False)
            return
        try:
            concurrent = where.committed()
            if concurrent is not None:
                raise CommitConflict(concurrent)
            if self.chunk_range is not None:
                manifest = self._commit_if_complete(run, self.chunk_range)
                if manifest is None:
                    return
            else:
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
            self.on_committed(where.yield_to(conflict.manifest, run.attempt), False)
            return
        except OSError:
            concurrent = where.committed()
            if concurrent is None:
                raise
            if where.is_own(concurrent, run.attempt):
                # The manifest write applied though the store answered with an error: the
                # commit happened; finish its clean-up.
                clear_unnamed(where.fs, where.path, concurrent)
                self.on_committed(concurrent, True)
                return
            self.on_committed(where.yield_to(concurrent, run.attempt), False)
            return
        self.on_committed(manifest, True)

    def _commit_if_complete(self, run: _PartitionRun, span: ChunkRange) -> Manifest | None:
        """After this range's chunks are in: commit the partition if every chunk of it is
        (this range's writer is then the last, or one of the last racing on the exclusive
        manifest), else None (a range still running commits it). As computed: every chunk
        of the job; as resumed: the chunks committed before it (`pools/ranges.py`).

        Raises:
            CommitConflict: another range's worker committed it first.
        """
        where = run.where
        markers = {i: m for i, m in where.markers().items() if i < span.total}
        if len(markers) < span.total:
            log.info(
                "partition %s: chunks %d-%d of this range are in, %d of %d chunks in all; the "
                "range that finishes last commits the partition",
                where.partition_key,
                span.start,
                span.end - 1,
                len(markers),
                span.total,
            )
            return None
        own = {i for i, marker in markers.items() if marker.job == span.job}
        started = [markers[i].started_at for i in own if markers[i].started_at is not None]
        return commit_chunks(
            where,
            self.spec,
            markers,
            computed=own,
            rows_resumed=RowCounts.total(m for i, m in markers.items() if i not in own).rows_in,
            times=PartitionTimes(min([run.started_at, *started]), self.model_load_seconds),
            worker={**self._worker_info(run), "job": span.job, "range": [span.start, span.end - 1]},
        )

    def _worker_info(self, run: _PartitionRun) -> dict[str, Any]:
        replicas = sorted(run.replicas)
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": run.attempt,
            # The engines that wrote this run's chunks of the partition.
            "replicas": replicas,
            "replica": replicas[0] if len(replicas) == 1 else None,
            **engine_versions(),
        }


def check_range_source(spec: InferenceSpec, span: ChunkRange, where: PartitionOutput) -> None:
    """A chunk range is computed from the shard version the step counted its chunks in.

    Raises:
        ShardError: the shard was rewritten since the step split the partition.
    """
    if where.source.input != span.input_version:
        raise ShardError(
            f"shard {spec.input.shard_uri(where.partition_key)} of partition "
            f"{where.partition_key!r} changed since the step split it into chunk ranges "
            f"({span.input_version} -> {where.source.input}); nothing of this range was "
            "computed. Retry the run: it splits the shard as it is now",
            partition_key=where.partition_key,
        )


def range_count_error(spec: InferenceSpec, key: str, span: ChunkRange, found: str) -> ShardError:
    """The shard holds another number of chunks than the step counted for its ranges."""
    return ShardError(
        f"shard {spec.input.shard_uri(key)} of partition {key!r} holds {found} chunks of "
        f"{spec.chunk_size} rows, its footer said {span.total} when the step split it into "
        "chunk ranges; nothing of it was committed as the partition. Retry the run, or run "
        "it with launch='run'",
        partition_key=key,
    )


def check_shard_unchanged(spec: InferenceSpec, where: PartitionOutput) -> None:
    """After the last chunk of a shard is read: the shard is still the version the run
    started from, so its chunks never mix two versions under one manifest.

    Raises:
        ShardError: the shard was rewritten or removed while this run read it.
    """
    try:
        now = input_version(spec, where.partition_key)
    except FileNotFoundError:
        now = "removed"
    if now != where.source.input:
        raise ShardError(
            f"shard {spec.input.shard_uri(where.partition_key)} of partition "
            f"{where.partition_key!r} changed while this run read it ({where.source.input} -> "
            f"{now}); nothing of it was committed as the partition. Re-run it once the shard "
            "is written: it is computed from the new version",
            partition_key=where.partition_key,
        )
