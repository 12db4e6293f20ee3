"""The engine loop (`worker/stream.EngineLoop`) and the run's coordinator on a fake engine.

No vLLM: the fake has the surface the loop calls on `InferenceEngine` (`submit`, `step`,
`in_flight`, `window`, `max_num_seqs`, a tokenizer). Each request takes a fixed number of
steps that depends on its row, so requests finish out of submission order; steps take a fixed
time; a step can raise. Shards, chunk files, markers and the commit are real (local storage).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagster_gpuinfer import InferenceSpec, read_partition
from dagster_gpuinfer.storage import (
    Manifest,
    PartitionOutput,
    SourceVersion,
    read_chunk_errors,
    read_chunk_markers,
    verify_manifest,
)
from dagster_gpuinfer.worker.loop.engine_loop import EngineLoop, WholeChunks
from dagster_gpuinfer.worker.rows.readers import RawChunk
from dagster_gpuinfer.worker.run import coordinator as coordinator_module
from dagster_gpuinfer.worker.run.coordinator import RunCoordinator
from dagster_gpuinfer.worker.stage_messages import ChunkCommitted, WorkChunk

CHUNK = 4
SOURCE = SourceVersion(input="test rows")
ROWS = 10  # chunks of 4, 4 and 2 rows


class _Tokenizer:
    """One token per character."""

    def __len__(self) -> int:
        return 128

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) % 128 for c in t] for t in texts]}


def _row_number(token_ids: list[int]) -> int:
    return int("".join(chr(t) for t in token_ids if chr(t).isdigit()))


class FakeEngine:
    """Request of row n takes 1 + n % 3 steps (so they finish out of order); each step takes
    `step_seconds`; step number `fail_at_step` raises (after `before_failing` is set)."""

    max_model_len = 64
    requests = None

    def __init__(
        self,
        *,
        window: int = 4,
        step_seconds: float = 0.0,
        fail_at_step: int | None = None,
        before_failing: threading.Event | None = None,
        steps_per_request: int | None = None,
    ) -> None:
        self.window = window
        self.max_num_seqs = max(1, window // 2)
        self.tokenizer = _Tokenizer()
        self.step_seconds = step_seconds
        self.fail_at_step = fail_at_step
        self.before_failing = before_failing
        self.steps_per_request = steps_per_request
        self.pending: dict[str, list] = {}  # request id -> [token ids, steps left]
        self.submitted: list[int] = []  # row numbers, in submission order
        self.finished: list[int] = []  # row numbers, in completion order
        self.steps = 0
        self.step_time = 0.0

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def submit(self, request_id, token_ids, params=None):
        assert request_id not in self.pending
        steps = self.steps_per_request or 1 + _row_number(token_ids) % 3
        self.pending[request_id] = [token_ids, steps]
        self.submitted.append(_row_number(token_ids))

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at_step:
            if self.before_failing is not None:
                assert self.before_failing.wait(10), "no chunk was committed before the failure"
            raise RuntimeError("the engine died mid-window (fake)")
        started = time.perf_counter()
        time.sleep(self.step_seconds)
        self.step_time += time.perf_counter() - started
        done = []
        for request_id, entry in list(self.pending.items()):
            entry[1] -= 1
            if entry[1] == 0:
                token_ids = self.pending.pop(request_id)[0]
                number = _row_number(token_ids)
                self.finished.append(number)
                output = SimpleNamespace(data=[float(number), float(len(token_ids))])
                done.append(
                    (request_id, SimpleNamespace(prompt_token_ids=token_ids, outputs=output))
                )
        return done


def _spec(root: Path, keys: list[str], task: str = "embed") -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": task,
            "input": {"uri": str(root / "in" / "{partition_key}.parquet")},
            "output": {"root": str(root / "out"), "asset_name": "emb"},
            "chunk_size": CHUNK,
            "partition_keys": keys,
        }
    )


def _text(partition: int, row: int) -> str:
    return f"row {partition}{row:04d}"


def _write_shards(root: Path, keys: list[str]) -> None:
    (root / "in").mkdir(parents=True, exist_ok=True)
    for p, key in enumerate(keys):
        table = pa.table(
            {
                "id": [f"{key}-{i}" for i in range(ROWS)],
                "text": [_text(p + 1, i) for i in range(ROWS)],
            }
        )
        pq.write_table(table, root / "in" / f"{key}.parquet")


def _work(key: str, chunks: int, attempt: str = "att00001") -> list[WorkChunk]:
    work = []
    for index in range(chunks):
        rows = [(i, f"{key}-{i}", _text(1, i)) for i in range(index * CHUNK, (index + 1) * CHUNK)]
        chunk = RawChunk(index, "s.parquet", rows=rows, rows_in=CHUNK)
        work.append(WorkChunk(key, attempt, chunk, SOURCE))
    return work


@pytest.fixture
def loop_threads():
    """The loop's threads (`gpuinfer-*`) alive now that the test started: other tests' are
    not this loop's."""
    before = set(threading.enumerate())
    return lambda: [
        t.name for t in threading.enumerate() if t.name.startswith("gpuinfer-") and t not in before
    ]


def _read_part(root: Path, message: ChunkCommitted) -> pa.Table:
    (part,) = (root / "out").rglob(message.marker.part.name)
    return pq.read_table(part)


def _run_all(tmp_path: Path, engine, *, chunks: int) -> tuple[int, list[ChunkCommitted]]:
    """Run the loop over `chunks` chunks of one partition `s` to the end of its work."""
    spec = _spec(tmp_path, ["s"])
    work: queue.Queue[WorkChunk | None] = queue.Queue()
    for item in _work("s", chunks=chunks):
        work.put(item)
    work.put(None)
    committed: list[ChunkCommitted] = []
    rows = EngineLoop(engine, spec, work.get, committed.append).run()
    return rows, committed


# --------------------------------------------------------------------------- the loop alone


def test_rows_finishing_out_of_order_keep_their_chunks_order_and_come_once(tmp_path, loop_threads):
    engine = FakeEngine(window=4, step_seconds=0.002)
    rows, committed = _run_all(tmp_path, engine, chunks=5)

    assert rows == 5 * CHUNK
    assert engine.finished != engine.submitted  # they did finish out of order
    assert sorted(m.marker.index for m in committed) == list(range(5))
    seen: list[str] = []
    for message in committed:
        table = _read_part(tmp_path, message)
        start = message.marker.index * CHUNK
        ids = [f"s-{i}" for i in range(start, start + CHUNK)]
        assert table.column("id").to_pylist() == ids  # input order within the chunk
        vectors = table.column("embedding").to_pylist()
        assert [int(v[0]) for v in vectors] == [
            int(_text(1, i)[4:]) for i in range(start, start + CHUNK)
        ]
        seen += ids
    assert sorted(seen) == sorted(f"s-{i}" for i in range(5 * CHUNK))  # every row, once
    assert loop_threads() == []


def test_chunk_engine_seconds_share_out_the_fakes_step_time(tmp_path):
    engine = FakeEngine(window=4, step_seconds=0.01)
    _, committed = _run_all(tmp_path, engine, chunks=3)
    shared = sum(m.marker.engine_seconds for m in committed)
    # Every step's time goes to the chunks whose rows it finished: the shares add up to the
    # time spent in `step()` (the fake's sleep, plus the call itself).
    assert engine.step_time <= shared <= engine.step_time + 0.005 * engine.steps + 0.05
    assert all(m.marker.engine_seconds > 0 for m in committed)


@pytest.mark.parametrize("how", ["stop", "engine fails"])
def test_a_stop_with_full_queues_returns_promptly_and_leaves_no_thread(tmp_path, how, loop_threads):
    """Read-ahead full, the prepared queue full, the window full, more work in `take`; and
    in the failure case, `take` empty (no more work yet). Today's loop had no stop, and after
    a failure its prepare thread stayed blocked in `take()` for ever."""
    spec = _spec(tmp_path, ["s"])
    work: queue.Queue[WorkChunk | None] = queue.Queue()
    chunks = 40 if how == "stop" else 3  # engine fails: take has nothing left to give
    for item in _work("s", chunks=chunks):
        work.put(item)
    full = threading.Event()
    engine = FakeEngine(
        window=4,
        step_seconds=0.01,
        steps_per_request=10_000,  # nothing finishes
        fail_at_step=None if how == "stop" else 30,
        before_failing=full,
    )
    committed: list[ChunkCommitted] = []
    loop = EngineLoop(engine, spec, work.get, committed.append)
    asked: list[float] = []

    def stop_when_full() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            waiting = len(loop.window.incoming) + len(loop.window.current)
            if loop.prepared.full() and engine.in_flight == 4 and waiting >= 4:
                full.set()
                if how == "stop":
                    asked.append(time.perf_counter())
                    loop.stop()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=stop_when_full)
    watcher.start()
    if how == "stop":
        loop.run()
    else:
        with pytest.raises(RuntimeError, match="died mid-window"):
            loop.run()
    returned = time.perf_counter()
    watcher.join()
    assert full.is_set(), "the queues never filled"
    if how == "stop":
        assert returned - asked[0] < 1.0
        assert work.qsize() > 0  # work was left: it was a stop, not the end
    assert loop_threads() == []  # the prepare thread is not left blocked in take()
    assert committed == [] and not list((tmp_path / "out").rglob("*.json"))


def test_whole_chunks_run_one_chunk_per_step_in_order():
    calls = []

    class Task:  # the task table's entry: a whole chunk in one call
        def run_chunk(self, engine, valid):
            calls.append((engine, "score", valid))
            return f"scored {valid}"

    engine = object()
    whole = WholeChunks(engine, Task())
    assert (whole.window, whole.in_flight) == (1, 0)
    whole.submit("0", "chunk a")
    whole.submit("1", "chunk b")
    assert whole.in_flight == 2
    assert whole.step() == [("0", "scored chunk a")]
    assert whole.step() == [("1", "scored chunk b")]
    assert whole.in_flight == 0 and calls == [
        (engine, "score", "chunk a"),
        (engine, "score", "chunk b"),
    ]


# --------------------------------------------------------------------------- with the coordinator


def _serve(spec: InferenceSpec, engine: FakeEngine, after_commit=None, on_failed=None):
    """One run as `job.run_single_engine` drives it: the coordinator reads and commits, the
    loop serves; returns (manifests with computed, coordinator.done(), error or None)."""
    manifests: list[tuple[Manifest, bool]] = []
    chunks: queue.Queue[WorkChunk | None] = queue.Queue()
    coordinator = RunCoordinator(
        spec,
        spec.partition_keys,
        on_committed=lambda manifest, computed: manifests.append((manifest, computed)),
        on_failed=on_failed or (lambda exc, key: pytest.fail(f"{key} failed: {exc}")),
        put=chunks.put,
        engines=1,
        max_outstanding=6,
        model_version=None,
    )

    def committed(message: ChunkCommitted) -> None:
        coordinator.chunk_committed(message)
        if after_commit is not None:
            after_commit.set()

    coordinator.start(0.0)
    error = None
    try:
        EngineLoop(engine, spec, chunks.get, committed).run()
    except RuntimeError as exc:
        error = exc
    finally:
        coordinator.stop()
    coordinator.check()
    return manifests, coordinator.done(), error


def test_a_run_whose_chunks_in_hand_never_fill_the_window_still_finishes(tmp_path):
    """Partitions of 10 rows, at most 6 chunks handed out (60 rows) against a window of 512:
    the first batch waited for a full window that the capped reader could never bring, and
    the run hung after its engine was built (16 partitions of 32 rows, chunk 512, on the
    real engine). It goes once no more rows come within a poll."""
    keys = [f"s{i}" for i in range(12)]
    _write_shards(tmp_path, keys)
    spec = _spec(tmp_path, keys).model_copy(update={"chunk_size": 512})
    engine = FakeEngine(window=512)
    outcome: list = []
    runner = threading.Thread(target=lambda: outcome.append(_serve(spec, engine)), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the run hung with rows waiting and nothing in flight"
    manifests, done, error = outcome[0]
    assert error is None and done
    assert sorted(m.partition_key for m, computed in manifests if computed) == sorted(keys)
    assert sorted(engine.finished) == sorted(set(engine.finished))
    assert len(engine.finished) == len(keys) * ROWS


def test_the_coordinator_commits_in_its_own_thread_after_every_marker(tmp_path, monkeypatch):
    keys = ["s0", "s1", "s2"]
    _write_shards(tmp_path, keys)
    spec = _spec(tmp_path, keys)
    seen = []
    real_commit = coordinator_module.commit_chunks

    def spy(where, spec_, markers, **kwargs):
        on_disk = read_chunk_markers(where.fs, where.path, where.spec_hash)
        seen.append((where.partition_key, threading.current_thread().name, sorted(on_disk)))
        assert where.committed() is None  # markers first, the manifest after
        return real_commit(where, spec_, markers, **kwargs)

    monkeypatch.setattr(coordinator_module, "commit_chunks", spy)
    manifests, done, error = _serve(spec, FakeEngine(window=4, step_seconds=0.001))

    assert error is None and done
    assert seen == [(key, "gpuinfer-commit", [0, 1, 2]) for key in keys]
    assert [(m.partition_key, computed) for m, computed in manifests] == [(k, True) for k in keys]
    for p, key in enumerate(keys):
        table = read_partition(spec.output, key)
        assert table.column("id").to_pylist() == [f"{key}-{i}" for i in range(ROWS)]
        numbers = [int(v[0]) for v in table.column("embedding").to_pylist()]
        assert numbers == [int(_text(p + 1, i)[4:]) for i in range(ROWS)]
        assert not read_chunk_markers(*_marker_dir(spec, key))  # removed at commit

    # A rerun reports the committed partitions and asks the engine for nothing.
    rerun_engine = FakeEngine()
    again, done, error = _serve(spec, rerun_engine)
    assert error is None and done and rerun_engine.submitted == []
    assert [(m.partition_key, computed) for m, computed in again] == [(k, False) for k in keys]


def _marker_dir(spec: InferenceSpec, key: str):
    where = PartitionOutput.of(spec, key, source=SOURCE)
    return where.fs, where.path, where.spec_hash


def test_an_engine_failing_mid_window_keeps_committed_chunks_and_the_retry_resumes(
    tmp_path, loop_threads
):
    _write_shards(tmp_path, ["s0"])
    spec = _spec(tmp_path, ["s0"])
    first_chunk = threading.Event()
    failing = FakeEngine(window=4, step_seconds=0.001, fail_at_step=6, before_failing=first_chunk)
    manifests, done, error = _serve(spec, failing, after_commit=first_chunk)

    assert error is not None and "died mid-window" in str(error)
    assert manifests == [] and not done  # the partition is not committed
    markers = read_chunk_markers(*_marker_dir(spec, "s0"))
    assert 1 <= len(markers) < 3
    parts = {p.name for p in (tmp_path / "out").rglob("part-*")}
    assert parts == {m.part.name for m in markers.values()}  # no part without its marker
    assert loop_threads() == []

    retry = FakeEngine(window=4, step_seconds=0.001)
    manifests, done, error = _serve(spec, retry)
    assert error is None and done
    resumed_rows = sum(m.rows_in for m in markers.values())
    assert len(retry.submitted) == ROWS - resumed_rows  # committed chunks are not inferred again
    ((manifest, computed),) = manifests
    assert computed and manifest.rows_in == ROWS
    table = read_partition(spec.output, "s0")
    assert table.column("id").to_pylist() == [f"s0-{i}" for i in range(ROWS)]  # each once


class _SlowFirstChunk(FakeEngine):
    """Rows of the first chunk take 50 steps, the others as FakeEngine's: later chunks
    commit first."""

    def submit(self, request_id, token_ids, params=None):
        super().submit(request_id, token_ids, params)
        if _row_number(token_ids) % 10_000 < CHUNK:
            self.pending[request_id][1] = 50


def test_a_resume_keeps_the_first_occurrence_of_an_id_whose_duplicate_committed_first(
    tmp_path, loop_threads
):
    """Chunk 0 holds id `a` first, chunk 1 its duplicate (quarantined); chunk 1 commits,
    then the engine dies before chunk 0 does. The retry must keep row 0 (`a`) as one
    uninterrupted run would: it read the committed chunks' ids as taken and quarantined
    row 0 too, so `a` was lost."""
    (tmp_path / "in").mkdir()
    ids = ["a", "b", "c", "d", "a", "e", "f", "g", "h", "i"]
    texts = [_text(1, i) for i in range(ROWS)]
    pq.write_table(pa.table({"id": ids, "text": texts}), tmp_path / "in" / "s0.parquet")
    spec = _spec(tmp_path, ["s0"])
    committed = threading.Event()
    failing = _SlowFirstChunk(window=12, fail_at_step=30, before_failing=committed)
    _, done, error = _serve(spec, failing, after_commit=committed)
    assert error is not None and not done
    assert 0 not in read_chunk_markers(*_marker_dir(spec, "s0"))  # chunk 0 never committed
    assert 1 in read_chunk_markers(*_marker_dir(spec, "s0"))

    manifests, done, error = _serve(spec, FakeEngine(window=12))
    assert error is None and done
    ((manifest, _),) = manifests
    assert (manifest.rows_in, manifest.rows_out, manifest.rows_errored) == (10, 9, 1)
    table = read_partition(spec.output, "s0")
    assert sorted(table.column("id").to_pylist()) == sorted(set(ids))
    embedded = dict(
        zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True)
    )
    assert int(embedded["a"][0]) == int(_text(1, 0)[4:])  # row 0's, not row 4's
    assert loop_threads() == []


# ------------------------------------------------------------- a shard rewritten


def _rewrite_shard(root: Path, key: str, rows: int, number: int) -> None:
    """`key`'s shard written again under the same name: `rows` rows, texts of `number`."""
    table = pa.table(
        {"id": [f"{key}-{i}" for i in range(rows)], "text": [_text(number, i) for i in range(rows)]}
    )
    pq.write_table(table, root / "in" / f"{key}.parquet")


def test_a_shard_rewritten_after_its_commit_is_computed_again_from_its_new_rows(tmp_path):
    _write_shards(tmp_path, ["s0", "s1"])
    spec = _spec(tmp_path, ["s0", "s1"])
    first, done, error = _serve(spec, FakeEngine())
    assert error is None and done and [c for _, c in first] == [True, True]

    _rewrite_shard(tmp_path, "s1", 7, number=9)  # 7 of its 10 rows kept, every text changed
    engine = FakeEngine()
    again, done, error = _serve(spec, engine)
    assert error is None and done
    assert [(m.partition_key, c) for m, c in again] == [("s0", False), ("s1", True)]
    assert sorted(engine.submitted) == [int(_text(9, i)[4:]) for i in range(7)]
    manifest = dict((m.partition_key, m) for m, _ in again)["s1"]
    assert (manifest.rows_in, manifest.rows_out, manifest.rows_resumed) == (7, 7, 0)
    assert manifest.source != dict((m.partition_key, m) for m, _ in first)["s1"].source
    table = read_partition(spec.output, "s1")
    assert [int(v[0]) for v in table.column("embedding").to_pylist()] == [
        int(_text(9, i)[4:]) for i in range(7)
    ]
    # The old version's part files went with its manifest.
    where = PartitionOutput.of(spec, "s1", source=manifest.source)
    assert verify_manifest(where.fs, where.path, manifest) == []
    assert sorted(n for n in os.listdir(where.path) if n.startswith("part-")) == sorted(
        p.name for p in manifest.parts
    )


def test_chunks_of_an_older_shard_version_are_not_resumed(tmp_path):
    _write_shards(tmp_path, ["s0"])
    spec = _spec(tmp_path, ["s0"])
    first_chunk = threading.Event()
    failing = FakeEngine(window=4, step_seconds=0.001, fail_at_step=6, before_failing=first_chunk)
    _, done, error = _serve(spec, failing, after_commit=first_chunk)
    assert error is not None and not done
    assert read_chunk_markers(*_marker_dir(spec, "s0"))  # some chunks committed, then death

    _rewrite_shard(tmp_path, "s0", ROWS, number=80)  # same ids, new (longer) texts
    retry = FakeEngine(window=4, step_seconds=0.001)
    ((manifest, computed),), done, error = _serve(spec, retry)
    assert error is None and done and computed
    assert manifest.rows_resumed == 0 and len(retry.submitted) == ROWS
    table = read_partition(spec.output, "s0")
    assert table.column("id").to_pylist() == [f"s0-{i}" for i in range(ROWS)]
    assert [int(v[0]) for v in table.column("embedding").to_pylist()] == [
        int(_text(80, i)[4:]) for i in range(ROWS)
    ]


def test_a_shard_rewritten_while_the_run_reads_it_is_not_committed(tmp_path, monkeypatch):
    _write_shards(tmp_path, ["s0"])
    spec = _spec(tmp_path, ["s0"])
    real_version = coordinator_module.input_version

    def rewritten_meanwhile(spec_, key):  # the check after the last chunk sees a new file
        _rewrite_shard(tmp_path, key, ROWS, number=50)
        return real_version(spec_, key)

    monkeypatch.setattr(coordinator_module, "input_version", rewritten_meanwhile)
    failed = []
    manifests, done, error = _serve(
        spec, FakeEngine(), on_failed=lambda exc, key: failed.append((key, str(exc)))
    )
    assert error is None and done and manifests == []
    ((key, message),) = failed
    assert key == "s0" and "changed while this run read it" in message
    assert read_chunk_markers(*_marker_dir(spec, "s0"))  # its chunks: never a manifest

    monkeypatch.setattr(coordinator_module, "input_version", real_version)
    ((manifest, computed),), done, error = _serve(spec, FakeEngine())
    assert computed and manifest.rows_resumed == 0
    embedded = read_partition(spec.output, "s0").column("embedding").to_pylist()
    assert [int(v[0]) for v in embedded] == [int(_text(50, i)[4:]) for i in range(ROWS)]


# ------------------------------------------------------------- image prompts rendered ahead


class RenderingEngine(FakeEngine):
    """A fake whose `render` stands for vLLM's input processing (the image processor): an
    image's width names its row (width 10 + row number); a 3-pixel-wide image is refused."""

    renders = True

    def __init__(self, *, explode: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.explode = explode
        self.render_threads: set[str] = set()
        self.fit_threads: set[str] = set()
        self.rendered_heights: set[int] = set()
        self.submitted_images: list = []

    def image_fit(self, image):
        """The model's resize (`InferenceEngine.image_fit`): to 4 pixels high, width kept."""
        self.fit_threads.add(threading.current_thread().name.rsplit("_", 1)[0])
        return image.resize((image.size[0], 4))

    def render(self, token_ids, images):
        from dagster_gpuinfer.worker.stage_messages import RequestRejected

        self.render_threads.add(threading.current_thread().name)
        (image,) = images
        self.rendered_heights.add(image.size[1])
        if self.explode:
            raise RuntimeError("the image processor crashed (fake)")
        if image.size[0] == 3:
            raise RequestRejected("the engine refused the request (ValueError: too narrow)")
        return {"type": "fake", "row": image.size[0] - 10}

    def submit(self, request_id, token_ids, params=None, images=None, rendered=None):
        self.submitted_images.append(images)
        assert rendered is not None and rendered["type"] == "fake"
        super().submit(request_id, [ord(c) for c in str(rendered["row"])], params)


def _png(width: int) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, 8), "red").save(buffer, format="PNG")
    return buffer.getvalue()


def _image_run(tmp_path: Path, engine, refused: int, on_commit=None):
    """Three chunks of image rows (row `refused`'s image 3 pixels wide) through the loop;
    `on_commit` is called with each chunk committed, as it is."""
    spec = _spec(tmp_path, ["s"], task="image_embed")
    work: queue.Queue[WorkChunk | None] = queue.Queue()
    for index in range(3):
        rows = [
            (i, f"s-{i}", (_png(3 if i == refused else 10 + i), None))
            for i in range(index * CHUNK, (index + 1) * CHUNK)
        ]
        chunk = RawChunk(index, "s.parquet", rows=rows, rows_in=CHUNK)
        work.put(WorkChunk("s", "att00001", chunk, SOURCE))
    work.put(None)
    committed: list[ChunkCommitted] = []

    def commit(message: ChunkCommitted) -> None:
        committed.append(message)
        if on_commit is not None:
            on_commit(message)

    rows = EngineLoop(engine, spec, work.get, commit).run()
    return rows, committed


def test_image_prompts_are_rendered_in_their_own_stage_and_a_refused_one_is_its_rows_error(
    tmp_path, loop_threads
):
    refused = 5
    engine = RenderingEngine(window=4)

    rows, committed = _image_run(tmp_path, engine, refused)

    assert rows == 3 * CHUNK - 1
    assert engine.render_threads == {"gpuinfer-render"}  # never on the engine's thread
    # The model's resize ran in the decoder's pool, and rendering saw only resized images.
    assert engine.fit_threads == {"gpuinfer-image"}
    assert engine.rendered_heights == {4}
    assert engine.submitted_images == [None] * rows  # the decoded images were not kept
    embedded = {}
    for message in committed:
        table = _read_part(tmp_path, message)
        for row_id, vector in zip(
            table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True
        ):
            embedded[row_id] = int(vector[0])
    # Each row's rendered prompt reached the engine as that row's request.
    assert embedded == {f"s-{i}": i for i in range(3 * CHUNK) if i != refused}
    where = PartitionOutput.of(_spec(tmp_path, ["s"], task="image_embed"), "s", source=SOURCE)
    errors = [
        e
        for m in committed
        if m.marker.errors
        for e in read_chunk_errors(where, m.marker).to_pylist()
    ]
    assert [(e["id"], e["error_type"]) for e in errors] == [(f"s-{refused}", "rejected_by_engine")]
    assert "too narrow" in errors[0]["message"]
    # The render stage and the image decoder's pool ended with the loop.
    assert loop_threads() == []


def test_a_render_thread_that_dies_fails_the_loop_and_leaves_no_stage_running(
    tmp_path, loop_threads
):
    with pytest.raises(RuntimeError, match="image processor crashed"):
        _image_run(tmp_path, RenderingEngine(window=4, explode=True), refused=-1)
    assert loop_threads() == []


class SlowRenderingEngine(RenderingEngine):
    """A `RenderingEngine` whose render of the second chunk's first image waits for
    `release`; its first step waits until that render has begun, so the second chunk is read
    ahead while requests of the first are still in flight."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.render_held = threading.Event()
        self.release = threading.Event()

    def render(self, token_ids, images):
        if images[0].size[0] - 10 == CHUNK:  # the second chunk's first row
            self.render_held.set()
            assert self.release.wait(10), "the test never released the render"
        return super().render(token_ids, images)

    def step(self):
        if self.steps == 0:
            assert self.render_held.wait(10), "the second chunk's render never began"
        return super().step()


def test_a_chunk_rendering_does_not_stop_the_engine_stepping_and_draining(tmp_path, loop_threads):
    engine = SlowRenderingEngine(window=CHUNK)
    first_committed = threading.Event()
    committed_while_rendering: list[int] = []

    def on_commit(message: ChunkCommitted) -> None:
        if not engine.release.is_set():
            committed_while_rendering.append(message.marker.index)
        if message.marker.index == 0:
            first_committed.set()

    def release_after_first_commit() -> None:
        first_committed.wait(3)  # never set when rendering blocks the engine thread
        engine.release.set()

    releaser = threading.Thread(target=release_after_first_commit)
    releaser.start()
    try:
        rows, committed = _image_run(tmp_path, engine, refused=-1, on_commit=on_commit)
    finally:
        engine.release.set()
        releaser.join()

    # The first chunk's rows kept stepping to completion and were written while the second
    # chunk's images were still being rendered.
    assert committed_while_rendering == [0]
    assert rows == 3 * CHUNK and sorted(m.marker.index for m in committed) == [0, 1, 2]
    assert loop_threads() == []
