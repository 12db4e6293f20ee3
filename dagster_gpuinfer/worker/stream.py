"""The streaming loop of one engine: a bounded window of requests in flight, across chunks.

An engine serves chunks (`WorkChunk`: rows of one shard, ids already screened where the shard
is read) that it takes from its run's queue, wherever they come from: one shard or several,
in any order. Three threads share the work:

- prepare (ahead): takes the next chunk when the read-ahead has room, validates it, renders
  chat templates and tokenizes it;
- engine (this thread): keeps `engine.window` requests in flight (`submit` / `step`), taking
  rows from the read-ahead grouped by shared prompt prefix (`spec.group_prefixes`), so the
  engine never drains to a chunk's slowest row;
- write (behind): when the last row of a chunk is done, writes its part file and its errors,
  then its marker (the chunk's commit), and reports the chunk as committed.

The chunk stays the unit of commit and resume, and memory stays bounded by the window and
the read-ahead, never by the shard. Outputs are keyed by row: each request carries its row's
place in its chunk, and a chunk's table is written in input order. Each generate/chat row is
submitted with its own `SamplingParams` (`RowRequest.sampling`, from the line's parameters);
an embeddings row whose input is a list submits one request per element.

Tasks `score` and `classify` take another path through the same threads: the engine thread
runs each prepared chunk through one `LLM.score` / `LLM.classify` call
(`tasks.WorkerTask.run_chunk`), since vLLM's offline scoring pairs and tokenizes inside
that call; reading ahead, writing behind and committing are the same.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import ChunkMarker
from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.commit import PartitionOutput, write_chunk
from dagster_gpuinfer.worker.engine import ChunkResult, InferenceEngine, RequestRejected
from dagster_gpuinfer.worker.engine_time import EngineTimeShares
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.readers import RawChunk
from dagster_gpuinfer.worker.validate import RowValidator, ValidChunk

log = logging.getLogger("dagster_gpuinfer.worker")

POLL_SECONDS = 0.2


@dataclass
class WorkChunk:
    """One chunk of a shard, for any engine of the run (picklable: it crosses processes)."""

    partition_key: str
    attempt: str  # names this run's files of the partition (see `chunk_part_name`)
    chunk: RawChunk  # ids screened in shard order (`screen_ids`)


@dataclass
class ChunkCommitted:
    """An engine wrote a chunk and its marker (picklable: it crosses processes)."""

    partition_key: str
    marker: ChunkMarker
    replica: int


@dataclass
class _ChunkInFlight:
    """A chunk between preparation and writing: one request per prompt of `valid.token_ids`
    (one per row, but for embedding rows whose input is a list), outputs by prompt."""

    work: WorkChunk
    valid: ValidChunk
    outputs: list[Any] = field(default_factory=list)
    remaining: int = 0
    first_submitted: float | None = None
    engine_seconds: float = 0.0  # its rows' share of the engine's time (`EngineTimeShares`)
    result: Any = None  # score/classify: the chunk's `PoolingResult`, computed whole
    rejected: dict[int, str] = field(default_factory=dict)  # prompt position -> why

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.valid.token_ids)
        self.remaining = len(self.valid.token_ids)

    def params(self, position: int) -> Any:
        """The vLLM params of the request at `position` (None: the engine's defaults)."""
        if len(self.valid.requests) != len(self.valid.token_ids):
            return None  # embeddings: rows and prompts differ; PoolingParams are all alike
        return self.valid.requests[position].sampling


class _Worker(threading.Thread):
    """A daemon thread that keeps the exception it died of."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as exc:  # handed to the engine thread, which raises it
            self.error = exc


def serve_chunks(
    engine: InferenceEngine,
    spec: InferenceSpec,
    take: Callable[[], WorkChunk | None],
    committed: Callable[[ChunkCommitted], None],
    *,
    replica: int = 0,
) -> int:
    """Serve chunks from `take` (None: no more) until all are committed; returns the rows
    inferred. `committed` is called (from the writer thread) after each chunk's marker.

    Raises:
        Exception: whatever a thread died of (reading, the engine, storage): the run fails and
            a retry resumes from the committed chunks.
    """
    # One chunk prepared ahead of the rows waiting: each engine holds at most its window in
    # flight, a window (or a chunk) waiting, and two chunks in preparation, so engines that
    # share a queue share its chunks, and memory is bounded by the window.
    prepared: queue.Queue[_ChunkInFlight | None] = queue.Queue(maxsize=1)
    finished: queue.Queue[_ChunkInFlight | None] = queue.Queue()
    validator = RowValidator(
        task=spec.task,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        requests=engine.requests,
        limits=spec.limits,
        images=spec.input.images,
        storage=spec.storage,
    )
    stopping = threading.Event()

    def prepare() -> None:
        while not stopping.is_set():
            work = take()
            if work is None:
                break
            item = _ChunkInFlight(work, validator.validate(work.chunk))
            if not _put_until(prepared, item, stopping):
                return
        _put_until(prepared, None, stopping)  # after a stop nobody reads it: never block

    def write() -> None:
        _write_finished(spec, finished, committed, replica)

    threads = (_Worker("gpuinfer-prepare", prepare), _Worker("gpuinfer-write", write))
    for thread in threads:
        thread.start()
    try:
        if not task_facts(spec.task).streams:
            return _serve_whole_chunks(engine, spec, prepared, finished, threads)
        loop = _RequestWindow(engine, spec, finished)
        while not loop.done:
            for thread in threads:
                if thread.error is not None:
                    raise thread.error
            loop.read_ahead(prepared, threads)
            loop.fill()
            loop.step()
        _finish_writing(finished, threads[1])
        return loop.rows
    finally:
        stopping.set()
        if threads[1].is_alive():
            finished.put(None)


def _write_finished(
    spec: InferenceSpec,
    finished: queue.Queue[_ChunkInFlight | None],
    committed: Callable[[ChunkCommitted], None],
    replica: int,
) -> None:
    """The writer thread: each finished chunk's part file, errors and marker, in turn."""
    locations: dict[str, PartitionOutput] = {}
    while True:
        item = finished.get()
        if item is None:
            return
        key = item.work.partition_key
        where = locations.get(key) or locations.setdefault(key, PartitionOutput.of(spec, key))
        result, valid = item.result, item.valid
        if result is None:
            outputs = item.outputs
            if item.rejected:  # rows the engine refused at submit join the errors
                valid, outputs = valid.without_prompts(
                    item.rejected, outputs, item.work.chunk.source
                )
            seconds = time.perf_counter() - (item.first_submitted or time.perf_counter())
            result = ChunkResult.from_outputs(spec.task, outputs, seconds, requests=valid.requests)
        marker = write_chunk(
            spec,
            where,
            item.work.chunk,
            valid,
            result,
            item.work.attempt,
            engine_seconds=result.seconds if item.result is not None else item.engine_seconds,
        )
        committed(ChunkCommitted(partition_key=key, marker=marker, replica=replica))


def _finish_writing(finished: queue.Queue[_ChunkInFlight | None], writer: _Worker) -> None:
    """Tell the writer there is no more, wait for it, and raise what it died of."""
    finished.put(None)
    while writer.is_alive():
        writer.join(POLL_SECONDS)
    if writer.error is not None:
        raise writer.error


class _RequestWindow:
    """The engine thread's state: rows read ahead, rows ordered for submission, requests in
    flight; one step each of reading ahead, filling the window and stepping the engine."""

    def __init__(
        self,
        engine: InferenceEngine,
        spec: InferenceSpec,
        finished: queue.Queue[_ChunkInFlight | None],
    ) -> None:
        self.engine = engine
        self.window = engine.window
        self.finished = finished
        self.metrics = current_metrics()
        self.group = spec.group_prefixes and task_facts(spec.task).groups_prefixes
        self.engine_time = EngineTimeShares(
            pooling=task_facts(spec.task).pooling, max_running=engine.max_num_seqs
        )
        self.requests: dict[str, tuple[_ChunkInFlight, int]] = {}
        self.incoming: deque[tuple[_ChunkInFlight, int]] = deque()  # read ahead, not ordered
        self.current: deque[tuple[_ChunkInFlight, int]] = deque()  # ordered, being submitted
        self.prepared_all = False
        self.sequence = 0
        self.rows = 0
        self.done = False

    def read_ahead(
        self, prepared: queue.Queue[_ChunkInFlight | None], threads: tuple[_Worker, _Worker]
    ) -> None:
        """Up to a window's worth of rows waits beside the window in flight."""
        engine = self.engine
        while not self.prepared_all and len(self.incoming) + len(self.current) < self.window:
            idle = engine.in_flight == 0 and not self.current
            try:
                item = prepared.get(timeout=POLL_SECONDS) if idle else prepared.get_nowait()
            except queue.Empty:
                if idle and all(thread.error is None for thread in threads):
                    continue
                break
            if item is None:
                self.prepared_all = True
                break
            if item.remaining == 0:  # every row quarantined: nothing for the engine
                self.finished.put(item)
                continue
            self.incoming.extend((item, position) for position in range(item.remaining))

    def fill(self) -> None:
        """Fill the window. Rows read ahead are ordered a batch at a time, so no row waits
        behind later arrivals. A batch is all that waits once a window of rows waits, or the
        input is all read, or the engine's batch (`max_num_seqs`) is not full: the first
        batch (nothing submitted yet) waits for a full window, so prompts that share a prefix
        reach the engine together from the start, for the price of preparing one window."""
        engine = self.engine
        while engine.in_flight < self.window:
            if not self.current:
                batch_ready = (
                    len(self.incoming) >= self.window
                    or self.prepared_all
                    or (self.sequence > 0 and engine.in_flight < engine.max_num_seqs)
                )
                if not self.incoming or not batch_ready:
                    break
                batch = list(self.incoming)
                self.incoming.clear()
                if self.group:
                    batch.sort(key=lambda entry: entry[0].valid.token_ids[entry[1]])
                self.current.extend(batch)
            self._submit(*self.current.popleft())

    def _submit(self, item: _ChunkInFlight, position: int) -> None:
        request_id = str(self.sequence)
        self.sequence += 1
        if item.first_submitted is None:
            item.first_submitted = time.perf_counter()
        images = item.valid.images[position] if item.valid.images else None
        extra = {"images": images} if images else {}  # image tasks only
        try:
            self.engine.submit(
                request_id, item.valid.token_ids[position], item.params(position), **extra
            )
        except RequestRejected as exc:  # that row is quarantined, the rest go on
            item.rejected[position] = str(exc)
            self._settled(item)
            return
        self.requests[request_id] = (item, position)
        self.engine_time.submitted(request_id, item)
        self.metrics.requests_started(1)

    def _settled(self, item: _ChunkInFlight) -> None:
        item.remaining -= 1
        if item.remaining == 0:
            self.finished.put(item)

    def step(self) -> None:
        """One engine step, its finished requests put in place; `done` once all are in."""
        if self.engine.in_flight == 0:
            self.done = self.prepared_all and not self.incoming and not self.current
            return
        step_started = time.perf_counter()
        finished = self.engine.step()
        self.engine_time.stepped(
            time.perf_counter() - step_started,
            [(request_id, self.requests[request_id][0]) for request_id, _ in finished],
        )
        if finished:
            self.metrics.requests_finished(len(finished))
        for request_id, output in finished:
            item, position = self.requests.pop(request_id)
            item.outputs[position] = output
            self.rows += 1
            self._settled(item)


def _put_until(target: queue.Queue[Any], item: Any, stopping: threading.Event) -> bool:
    """Put `item` on the bounded queue unless `stopping` is set first; whether it went."""
    while not stopping.is_set():
        try:
            target.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _serve_whole_chunks(
    engine: InferenceEngine,
    spec: InferenceSpec,
    prepared: queue.Queue[_ChunkInFlight | None],
    finished: queue.Queue[_ChunkInFlight | None],
    threads: tuple[_Worker, _Worker],
) -> int:
    """score / classify: each prepared chunk through one `LLM.score` / `LLM.classify` call
    in this (the engine) thread, then to the writer; returns the rows inferred."""
    metrics = current_metrics()
    preparer, writer = threads
    rows = 0
    while True:
        for thread in threads:
            if thread.error is not None:
                raise thread.error
        try:
            item = prepared.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        if item is None:
            break
        count = len(item.valid.ids)  # none: every row quarantined, empty columns
        metrics.requests_started(count)
        try:
            item.result = engine.task.run_chunk(engine, item.valid)
        finally:
            metrics.requests_finished(count)
        rows += count
        finished.put(item)
    finished.put(None)
    while writer.is_alive():
        writer.join(POLL_SECONDS)
    if writer.error is not None:
        raise writer.error
    return rows
