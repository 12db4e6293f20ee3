"""A worker job: preflight every shard, load the model once, serve the run's shards.

A shard that cannot be processed (`ShardError`: missing, unreadable, missing a column) fails
that partition alone: it is reported and the run's other partitions go on. Shards that fail
their preflight never cost a model load; when every shard of the run fails it, none loads.

The worker streams: one coordinator (`worker/run/coordinator.py`) reads the shards in order and
commits partitions; each engine keeps a bounded window of requests in flight across chunk and
shard boundaries (`worker/loop/engine_loop.py`). With `replicas=N > 1` the worker starts N engine
processes, each pinned to its own devices (`CUDA_VISIBLE_DEVICES` slice of
`tensor_parallel_size` GPUs, or its own CPU cores), and each pulls chunks (not shards) from
one queue: one large shard keeps every engine busy.

Serving on a built engine is `serve_partitions` (a `PartitionServer`: the coordinator, one
`EngineLoop`, the chunk markers and the commit), and `run_partition` is the public entry for
one partition on a built engine (skip it if committed, preflight it, serve it):
`run_single_engine` builds an engine, serves the run's partitions on it and shuts it down; a
pool worker (`worker/pool/`) keeps its engine and runs each lease's partition through
`run_partition`, and bench/ measures the same call, so every path commits alike.

SIGTERM (`worker/lifecycle.py`) drains: no chunk is handed to an engine after it, the
chunks in flight finish and commit, and the run ends with `Drained`, naming what was left.

The run summary splits the worker's time: `start_seconds` (process start to job start:
interpreter, imports, Pipes), `load_seconds` (engine build, the slowest engine's),
`inference_seconds` (first engine ready to last partition committed) and
`shutdown_seconds` (engine shutdown).

Replicas talk to this process in typed messages (`ReplicaLoaded`, `ReplicaChunk`,
`ReplicaFinished`, `ReplicaUserError`, `ReplicaCrashed`), picklable dataclasses sent on a
multiprocessing queue.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import multiprocessing.queues
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, TypeAlias

from dagster_gpuinfer.pools.ranges import ChunkRange
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest, committed_manifest
from dagster_gpuinfer.storage import model_version as local_model_version
from dagster_gpuinfer.worker.errors import (
    Drained,
    EngineDied,
    ShardError,
    SpecError,
    WorkerError,
    engine_death_in,
)
from dagster_gpuinfer.worker.lifecycle import (
    EXIT_ENGINE_DIED,
    children_die_with_this_process,
    draining,
    install_signal_handlers,
)
from dagster_gpuinfer.worker.loop.engine import InferenceEngine, check_model_dir
from dagster_gpuinfer.worker.loop.engine_loop import EngineLoop, LoopEngine, serve_chunks
from dagster_gpuinfer.worker.metrics import current_metrics, start_worker_metrics
from dagster_gpuinfer.worker.rows.readers import ShardReader
from dagster_gpuinfer.worker.run.coordinator import RunCoordinator
from dagster_gpuinfer.worker.run.engine_version import check_engine_version
from dagster_gpuinfer.worker.stage_messages import (
    POLL_SECONDS,
    ChunkCommitted,
    ReplicaChunk,
    ReplicaCrashed,
    ReplicaFinished,
    ReplicaLoaded,
    ReplicaMessage,
    ReplicaUserError,
    WorkChunk,
)

log = logging.getLogger("dagster_gpuinfer.worker")


class PartitionReporter(Protocol):
    """Where the outcome of each partition goes (`run_partition`, `serve_partitions`)."""

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None: ...

    def partition_failed(self, exc: ShardError) -> None: ...


class Reporter(PartitionReporter, Protocol):
    """Where the worker sends progress: Dagster Pipes in a run, stdout on the command line."""

    def run_finished(self, summary: dict[str, Any]) -> None: ...


def run_job(spec: InferenceSpec, reporter: Reporter) -> dict[str, Any]:
    """Commit every partition of `spec.partition_keys` that can be; returns the run summary.

    Shards that cannot be processed go to `reporter.partition_failed` and the run goes on.

    Raises:
        WorkerError: the spec cannot run (model directory, arguments); retrying will not help.
    """
    started = time.perf_counter()
    start_seconds = process_age_seconds()
    check_model_dir(spec)
    check_engine_version(spec)
    model = local_model_version(spec)  # once for all partitions: a stat of every file
    run_reporter = _RunReporter(reporter)
    # Preflight before any engine is built: a run whose shards all fail it loads no model.
    todo = partitions_to_compute(spec, spec.partition_keys, model, run_reporter)
    replicas = spec.replicas if todo else 0
    timing = RunTiming()
    if replicas == 1:
        timing = run_single_engine(spec, todo, run_reporter, model)
    elif replicas > 1:
        on_committed, on_failed = report_to(run_reporter)
        timing = run_replicas(spec, todo, replicas, on_committed, on_failed, model)
    failed = run_reporter.failed
    computed_keys = [key for key in todo if key not in failed]
    summary = {
        "partitions": len(spec.partition_keys),
        "partitions_computed": len(computed_keys),
        "partitions_failed": len(failed),
        "partitions_skipped": len(spec.partition_keys) - len(computed_keys) - len(failed),
        "replicas": replicas,
        "model_loads": len(timing.load_seconds),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "start_seconds": round(start_seconds, 3),
        "load_seconds": round(max(timing.load_seconds, default=0.0), 3),
        "inference_seconds": round(timing.inference_seconds, 3),
        "shutdown_seconds": round(max(timing.shutdown_seconds, default=0.0), 3),
    }
    reporter.run_finished(summary)
    return summary


class _RunReporter:
    """The run's reporter as the partitions see it: one partition reported at a time (the
    coordinator's and the replicas' threads), and the keys of those that failed kept."""

    def __init__(self, reporter: PartitionReporter) -> None:
        self.reporter = reporter
        self.failed: list[str] = []
        self._lock = threading.Lock()

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None:
        with self._lock:
            self.reporter.partition_committed(manifest, computed=computed)

    def partition_failed(self, exc: ShardError) -> None:
        with self._lock:
            self.failed.append(str(exc.partition_key))
            self.reporter.partition_failed(exc)


def report_to(
    reporter: PartitionReporter,
) -> tuple[Callable[[Manifest, bool], None], Callable[[ShardError, str], None]]:
    """The coordinator's `on_committed` and `on_failed` for `reporter`: a failed shard's
    error names its partition and is logged before it is reported."""

    def on_committed(manifest: Manifest, computed: bool) -> None:
        reporter.partition_committed(manifest, computed=computed)

    def on_failed(exc: ShardError, key: str) -> None:
        exc.partition_key = exc.partition_key or key
        log.error("partition %s failed, the others go on without it: %s", exc.partition_key, exc)
        reporter.partition_failed(exc)

    return on_committed, on_failed


def partitions_to_compute(
    spec: InferenceSpec,
    partition_keys: list[str],
    model: str | None,
    reporter: PartitionReporter,
) -> list[str]:
    """The partitions of `partition_keys` to compute: those committed already go to
    `reporter.partition_committed` (not computed), those whose shard fails its preflight
    to `reporter.partition_failed`; no engine is needed for either."""
    _, on_failed = report_to(reporter)
    todo = []
    for key in partition_keys:
        manifest = committed_manifest(spec, key, model=model)
        if manifest is not None:
            reporter.partition_committed(manifest, computed=False)
            continue
        try:
            ShardReader(spec, key).preflight()
        except ShardError as exc:
            on_failed(exc, key)
            continue
        todo.append(key)
    return todo


@dataclass
class RunTiming:
    """Where a run's engine time went: per-engine build and shutdown, and the streaming."""

    load_seconds: list[float] = field(default_factory=list)
    shutdown_seconds: list[float] = field(default_factory=list)
    inference_seconds: float = 0.0


def process_age_seconds() -> float:
    """Seconds since this process started (interpreter start, imports, Pipes setup).

    On Linux both ends are read on the boot clock: the process's start tick from
    `/proc/self/stat` against `CLOCK_BOOTTIME`. psutil's `create_time()` adds that tick to
    `/proc/stat`'s boot time, a whole second, so the age it gives is long by the boot
    time's lost fraction (0.27 s on one machine here, up to 1 s), which made the run's time
    outside the worker come out negative."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of proc(5); fields[0] is field 3
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max(now - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        pass  # not Linux: psutil's wall-clock figure, coarser but there
    try:
        import psutil  # vLLM's dependency, present wherever the worker runs

        return max(time.time() - psutil.Process().create_time(), 0.0)
    except Exception:  # pragma: no cover - psutil missing
        return 0.0


# How many windows of rows the reader may run ahead of the oldest chunk not yet committed.
# A chunk commits when its slowest row is done; meanwhile the engine goes on with later rows
# (on long-tailed work, about max_tokens / mean tokens windows of them), and if the reader
# stopped handing out chunks, the window would drain behind that row: the barrier the
# streaming loop removes. Rows are small (prompt, token ids, output): memory stays bounded by
# the window.
WINDOWS_AHEAD = 8


def max_outstanding_chunks(spec: InferenceSpec, engines: int, window: int) -> int:
    """Chunks handed out and not yet committed, at most, for `engines` engines of `window`
    requests in flight each: `WINDOWS_AHEAD` windows of rows plus three chunks (one being
    prepared, one prepared, one being written) per engine."""
    per_engine = math.ceil(WINDOWS_AHEAD * window / spec.chunk_size) + 3
    return engines * per_engine


def run_single_engine(
    spec: InferenceSpec,
    partition_keys: list[str],
    reporter: PartitionReporter,
    model_version: str | None,
) -> RunTiming:
    """One engine in this process serving `partition_keys` (`serve_partitions`; `model_version`:
    the local model folder's, `storage.model_version`)."""
    timing = RunTiming()
    current_metrics().serves_task(spec.task)
    engine = InferenceEngine(spec)  # shuts itself down if its start fails
    try:  # nothing between the engine's start and the `finally` that shuts it down
        timing.load_seconds.append(engine.load_seconds)
        served = serve_partitions(
            spec,
            partition_keys,
            engine=engine,
            reporter=reporter,
            model_version=model_version,
            load_seconds=engine.load_seconds,
        )
        timing.inference_seconds = served.inference_seconds
    finally:
        shutdown_started = time.perf_counter()
        engine.shutdown()
        timing.shutdown_seconds.append(time.perf_counter() - shutdown_started)
    if not served.done:
        if draining():
            raise drained_error(partition_keys)
        raise RuntimeError("the engine stopped before every partition of the run was settled")
    return timing


@dataclass(frozen=True)
class Served:
    """What `serve_partitions` (and `run_partition`) did: whether every partition was
    settled (committed or reported failed), and the seconds from the first chunk read to
    the last partition committed (0 when nothing was served)."""

    done: bool
    inference_seconds: float = 0.0


class PartitionStop:
    """A stop for `serve_partitions`, pulled from any thread before or while it serves (a
    pool worker that lost its lease): the engine loop ends now and the chunks not yet
    written are dropped (the next holder redoes only those)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pulled = False
        self._servers: list[PartitionServer] = []

    @property
    def pulled(self) -> bool:
        return self._pulled

    def pull(self) -> None:
        with self._lock:
            self._pulled = True
            servers = list(self._servers)
        for server in servers:
            server.stop()

    def attach(self, server: PartitionServer) -> None:
        """Stop `server` when this is pulled (now, if it was)."""
        with self._lock:
            self._servers.append(server)
            pulled = self._pulled
        if pulled:
            server.stop()


def run_partition(
    spec: InferenceSpec,
    key: str,
    *,
    engine: LoopEngine,
    reporter: PartitionReporter,
    load_seconds: float = 0.0,
    on_chunk: Callable[[ChunkCommitted], None] | None = None,
    stop: PartitionStop | None = None,
    chunk_range: ChunkRange | None = None,
) -> Served:
    """Compute partition `key` of `spec` on a built `engine` (bound to `spec`), the product's
    path for one partition: skip it when it is committed already, report its shard when it
    fails its preflight, else serve it (`serve_partitions`: the run's coordinator reads the
    shard, the engine loop infers and writes chunk markers, the coordinator commits). A pool
    worker serves each lease through it, and bench/ measures it.

    Args:
        spec: The job spec (its `output`, `input`, task and sampling; the engine's model).
        key: The partition.
        engine: The built engine (`InferenceEngine`, or a fake in tests); not shut down here.
        reporter: Gets the committed manifest (computed or found) or the shard's error.
        load_seconds: The engine's build time, recorded in the manifest.
        on_chunk: Called (from the writer thread) after each chunk's marker is written.
        stop: Pulled from another thread: stop now (`Served.done` stays False).
        chunk_range: A pool worker's chunk-range lease of the partition (`pools/ranges.py`):
            only its chunks are computed; the worker that completes the set commits.

    Raises:
        Exception: what the reader, the committer or the engine loop died of.
    """
    model = local_model_version(spec)
    todo = partitions_to_compute(spec, [key], model, reporter)
    if not todo:
        return Served(done=True)
    return serve_partitions(
        spec,
        todo,
        engine=engine,
        reporter=reporter,
        model_version=model,
        load_seconds=load_seconds,
        on_chunk=on_chunk,
        stop=stop,
        chunk_range=chunk_range,
    )


def serve_partitions(
    spec: InferenceSpec,
    partition_keys: list[str],
    *,
    engine: LoopEngine,
    reporter: PartitionReporter,
    model_version: str | None,
    load_seconds: float = 0.0,
    on_chunk: Callable[[ChunkCommitted], None] | None = None,
    stop: PartitionStop | None = None,
    chunk_range: ChunkRange | None = None,
) -> Served:
    """Serve `partition_keys` (preflighted by `partitions_to_compute`, not committed) on a
    built `engine` through one `PartitionServer`: what `run_partition` and a run's single
    engine (`run_single_engine`) share. Arguments as `run_partition`'s; `model_version`:
    `storage.model_version(spec)`, read once by the caller."""
    on_committed, on_failed = report_to(reporter)
    server = PartitionServer(
        engine,
        spec,
        partition_keys,
        on_committed,
        on_failed,
        model_version,
        on_chunk=on_chunk,
        chunk_range=chunk_range,
    )
    if stop is not None:
        stop.attach(server)
    server.run(load_seconds)
    return Served(server.done, server.inference_seconds)


class PartitionServer:
    """Serves `partition_keys` on an engine that is already built: the run's coordinator
    reads the shards and commits each partition, one `EngineLoop` serves the chunks and
    writes their markers. `serve_partitions` (the per-run path and `run_partition`) builds
    one; it neither builds nor shuts down the engine.

    After a SIGTERM (`draining()`) no chunk is handed out and the chunks in flight finish
    and commit; `stop()` (any thread: a pool worker that lost its lease) ends the loop now,
    dropping the chunks not yet written (the next holder redoes only those). Either way
    `done` stays False unless every partition was settled.

    Args:
        engine: The built engine (`InferenceEngine`, or a fake in tests).
        spec: The job spec the engine is bound to.
        partition_keys: The partitions to compute (preflighted, not committed yet).
        on_committed: Called with (manifest, computed) for each committed partition.
        on_failed: Called with (error, key) for each shard that cannot be processed.
        model_version: The local model folder's version (`storage.model_version`).
        on_chunk: Called (from the writer thread) after each chunk's marker is written.
        chunk_range: A pool worker's chunk-range lease of its one partition
            (`pools/ranges.py`, `RunCoordinator`).
    """

    def __init__(
        self,
        engine: LoopEngine,
        spec: InferenceSpec,
        partition_keys: list[str],
        on_committed: Callable[[Manifest, bool], None],
        on_failed: Callable[[ShardError, str], None],
        model_version: str | None,
        *,
        on_chunk: Callable[[ChunkCommitted], None] | None = None,
        chunk_range: ChunkRange | None = None,
    ) -> None:
        self.engine = engine
        self.chunk_range = chunk_range
        self.spec = spec
        self.partition_keys = partition_keys
        self.on_committed = on_committed
        self.on_failed = on_failed
        self.model_version = model_version
        self.on_chunk = on_chunk
        self.done = False
        self.inference_seconds = 0.0
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._loop: EngineLoop | None = None

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """End the loop now (from any thread); chunks not yet written are dropped."""
        with self._lock:
            self._stopped.set()
            loop = self._loop
        if loop is not None:
            loop.stop()

    def run(self, model_load_seconds: float = 0.0) -> None:
        """Serve until every partition is settled, a drain ends, or `stop`; sets `done` and
        `inference_seconds`.

        Raises:
            Exception: what the reader, the committer or the engine loop died of.
        """
        chunks: queue.Queue[WorkChunk | None] = queue.Queue()
        coordinator = RunCoordinator(
            self.spec,
            self.partition_keys,
            on_committed=self.on_committed,
            on_failed=self.on_failed,
            put=admit_unless_draining(chunks.put),
            engines=1,
            max_outstanding=max_outstanding_chunks(self.spec, 1, self.engine.window),
            model_version=self.model_version,
            chunk_range=self.chunk_range,
        )

        def committed(message: ChunkCommitted) -> None:
            coordinator.chunk_committed(message)
            if self.on_chunk is not None:
                self.on_chunk(message)

        loop = EngineLoop(self.engine, self.spec, take_unless_draining(chunks.get), committed)
        with self._lock:
            self._loop = loop
            if self._stopped.is_set():
                loop.stop()
        coordinator.start(model_load_seconds)
        try:
            loop.run()
        finally:
            coordinator.stop()
        coordinator.check()
        self.inference_seconds = time.perf_counter() - (coordinator.started or 0.0)
        self.done = not self._stopped.is_set() and coordinator.done()


def admit_unless_draining(
    put: Callable[[WorkChunk | None], None],
) -> Callable[[WorkChunk | None], None]:
    """`put` for the coordinator: after a SIGTERM, chunks are no longer handed out (the end
    markers, None, still are)."""

    def admit(item: WorkChunk | None) -> None:
        if item is not None and draining():
            return
        put(item)

    return admit


def take_unless_draining(
    get: Callable[..., WorkChunk | None],
) -> Callable[..., WorkChunk | None]:
    """`take` for an engine loop: None (no more work) once a SIGTERM came, else the next
    chunk, or `queue.Empty` when none came within `timeout` (the loop asks again)."""

    def take(timeout: float = POLL_SECONDS) -> WorkChunk | None:
        if draining():
            return None
        return get(timeout=timeout)

    return take


def drained_error(partition_keys: list[str]) -> Drained:
    return Drained(
        "the worker stopped after SIGTERM: it admitted no more rows, and the chunks in flight "
        "finished and were committed; partitions of this run not reported as committed "
        f"(of {', '.join(partition_keys[:20])}) resume from their committed chunks when the "
        "run is retried or rerun"
    )


# --------------------------------------------------------------------------- placement


def detect_device() -> str:
    """`cuda` when a GPU is visible to torch, else `cpu`. `GPUINFER_DEVICE` overrides."""
    forced = os.environ.get("GPUINFER_DEVICE")
    if forced:
        return forced
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def visible_gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_replica_env(
    *,
    replicas: int,
    tensor_parallel_size: int,
    device: str,
    gpu_ids: list[str],
    cpu_ids: list[int],
    pipeline_parallel_size: int = 1,
) -> list[dict[str, str]]:
    """The environment of each replica: which GPUs, or which CPU cores, it may use.

    A pure function. A replica's engine has tp x pp ranks (`per`): GPU replica i gets GPUs
    [i*per, (i+1)*per) of the visible ones; CPU replicas split the cores (vLLM's
    `VLLM_CPU_OMP_THREADS_BIND`, one range per rank separated by `|`), sharing cores
    round-robin when there are fewer cores than ranks.

    Raises:
        SpecError: a GPU worker sees fewer GPUs than replicas x tp x pp.
    """
    per = tensor_parallel_size * pipeline_parallel_size
    ranks = replicas * per
    if device == "cuda":
        if len(gpu_ids) < ranks:
            raise SpecError(
                f"replicas={replicas} x tensor_parallel_size={tensor_parallel_size} x "
                f"pipeline_parallel_size={pipeline_parallel_size} needs {ranks} GPUs but this "
                f"worker sees {len(gpu_ids)} ({','.join(gpu_ids) or 'none'}). Lower replicas, "
                "tensor_parallel_size or pipeline_parallel_size, or request more GPUs per pod"
            )
        return [
            {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids[i * per : (i + 1) * per])}
            for i in range(replicas)
        ]
    cores = sorted(cpu_ids)
    if len(cores) >= ranks:
        per_rank = len(cores) // ranks
        groups = [cores[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]
    else:
        groups = [[cores[r % len(cores)]] for r in range(ranks)]
    envs = []
    for i in range(replicas):
        rank_groups = groups[i * per : (i + 1) * per]
        bind = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in rank_groups)
        envs.append({"VLLM_CPU_OMP_THREADS_BIND": bind})
    return envs


# --------------------------------------------------------------------------- replicas

# The queues between this process and its replicas: chunks out (None: no more), messages back.
ChunkQueue: TypeAlias = "multiprocessing.queues.Queue[WorkChunk | None]"
MessageQueue: TypeAlias = "multiprocessing.queues.Queue[ReplicaMessage]"


def run_replicas(
    spec: InferenceSpec,
    partition_keys: list[str],
    replicas: int,
    on_committed: Callable[[Manifest, bool], None],
    on_failed: Callable[[ShardError, str], None],
    model_version: str | None,
) -> RunTiming:
    """Serve `partition_keys` with `replicas` engine processes pulling chunks from one queue.

    This process reads the shards and commits the partitions (`RunCoordinator`); replicas
    validate, tokenize, infer and write chunks. A shard that cannot be processed goes to
    `on_failed`; the others go on.
    """
    processes, tasks, results = start_replica_processes(spec, replicas)
    put = admit_unless_draining(tasks.put)
    run = _ReplicaRun(spec, partition_keys, replicas, on_committed, on_failed, put, model_version)
    forwarded = False
    try:
        while run.finished_replicas < replicas:
            if run.coordinator is not None:
                run.coordinator.check()
            if draining() and not forwarded:  # each replica drains its own engine
                forwarded = True
                forward_sigterm(processes)
            message = next_replica_message(results, processes, partition_keys)
            if message is None:
                continue
            run.handle(message)
        coordinator = run.started_coordinator()
        coordinator.check()
        run.timing.inference_seconds = time.perf_counter() - (coordinator.started or 0.0)
    except BaseException:
        if run.coordinator is not None:
            run.coordinator.stop()
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    if draining():
        coordinator.stop()  # its reader may wait for a slot no dropped chunk will free
    if not coordinator.done():
        if draining():
            raise drained_error(partition_keys)
        raise RuntimeError("replicas finished before every partition of the run was settled")
    return run.timing


@dataclass
class _ReplicaRun:
    """The parent's side of a replica run: what each replica message does."""

    spec: InferenceSpec
    partition_keys: list[str]
    replicas: int
    on_committed: Callable[[Manifest, bool], None]
    on_failed: Callable[[ShardError, str], None]
    put: Callable[[WorkChunk | None], None]
    model_version: str | None  # the local model folder's (`storage.model_version`)
    timing: RunTiming = field(default_factory=RunTiming)
    coordinator: RunCoordinator | None = None
    finished_replicas: int = 0

    def started_coordinator(self) -> RunCoordinator:
        if self.coordinator is None:
            raise RuntimeError("a replica sent chunks before every engine was loaded")
        return self.coordinator

    def handle(self, message: ReplicaMessage) -> None:
        if isinstance(message, ReplicaLoaded):
            # Reading starts once every engine is ready: engines of one worker start
            # together, and the first one ready would otherwise take the head of the
            # work while the others load (and partition times would include loading).
            self.timing.load_seconds.append(message.load_seconds)
            if len(self.timing.load_seconds) == self.replicas:
                self.coordinator = RunCoordinator(
                    self.spec,
                    self.partition_keys,
                    on_committed=self.on_committed,
                    on_failed=self.on_failed,
                    put=self.put,
                    engines=self.replicas,
                    max_outstanding=max_outstanding_chunks(
                        self.spec, self.replicas, message.window
                    ),
                    model_version=self.model_version,
                )
                self.coordinator.start(max(self.timing.load_seconds))
        elif isinstance(message, ReplicaChunk):
            self.started_coordinator().chunk_committed(message.committed)
        elif isinstance(message, ReplicaFinished):
            self.finished_replicas += 1
            self.timing.shutdown_seconds.append(message.shutdown_seconds)
        elif isinstance(message, ReplicaUserError):
            raise message.error()
        elif isinstance(message, ReplicaCrashed):
            if message.engine_died:
                last = message.traceback.strip().splitlines()[-1:] or ["no traceback"]
                raise EngineDied(f"the vLLM engine of replica {message.replica} died ({last[0]})")
            raise RuntimeError(f"replica {message.replica} failed:\n{message.traceback}")
        else:
            raise TypeError(f"unknown replica message {message!r}")


def start_replica_processes(
    spec: InferenceSpec, replicas: int
) -> tuple[list[BaseProcess], ChunkQueue, MessageQueue]:
    """Start `replicas` spawned replica processes, each pinned to its devices; returns them,
    the queue of chunks they take from and the queue of their messages."""
    device = detect_device()
    envs = plan_replica_env(
        replicas=replicas,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        device=device,
        gpu_ids=visible_gpu_ids() if device == "cuda" else [],
        cpu_ids=sorted(os.sched_getaffinity(0)),
    )
    ctx = mp.get_context("spawn")
    tasks: ChunkQueue = ctx.Queue()
    results: MessageQueue = ctx.Queue()
    spec_json = spec.model_dump_json()
    processes: list[BaseProcess] = [
        ctx.Process(
            target=replica_main,
            args=(spec_json, index, envs[index], tasks, results),
            name=f"gpuinfer-replica-{index}",
            daemon=False,  # each replica starts vLLM's own engine process
        )
        for index in range(replicas)
    ]
    for process in processes:
        process.start()
    return processes, tasks, results


def forward_sigterm(processes: list[BaseProcess]) -> None:
    """Pass this worker's SIGTERM on: each replica drains its own engine."""
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)


def next_replica_message(
    results: MessageQueue, processes: list[BaseProcess], partition_keys: list[str]
) -> ReplicaMessage | None:
    """The next message of a replica, or None after a poll without one.

    Raises:
        RuntimeError: a replica process died without saying why.
    """
    try:
        return results.get(timeout=POLL_SECONDS)
    except queue.Empty:
        dead = [p for p in processes if p.exitcode not in (None, 0)]
        if dead and dead[0].exitcode == EXIT_ENGINE_DIED:  # its own EngineWatch saw it
            raise EngineDied(
                f"the vLLM engine of replica process {dead[0].name} died (it exited with "
                f"code {EXIT_ENGINE_DIED}); partitions not committed: {partition_keys}"
            ) from None
        if dead:
            raise RuntimeError(
                f"replica process {dead[0].name} died with exit code {dead[0].exitcode} "
                f"before finishing; partitions not committed: {partition_keys}"
            ) from None
        return None


def replica_main(
    spec_json: str, index: int, env: dict[str, str], tasks: ChunkQueue, results: MessageQueue
) -> None:
    """Body of one replica process: pin devices, build one engine, serve chunks until done."""
    os.environ.update(env)
    install_signal_handlers()  # the parent forwards its SIGTERM: drain this engine
    children_die_with_this_process()  # this replica's engine dies with it
    logging.basicConfig(level=logging.INFO, format=f"[replica {index}] %(message)s")
    spec = InferenceSpec.model_validate_json(spec_json)
    metrics = start_worker_metrics(asset=spec.output.asset_name, process=f"replica-{index}")
    metrics.serves_task(spec.task)
    engine = None
    try:
        engine = InferenceEngine(spec)
        results.put(ReplicaLoaded(index, engine.load_seconds, engine.window))
        serve_chunks(
            engine,
            spec,
            take_unless_draining(tasks.get),
            lambda committed: results.put(ReplicaChunk(index, committed)),
            replica=index,
        )
        shutdown_started = time.perf_counter()
        engine.shutdown()
        engine = None
        results.put(ReplicaFinished(index, time.perf_counter() - shutdown_started))
    except WorkerError as exc:
        results.put(ReplicaUserError(index, type(exc).__name__, str(exc), exc.partition_key))
    except BaseException as exc:
        died = engine_death_in(exc) is not None
        results.put(ReplicaCrashed(index, traceback.format_exc(), engine_died=died))
    finally:
        if engine is not None:
            engine.shutdown()
        metrics.close()
