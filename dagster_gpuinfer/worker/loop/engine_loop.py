"""The streaming loop of one engine: a bounded window of requests in flight, across chunks.

An engine serves chunks (`WorkChunk`: rows of one shard, ids already screened where the shard
is read) that it takes from its run's queue, wherever they come from: one shard or several,
in any order. Three threads share the work (four for image tasks):

- prepare (ahead): takes the next chunk when the read-ahead has room, validates it (image
  tasks: decodes its images in the decoder's pool), renders chat templates and tokenizes it;
- engine (this thread): keeps `engine.window` requests in flight (`submit` / `step`), taking
  rows from the read-ahead grouped by shared prompt prefix (`spec.group_prefixes`, where
  that brings whole KV blocks together: `prefix_order`), so the engine never drains to a
  chunk's slowest row;
- write (behind): when the last row of a chunk is done, writes its part file and its errors,
  then its marker (the chunk's commit), and reports the chunk as committed;
- render (image tasks only, between prepare and engine): vLLM's input processing of each
  image prompt (`render_images`), so one chunk's images decode while the one before renders.

The chunk stays the unit of commit and resume, and memory stays bounded by the window and
the read-ahead, never by the shard. Outputs are keyed by row: each request carries its row's
place in its chunk, and a chunk's table is written in input order. Each generate/chat row is
submitted with its own `SamplingParams` (`RowRequest.sampling`, from the line's parameters);
an embeddings row whose input is a list submits one request per element.

Every task goes through the one loop (`EngineLoop`). Tasks `score` and `classify` go through
it behind `WholeChunks`, an engine whose one request is a whole chunk, run by one
`LLM.score` / `LLM.classify` call (`tasks.WorkerTask.run_chunk`), since vLLM's offline
scoring pairs, tokenizes and batches inside that call; reading ahead, writing behind, stopping
and failing are the same code for every task.

The engine is injected: a `LoopEngine` (`submit`, `step`, `in_flight`, `window`,
`max_num_seqs`, and what validation reads; `InferenceEngine` in a worker, a fake in
`tests/test_engine_loop.py`). The
loop never commits a partition: it hands each written chunk to `committed`, and the run's
coordinator commits, in its one committing thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import ChunkMarker, PartitionOutput, SourceVersion
from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.commit import write_chunk
from dagster_gpuinfer.worker.loop.engine_time import EngineTimeShares
from dagster_gpuinfer.worker.loop.reuse import ChunkPlan, RowReuse
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.rows.validate import RowValidator, ValidChunk
from dagster_gpuinfer.worker.rows.writers import output_table
from dagster_gpuinfer.worker.stage_messages import (
    POLL_SECONDS,
    ChunkCommitted,
    ChunkResult,
    RequestRejected,
    WorkChunk,
)
from dagster_gpuinfer.worker.tasks.table import WorkerTask, worker_task

log = logging.getLogger("dagster_gpuinfer.worker")

# Image prompts the render thread hands the engine thread at a time: one at a time gives the
# engine batches of one (more engine steps, each with its overhead); a whole chunk delays
# its first request by the chunk's rendering.
RENDER_BATCH = 64
# vLLM's KV block size on GPUs, for an engine that does not say its own (`block_size`).
DEFAULT_BLOCK_SIZE = 16


class SteppedEngine(Protocol):
    """What the loop's engine thread drives: requests in (`submit`), finished outputs out
    (`step`), at most `window` in flight (`max_num_seqs`: the engine's batch).

    `submit`'s prompt is a row's token ids (`WholeChunks`: a whole `ValidChunk`); the
    keywords carry an image row's decoded `images` or `rendered` prompt and a LoRA row's
    `adapter`. `step` returns `(request_id, output)` for each request that finished."""

    window: int
    max_num_seqs: int

    @property
    def in_flight(self) -> int: ...

    def submit(
        self,
        request_id: str,
        prompt: Any,
        params: Any = None,
        /,
        *,
        images: list[Any] | None = None,
        rendered: Any = None,
        adapter: str | None = None,
    ) -> None: ...

    def step(self) -> list[tuple[str, Any]]: ...


class LoopEngine(SteppedEngine, Protocol):
    """The engine an `EngineLoop` serves on (`InferenceEngine`, or a fake in tests): a
    `SteppedEngine` plus what validating rows reads (its tokenizer, length and request
    builder) and what the task calls (`llm`, for score/classify's whole-chunk calls).

    Optional, read with `getattr`: `image_fit` (the model's image resize), `renders` and
    `render(token_ids, images)` (vLLM's input processing off the engine thread),
    `block_size` (KV block size, for prefix grouping)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def requests(self) -> RequestBuilder: ...

    @property
    def llm(self) -> Any: ...


class PromptRenderer(Protocol):
    """An engine that prepares image prompts ahead of `submit` (`InferenceEngine.render`)."""

    def render(self, token_ids: list[int], images: list[Any] | None) -> Any: ...


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
    # Image prompts rendered by the render thread (`render_images`): position -> vLLM's
    # input, or the `RequestRejected` its rendering raised; taken at submit. `rendering` is
    # set while the render thread works through the chunk: positions below `rendered_count`
    # are ready.
    rendered: dict[int, Any] = field(default_factory=dict)
    rendering: threading.Condition | None = None
    rendered_count: int = 0
    render_failed: BaseException | None = None  # what the render thread died of
    whole: bool = False  # score/classify: the chunk is one request (`WholeChunks`)
    # Row reuse (`reuse.ChunkPlan`): where each row of the chunk gets its output; `valid`
    # then holds only the rows the engine computes.
    plan: ChunkPlan | None = None

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.valid.token_ids)
        if self.whole:
            self.remaining = 1 if self.valid.ids else 0
        else:
            self.remaining = len(self.valid.token_ids)

    def prompt(self, position: int) -> Any:
        """What the engine is given for the request at `position` (`WholeChunks`: the chunk)."""
        return self.valid if self.whole else self.valid.token_ids[position]

    def rows_of(self, position: int) -> int:
        """Rows the request at `position` infers (`WholeChunks`: every valid row of the chunk)."""
        return len(self.valid.ids) if self.whole else 1

    def done(self, position: int, output: Any) -> None:
        """The request at `position` finished with `output`."""
        if self.whole:
            self.result = output
        else:
            self.outputs[position] = output

    def params(self, position: int) -> Any:
        """The vLLM params of the request at `position` (None: the engine's defaults)."""
        if self.whole or len(self.valid.requests) != len(self.valid.token_ids):
            return None  # embeddings: rows and prompts differ; PoolingParams are all alike
        return self.valid.requests[position].sampling

    def adapter(self, position: int) -> str | None:
        """The LoRA adapter the request at `position` names (None: the base model)."""
        if self.whole or len(self.valid.requests) != len(self.valid.token_ids):
            return None  # pooling tasks: never an adapter (`InferenceSpec._check_adapters`)
        return self.valid.requests[position].adapter


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
    engine: LoopEngine,
    spec: InferenceSpec,
    take: Callable[..., WorkChunk | None],
    committed: Callable[[ChunkCommitted], None],
    *,
    replica: int = 0,
) -> int:
    """Serve chunks from `take` until all are committed; returns the rows inferred (see
    `EngineLoop`)."""
    return EngineLoop(engine, spec, take, committed, replica=replica).run()


class EngineLoop:
    """One engine's loop, for every task: read ahead, fill the window, collect, write behind.

    Args:
        engine: What the loop calls (`InferenceEngine`, or a fake in tests): `submit`,
            `step`, `in_flight`, `window`, `max_num_seqs`, and for validation `tokenizer`,
            `max_model_len`, `requests`; score/classify engines go behind `WholeChunks`.
        spec: The job spec.
        take: `take(timeout=seconds)`: the next chunk, None (no more), or `queue.Empty`
            (none yet: asked again, so a stop is seen within `POLL_SECONDS`).
        committed: Called (from the writer thread) after each chunk's marker is written.
        replica: This engine's index, recorded with each committed chunk.

    `run` serves until every chunk taken is committed; `stop` (any thread) makes it return
    within about `POLL_SECONDS` plus the chunk being written: chunks not yet written are
    dropped (no part of them is committed; a retry infers them again).
    """

    def __init__(
        self,
        engine: LoopEngine,
        spec: InferenceSpec,
        take: Callable[..., WorkChunk | None],
        committed: Callable[[ChunkCommitted], None],
        *,
        replica: int = 0,
    ) -> None:
        self.spec = spec
        self.take = take
        self.committed = committed
        self.replica = replica
        self.validator = RowValidator(
            task=spec.task,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            requests=engine.requests,
            limits=spec.limits,
            images=spec.input.images,
            storage=spec.storage,
            image_fit=getattr(engine, "image_fit", None),
        )
        task = worker_task(spec.task)
        stepped: SteppedEngine = engine if task.facts.streams else WholeChunks(engine, task)
        # One chunk prepared ahead of the rows waiting: each engine holds at most its window
        # in flight, a window (or a chunk) waiting, and two chunks in preparation, so engines
        # that share a queue share its chunks, and memory is bounded by the window.
        self.prepared: queue.Queue[_ChunkInFlight | None] = queue.Queue(maxsize=1)
        self.finished: queue.Queue[_ChunkInFlight | None] = queue.Queue()
        self.stopping = threading.Event()
        self.window = _RequestWindow(stepped, spec, self.finished, self.stopping)
        self.reuse = RowReuse(spec)
        threads = [
            _Worker("gpuinfer-prepare", self._prepare),
            _Worker("gpuinfer-write", self._write),
        ]
        # Image prompts: vLLM's input processing (the model's image processor) runs in a
        # stage of its own between preparing and the engine, so one chunk's images decode
        # while the one before is rendered (`render_images`).
        self.validated: queue.Queue[_ChunkInFlight | None] | None = None
        self.renderer: PromptRenderer | None = None
        if task.facts.images and getattr(engine, "renders", False):
            self.renderer = cast(PromptRenderer, engine)
            self.validated = queue.Queue(maxsize=1)
            threads.append(_Worker("gpuinfer-render", self._render))
        self.threads = tuple(threads)

    def stop(self) -> None:
        """Ask `run` to return now (from any thread); chunks not yet written are dropped."""
        self.stopping.set()

    def run(self) -> int:
        """Serve until every chunk is committed (or `stop`); returns the rows inferred.

        Raises:
            Exception: whatever a thread died of (reading, the engine, storage): the run
                fails, and a retry resumes from the committed chunks. No thread is left
                running either way.
        """
        for thread in self.threads:
            thread.start()
        try:
            while not self.window.done and not self.stopping.is_set():
                self._raise_thread_error()
                self.window.read_ahead(self.prepared, self.threads)
                self.window.fill()
                self.window.step()
            if not self.stopping.is_set():
                self.finished.put(None)  # the writer writes what is left, then ends
                self.threads[1].join()  # the writer
        except BaseException:
            self.stopping.set()
            raise
        finally:
            self.stopping.set()
            for thread in self.threads:
                thread.join()
            self.validator.close()  # the image decoder's pool: no thread outlives the loop
        self._raise_thread_error()
        return self.window.rows

    def _raise_thread_error(self) -> None:
        for thread in self.threads:
            if thread.error is not None:
                raise thread.error

    def _prepare(self) -> None:
        """The prepare thread: take, validate and tokenize chunks while there is room."""
        ahead = self.prepared if self.validated is None else self.validated
        while not self.stopping.is_set():
            try:
                work = self.take(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if work is None:
                break
            whole = isinstance(self.window.engine, WholeChunks)
            valid = self.validator.validate(work.chunk)
            plan = None
            if self.reuse.keys.keyed:  # the engine gets the rows no earlier output holds
                plan = self.reuse.plan(work.partition_key, work.source, valid)
                valid = valid.subset(plan.compute)
            item = _ChunkInFlight(work, valid, whole=whole, plan=plan)
            if not _put_until(ahead, item, self.stopping):
                return
        _put_until(ahead, None, self.stopping)  # after a stop nobody reads it

    def _render(self) -> None:
        """The render thread (image tasks): hands each validated chunk to the engine thread,
        then runs its prompts through vLLM's input processing in order; the engine thread
        submits each prompt once it is rendered, so the first request of a chunk does not
        wait for its last image."""
        assert self.validated is not None and self.renderer is not None
        while not self.stopping.is_set():
            try:
                item = self.validated.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if item is not None and item.valid.images:
                item.rendering = threading.Condition()
            if not _put_until(self.prepared, item, self.stopping) or item is None:
                return
            render_images(self.renderer, item, self.stopping)

    def _write(self) -> None:
        """The writer thread: each finished chunk's part file, errors and marker, in turn."""
        locations: dict[tuple[str, SourceVersion], PartitionOutput] = {}
        while True:
            try:
                item = self.finished.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self.stopping.is_set():
                    return
                continue
            if item is None or self.stopping.is_set():
                return
            key = item.work.partition_key
            place = (key, item.work.source)
            where = locations.get(place) or locations.setdefault(
                place, PartitionOutput.of(self.spec, key, source=item.work.source)
            )
            marker = _write_chunk(self.spec, where, item, self.reuse)
            self.committed(ChunkCommitted(partition_key=key, marker=marker, replica=self.replica))


def _write_chunk(
    spec: InferenceSpec, where: PartitionOutput, item: _ChunkInFlight, reuse: RowReuse
) -> ChunkMarker:
    """Write one finished chunk (part file, errors, then its marker); returns the marker.
    With a reuse plan, the computed rows and the copied ones go into one part file, in
    input order (`RowReuse.assemble`)."""
    result, valid = item.result, item.valid
    if result is None:
        outputs = item.outputs
        if item.rejected:  # rows the engine refused at submit join the errors
            valid, outputs = valid.without_prompts(item.rejected, outputs, item.work.chunk.source)
        seconds = time.perf_counter() - (item.first_submitted or time.perf_counter())
        result = ChunkResult.from_outputs(spec.task, outputs, seconds, requests=valid.requests)
    table, reused, deduplicated = None, 0, 0
    if item.plan is not None:
        computed = output_table(spec, valid, result) if valid.ids else None
        valid, table, reused, deduplicated = reuse.assemble(
            item.plan, valid, computed, item.work.chunk.source
        )
    marker = write_chunk(
        spec,
        where,
        item.work.chunk,
        valid,
        result,
        item.work.attempt,
        engine_seconds=result.seconds if item.result is not None else item.engine_seconds,
        table=table,
        rows_reused=reused,
        rows_deduplicated=deduplicated,
        job=item.work.job,
    )
    if item.plan is not None:
        reuse.written(item.plan, where, marker)
    return marker


def render_images(engine: PromptRenderer, item: _ChunkInFlight, stopping: threading.Event) -> None:
    """Run vLLM's input processing of a chunk's image prompts here, in the render thread
    (`InferenceEngine.render`), so the engine thread only adds them: the model's image
    processor costs milliseconds an image on a CPU, and done at submit it stalled the loop
    between engine steps. One thread, as vLLM's own offline pooling renders (its processor
    cache is not thread-safe). Each rendered prompt replaces the row's decoded images, so
    memory holds one form of each image; a prompt vLLM refuses is kept as its
    `RequestRejected`, which quarantines that row at submit."""
    condition = item.rendering
    if condition is None:
        return
    try:
        for position, images in enumerate(item.valid.images):
            if stopping.is_set():
                return
            if images:
                try:
                    rendered = engine.render(item.valid.token_ids[position], images)
                except RequestRejected as exc:
                    rendered = exc
                # Read by the engine thread once `rendered_count` passes it; the rendered
                # input is in place before the decoded images go.
                item.rendered[position] = rendered
                item.valid.images[position] = []
            done = position + 1
            if done % RENDER_BATCH == 0 or done == len(item.valid.images):
                with condition:
                    item.rendered_count = done
                    condition.notify_all()
    except BaseException as exc:
        item.render_failed = exc  # raised by the engine thread too, where it waits
        raise
    finally:
        with condition:
            item.rendering = None  # all rendered, stopped or failed: nobody waits on it
            condition.notify_all()


def _rendered(item: _ChunkInFlight, position: int) -> bool:
    """Whether `position` of `item` can be submitted without waiting for the render thread
    (rendered, no rendering needed, or the render ended)."""
    return item.rendering is None or item.rendered_count > position


def _wait_rendered(item: _ChunkInFlight, position: int) -> None:
    """Block until the render thread has rendered `position` of `item` (or ended). The loop
    waits here only when no request is in flight: otherwise `fill` stops at an unrendered
    prompt and the engine steps on."""
    condition = item.rendering
    if condition is not None:
        with condition:
            while item.rendering is not None and item.rendered_count <= position:
                condition.wait(POLL_SECONDS)
    if item.render_failed is not None:
        raise item.render_failed


class WholeChunks:
    """score / classify behind the loop's submit/step surface: one request is one whole
    chunk, run in `step` by one `LLM.score` / `LLM.classify` call
    (the task's `WorkerTask.run_chunk`): vLLM's offline scoring pairs, tokenizes and batches
    inside that call. One chunk is in flight at a time, the next prepared behind it."""

    window = 1
    max_num_seqs = 1

    def __init__(self, engine: LoopEngine, task: WorkerTask) -> None:
        self.engine = engine
        self.task = task
        self._pending: deque[tuple[str, ValidChunk]] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, valid: ValidChunk, params: Any = None, /, **_: Any) -> None:
        self._pending.append((request_id, valid))

    def step(self) -> list[tuple[str, Any]]:
        """Run the oldest chunk; returns `(request_id, PoolingResult)`."""
        request_id, valid = self._pending.popleft()
        return [(request_id, self.task.run_chunk(self.engine, valid))]


class _RequestWindow:
    """The engine thread's state: rows read ahead, rows ordered for submission, requests in
    flight; one step each of reading ahead, filling the window and stepping the engine."""

    def __init__(
        self,
        engine: SteppedEngine,
        spec: InferenceSpec,
        finished: queue.Queue[_ChunkInFlight | None],
        stopping: threading.Event,
    ) -> None:
        self.engine = engine
        self.stopping = stopping
        self.window = engine.window
        self.finished = finished
        self.metrics = current_metrics()
        self.group = spec.group_prefixes and task_facts(spec.task).groups_prefixes
        self.block_size = int(getattr(engine, "block_size", DEFAULT_BLOCK_SIZE))
        self.engine_time = EngineTimeShares(
            pooling=task_facts(spec.task).pooling, max_running=engine.max_num_seqs
        )
        self.requests: dict[str, tuple[_ChunkInFlight, int]] = {}
        # Finished chunks whose copied rows wait for an earlier chunk of the run (dedup):
        # handed to the writer once every chunk they copy from is (`_finish`).
        self.parked: list[_ChunkInFlight] = []
        self.incoming: deque[tuple[_ChunkInFlight, int]] = deque()  # read ahead, not ordered
        self.current: deque[tuple[_ChunkInFlight, int]] = deque()  # ordered, being submitted
        self.prepared_all = False
        # Rows wait, nothing is in flight, and no more came within a poll: the reader may be
        # held back (the run caps chunks handed out, and small partitions make small chunks),
        # so the first batch goes without waiting for a full window.
        self.starved = False
        # Rows of the chunks read ahead that need no request (copied by row reuse, or
        # quarantined): they count toward the window being read ahead, so chunks whose
        # rows are mostly copied do not keep the loop reading for a window of requests the
        # run's bound on outstanding chunks never lets in (the loop would wait for ever).
        self.settled_ahead = 0
        self.sequence = 0
        self.rows = 0
        self.done = False

    def read_ahead(
        self, prepared: queue.Queue[_ChunkInFlight | None], threads: tuple[_Worker, _Worker]
    ) -> None:
        """Up to a window's worth of rows waits beside the window in flight."""
        engine = self.engine
        while (
            not self.prepared_all
            and len(self.incoming) + len(self.current) + self.settled_ahead < self.window
        ):
            idle = engine.in_flight == 0 and not self.current
            try:
                item = prepared.get(timeout=POLL_SECONDS) if idle else prepared.get_nowait()
            except queue.Empty:
                if idle and self.incoming:
                    self.starved = True
                    break
                if idle and not self.stopping.is_set() and all(t.error is None for t in threads):
                    continue
                break
            self.starved = False
            if item is None:
                self.prepared_all = True
                break
            self.settled_ahead += max(0, item.work.chunk.rows_in - item.remaining)
            if item.remaining == 0:  # every row quarantined or reused: nothing to compute
                self._finish(item)
                continue
            self.incoming.extend((item, position) for position in range(item.remaining))

    def fill(self) -> None:
        """Fill the window. Rows read ahead are ordered a batch at a time, so no row waits
        behind later arrivals. A batch is all that waits once a window of rows waits, or the
        input is all read, or the engine's batch (`max_num_seqs`) is not full: the first
        batch (nothing submitted yet) waits for a full window, so prompts that share a prefix
        reach the engine together from the start, for the price of preparing one window,
        unless no more rows come within a poll (`starved`: the run hands out chunks up to a
        cap, and a run of partitions smaller than a chunk may never fill a window).
        An image prompt the render thread has not reached yet ends the fill while requests
        are in flight, so the engine steps and finished outputs drain meanwhile."""
        engine = self.engine
        while engine.in_flight < self.window:
            if not self.current:
                batch_ready = (
                    len(self.incoming) + self.settled_ahead >= self.window
                    or self.prepared_all
                    or self.starved
                    or (self.sequence > 0 and engine.in_flight < engine.max_num_seqs)
                )
                if batch_ready:
                    self.settled_ahead = 0  # counted toward this batch; reading goes on
                if not self.incoming or not batch_ready:
                    break
                batch = list(self.incoming)
                self.incoming.clear()
                if self.group and len(batch) > 1:
                    batch = prefix_order(
                        batch, lambda entry: entry[0].valid.token_ids[entry[1]], self.block_size
                    )
                self.current.extend(batch)
            if engine.in_flight and not _rendered(*self.current[0]):
                break  # step the engine (drain what finished) while the render catches up
            self._submit(*self.current.popleft())

    def _submit(self, item: _ChunkInFlight, position: int) -> None:
        request_id = str(self.sequence)
        self.sequence += 1
        if item.first_submitted is None:
            item.first_submitted = time.perf_counter()
        _wait_rendered(item, position)
        rendered = item.rendered.pop(position, None)
        images = item.valid.images[position] if item.valid.images else None
        extra = (  # image tasks only: the render stage's input, else the decoded images
            {"rendered": rendered} if rendered is not None else {"images": images} if images else {}
        )
        adapter = item.adapter(position)
        if adapter is not None:  # a LoRA adapter's row
            extra["adapter"] = adapter
        try:
            if isinstance(rendered, RequestRejected):
                raise rendered
            self.engine.submit(request_id, item.prompt(position), item.params(position), **extra)
        except RequestRejected as exc:  # that row is quarantined, the rest go on
            item.rejected[position] = str(exc)
            self._settled(item)
            return
        self.requests[request_id] = (item, position)
        self.engine_time.submitted(request_id, item)
        self.metrics.requests_started(item.rows_of(position))

    def _settled(self, item: _ChunkInFlight) -> None:
        item.remaining -= 1
        if item.remaining == 0:
            self._finish(item)

    def _finish(self, item: _ChunkInFlight) -> None:
        """Hand `item` to the writer once every chunk it copies rows from was handed over
        (the writer writes in turn, so those are written first), and any parked chunk
        that was waiting only on it."""
        self.parked.append(item)
        moved = True
        while moved:
            moved = False
            for waiting in list(self.parked):
                plan = waiting.plan
                if plan is None or all(twin.queued for twin in plan.waits_on):
                    self.parked.remove(waiting)
                    if plan is not None:
                        plan.queued = True
                    self.finished.put(waiting)
                    moved = True

    def step(self) -> None:
        """One engine step, its finished requests put in place; `done` once all are in."""
        if self.engine.in_flight == 0:
            self.done = (
                self.prepared_all and not self.incoming and not self.current and not self.parked
            )
            return
        step_started = time.perf_counter()
        finished = self.engine.step()
        self.engine_time.stepped(
            time.perf_counter() - step_started,
            [(request_id, self.requests[request_id][0]) for request_id, _ in finished],
        )
        rows = 0
        for request_id, output in finished:
            item, position = self.requests.pop(request_id)
            item.done(position, output)
            rows += item.rows_of(position)
            self._settled(item)
        if finished:
            self.metrics.requests_finished(rows)
        self.rows += rows


def prefix_order(batch: list[Any], tokens_of: Any, block_size: int) -> list[Any]:
    """`batch` sorted by prompt tokens when that puts more whole KV blocks of shared prefix
    side by side than the input order does (what vLLM's prefix cache can reuse: it hashes
    whole blocks of `block_size` tokens); otherwise `batch` in input order.

    Sorting prompts that share no whole block gains no cache hit and only permutes the rows:
    the order in which rows of unknown lengths reach the engine decides how long its tail
    is, and the sorted permutation is no better than the caller's order. So the caller's
    order is kept then, as `LLM.generate` keeps it (a user who ordered rows, say longest
    first, keeps that order)."""
    ordered = sorted(batch, key=tokens_of)
    if _shared_blocks(ordered, tokens_of, block_size) > _shared_blocks(
        batch, tokens_of, block_size
    ):
        return ordered
    return batch


def _shared_blocks(rows: list[Any], tokens_of: Any, block_size: int) -> int:
    """Whole blocks of prompt prefix each row shares with the row before it."""
    shared = 0
    previous = None
    for row in rows:
        tokens = tokens_of(row)
        if previous is not None:
            limit = min(len(previous), len(tokens)) // block_size * block_size
            start = 0
            while (
                start < limit
                and previous[start : start + block_size] == tokens[start : start + block_size]
            ):
                start += block_size
                shared += 1
        previous = tokens
    return shared


def _put_until(target: queue.Queue[Any], item: Any, stopping: threading.Event) -> bool:
    """Put `item` on the bounded queue unless `stopping` is set first; whether it went."""
    while not stopping.is_set():
        try:
            target.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False
