"""A partition's own figures: rates over its active span, inference within wall time, commit
seconds from the chunk markers (whichever process wrote them), saturation for pooling.

The coordinator runs for real here (real shards, real storage, the real commit); only the
engine is a fake that hands back chunk markers with measured times, as a replica would.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.messages import RunFinished
from dagster_gpuinfer.metadata import partition_metadata
from dagster_gpuinfer.run_metrics import NOT_AVAILABLE
from dagster_gpuinfer.storage import ChunkMarker, Manifest, RowCounts
from dagster_gpuinfer.worker.commit import chunk_span
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.loop.engine_time import EngineTimeShares
from dagster_gpuinfer.worker.rows.readers import ShardReader
from dagster_gpuinfer.worker.run.coordinator import RunCoordinator
from dagster_gpuinfer.worker.run.job import _ReplicaRun
from dagster_gpuinfer.worker.stage_messages import (
    ChunkCommitted,
    ReplicaChunk,
    ReplicaCrashed,
    ReplicaLoaded,
    ReplicaUserError,
    WorkChunk,
)
from dagster_gpuinfer.worker.telemetry import EngineGauges, Sample, summarise_engine

ROWS = 40
CHUNK = 20
CHUNK_SECONDS = 0.08


def _marker(index: int, start: float | None, end: float | None, **counts: int) -> ChunkMarker:
    return ChunkMarker(index=index, spec_hash="h", started_at=start, finished_at=end, **counts)


# --------------------------------------------------------------------------- pure parts


def test_row_counts_are_summed_in_one_place_for_markers_and_manifests():
    markers = [
        _marker(0, None, None, rows_in=3, rows_out=2, rows_errored=1, prompt_tokens=7),
        _marker(1, None, None, rows_in=4, rows_out=4, generated_tokens=5, rows_invalid_output=1),
    ]
    total = RowCounts.total(markers)
    assert total == RowCounts(
        rows_in=7,
        rows_out=6,
        rows_errored=1,
        rows_invalid_output=1,
        prompt_tokens=7,
        generated_tokens=5,
    )
    assert total.tokens == 12
    assert RowCounts.total([]) == RowCounts()
    # Manifest and ChunkMarker are RowCounts: the counters are declared once.
    assert set(RowCounts.model_fields) <= set(Manifest.model_fields)
    assert set(RowCounts.model_fields) <= set(ChunkMarker.model_fields)


def test_overlapping_chunks_count_once_and_within_the_window():
    markers = [
        _marker(0, 10.0, 14.0),
        _marker(1, 12.0, 15.0),  # overlaps chunk 0: streamed together
        _marker(2, 17.0, 18.0),  # after a gap
        _marker(3, None, None),  # written by an older worker: no times
    ]
    union, span = chunk_span(markers, since=0.0, until=100.0)
    assert union == pytest.approx(6.0)  # [10, 15] + [17, 18], not 4 + 3 + 1 = 8
    assert span == pytest.approx(8.0)  # 10 -> 18
    # A chunk resumed from an earlier attempt lies before the window: it counts for nothing.
    union, span = chunk_span([_marker(0, 1.0, 2.0), _marker(1, 10.0, 12.0)], 5.0, 20.0)
    assert (union, span) == (pytest.approx(2.0), pytest.approx(2.0))
    assert chunk_span([], 0.0, 1.0) == (0.0, 0.0)


def _manifest(**fields) -> Manifest:
    base = dict(
        partition_key="p",
        spec_hash="h",
        model="m",
        task="embed",
        output_format="parquet",
        parts=[],
        errors={"name": "errors.parquet", "rows": 0, "bytes": 0, "sha256": ""},
    )
    return Manifest(**{**base, **fields})


def _spec(root: Path, task: str = "embed") -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": task,
            "input": {"uri": str(root / "in" / "{partition_key}.parquet")},
            "output": {"root": str(root / "out"), "asset_name": "emb"},
            "chunk_size": CHUNK,
        }
    )


def test_rates_use_the_rows_computed_over_their_share_of_engine_time(tmp_path):
    manifest = _manifest(
        rows_in=100,
        rows_resumed=60,
        prompt_tokens=1000,
        computed=RowCounts(rows_in=40, prompt_tokens=300, generated_tokens=100),
        engine_seconds=2.0,
        # Submitted early, its rows waited behind another partition's in the engine's queue.
        active_seconds=6.0,
        inference_seconds=5.5,
        wall_seconds=30.0,  # reading began long before: the run read ahead
    )
    md = partition_metadata(_spec(tmp_path), manifest, computed=True)
    assert md["rows_per_second"] == 20.0  # 40 rows / 2 s, not 100 rows / 30 s nor 40 / 6
    assert md["tokens_per_second"] == 200.0
    assert "rates_over" not in md  # said once, in the asset's description
    names = list(md)
    assert names[: names.index("rows_per_second")] == [
        "rows_in",
        "rows_out",
        "rows_errored",
        "rows_resumed",
        "rows_reused",
        "rows_computed",
        "rows_deduplicated",
        "rows_invalid_output",
        "prompt_tokens",
        "generated_tokens",
    ]
    resumed = partition_metadata(_spec(tmp_path), _manifest(rows_in=100), computed=False)
    assert resumed["rows_per_second"] == resumed["tokens_per_second"] == NOT_AVAILABLE


def test_partition_metadata_shows_sampling_params_only_for_tasks_that_sample(tmp_path):
    embed = partition_metadata(_spec(tmp_path), _manifest(rows_in=1), computed=True)
    assert "sampling_params" not in embed
    generate = partition_metadata(
        _spec(tmp_path, task="generate"), _manifest(task="generate", rows_in=1), computed=True
    )
    shown = generate["sampling_params"].data
    assert shown["max_tokens"] == 64 and shown["temperature"] == 0.0
    # Unset parameters are left out rather than listed as null or empty.
    assert not {"seed", "top_k", "logprobs", "structured_outputs", "stop", "extra"} & set(shown)


def test_the_output_asset_says_once_what_its_partition_figures_mean(tmp_path):
    import dagster as dg

    from dagster_gpuinfer import inference_assets

    pipeline = inference_assets(
        name="emb",
        model="/m",
        task="embed",
        input={"uri": str(tmp_path / "{partition_key}.parquet")},
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["a"]),
        description="Review embeddings.",
    )
    description = pipeline.output_asset.descriptions_by_key[pipeline.output_asset.key]
    assert description.startswith("Review embeddings.\n\n")
    assert "share of its engine's time" in description
    assert "`input_version`, `model_files_version`" in description


def test_pooling_saturation_counts_the_requests_queued_for_the_next_step():
    # Between steps a pooling engine shows 0 running and its queue waiting (seen: embed
    # runs read saturation 0 with 171 waiting); generation keeps running / max_num_seqs.
    samples = [
        Sample(at=float(i), gpus=(), engine=EngineGauges(running=0, waiting=w, kv_cache_usage=0))
        for i, w in enumerate((171, 64, 16))
    ]
    pooling = summarise_engine(samples, 64, pooling=True)
    assert pooling["engine_saturation_mean"] == pytest.approx((1 + 1 + 0.25) / 3, abs=1e-4)
    assert pooling["kv_cache_usage_p95"] == NOT_AVAILABLE
    generation = summarise_engine(samples, 64, pooling=False)
    assert generation["engine_saturation_mean"] == 0.0
    assert generation["kv_cache_usage_p95"] == 0.0


def test_the_run_summary_names_the_load_time_once():
    fields = RunFinished.model_fields
    assert "load_seconds" in fields and "model_load_seconds" not in fields
    legacy = RunFinished.model_validate({"type": "run", "model_load_seconds": 4.0}).summary()
    assert legacy["load_seconds"] is None and legacy["model_load_seconds"] == 4.0


# --------------------------------------------------------------------------- replica messages


def test_replica_messages_are_typed_and_drive_the_coordinator(tmp_path):
    _write_shards(tmp_path, ["s0"])
    spec = _spec(tmp_path).model_copy(update={"partition_keys": ["s0"]})
    committed: list[Manifest] = []
    work: queue.Queue[WorkChunk | None] = queue.Queue()
    run = _ReplicaRun(
        spec, ["s0"], 2, lambda m, c: committed.append(m), lambda e, k: None, work.put, None
    )
    with pytest.raises(RuntimeError, match="before every engine was loaded"):
        run.handle(ReplicaChunk(0, ChunkCommitted("s0", _marker(0, 1.0, 2.0), 0)))
    run.handle(ReplicaLoaded(0, 3.0, 8))
    assert run.coordinator is None  # reading waits for every engine
    run.handle(ReplicaLoaded(1, 5.0, 8))
    assert run.coordinator is not None and run.coordinator.model_load_seconds == 5.0
    for chunk in _drain(work, engines=2):
        now = time.time()
        marker = _chunk_marker(chunk, now - 0.01, now, write_seconds=0.5)
        run.handle(ReplicaChunk(1, ChunkCommitted("s0", marker, 1)))
    assert run.coordinator.done() and len(committed) == 1
    with pytest.raises(ShardError, match="bad line"):
        run.handle(ReplicaUserError(1, "ShardError", "bad line", "s0"))
    with pytest.raises(RuntimeError, match="replica 1 failed:\nTraceback"):
        run.handle(ReplicaCrashed(1, "Traceback ..."))


# --------------------------------------------------------------------------- the coordinator


def _write_shards(root: Path, keys: list[str]) -> None:
    (root / "in").mkdir(parents=True, exist_ok=True)
    for key in keys:
        ids = [f"{key}-{i}" for i in range(ROWS)]
        table = pa.table({"id": ids, "text": [f"text {i}" for i in ids]})
        pq.write_table(table, root / "in" / f"{key}.parquet")


def _drain(work: queue.Queue[WorkChunk | None], engines: int) -> list[WorkChunk]:
    chunks, ends = [], 0
    while ends < engines:
        item = work.get(timeout=30)
        if item is None:
            ends += 1
        else:
            chunks.append(item)
    return chunks


def _chunk_marker(
    work: WorkChunk, start: float, end: float, *, write_seconds: float = 0.0
) -> ChunkMarker:
    rows = work.chunk.rows_in
    return ChunkMarker(
        index=work.chunk.index,
        spec_hash=_SPEC_HASH[0],
        rows_in=rows,
        rows_out=rows,
        prompt_tokens=3 * rows,
        inference_seconds=end - start,
        engine_seconds=end - start,
        started_at=start,
        finished_at=end,
        write_seconds=write_seconds,
    )


_SPEC_HASH: list[str] = []


@pytest.fixture(autouse=True)
def _spec_hash(tmp_path):
    _SPEC_HASH[:] = [_spec(tmp_path).spec_hash()]


def _fake_engine(
    work: queue.Queue[WorkChunk | None], coordinator: RunCoordinator, replica: int
) -> None:
    """Serve chunks one at a time, each taking CHUNK_SECONDS, reporting what a replica
    would: a marker with its own times and its write time (this process never wrote it)."""
    while (item := work.get(timeout=30)) is not None:
        start = time.time()
        time.sleep(CHUNK_SECONDS)
        marker = _chunk_marker(item, start, time.time(), write_seconds=0.125)
        coordinator.chunk_committed(ChunkCommitted(item.partition_key, marker, replica))


def _run_coordinator(tmp_path: Path, keys: list[str]) -> tuple[list[Manifest], list[str]]:
    spec = _spec(tmp_path).model_copy(update={"partition_keys": keys})
    manifests: list[Manifest] = []
    failed: list[str] = []
    work: queue.Queue[WorkChunk | None] = queue.Queue()
    coordinator = RunCoordinator(
        spec,
        keys,
        on_committed=lambda manifest, computed: manifests.append(manifest),
        on_failed=lambda exc, key: failed.append(key),
        put=work.put,
        engines=1,
        max_outstanding=64,  # reads every shard ahead: the case that made rates degrade
        model_version=None,
    )
    coordinator.start(model_load_seconds=1.0)
    engine = threading.Thread(target=_fake_engine, args=(work, coordinator, 1))
    engine.start()
    engine.join(timeout=60)
    coordinator.check()
    assert coordinator.done()
    return manifests, failed


def test_equal_partitions_get_equal_rates_and_inference_within_wall(tmp_path):
    keys = [f"s{i}" for i in range(4)]
    _write_shards(tmp_path, keys)
    manifests, failed = _run_coordinator(tmp_path, keys)
    assert not failed and [m.partition_key for m in manifests] == keys
    rates = []
    for manifest in manifests:
        assert manifest.rows_in == manifest.computed.rows_in == ROWS
        assert 0 < manifest.inference_seconds <= manifest.active_seconds <= manifest.wall_seconds
        md = partition_metadata(_spec(tmp_path), manifest, computed=True)
        rates.append(md["rows_per_second"])
        # Written "in a replica": the commit time comes from the markers, not this process.
        assert manifest.telemetry["commit_seconds"] == pytest.approx(0.25)
    # Each partition is two chunks of CHUNK_SECONDS: about ROWS / (2 * CHUNK_SECONDS) rows/s
    # for every one of them. Dividing by reading start to commit gave 1, 1/2, 1/3, 1/4 of it.
    assert max(rates) / min(rates) < 1.5, rates
    walls = [m.wall_seconds for m in manifests]
    assert walls[-1] > 2.5 * walls[0]  # wall time still says when the commit came


def test_a_failed_partition_is_logged_once_by_whoever_handles_it(tmp_path, caplog, monkeypatch):
    _write_shards(tmp_path, ["bad", "good"])

    class BreaksOnBad(ShardReader):
        def chunks(self, chunk_size):
            if self.partition_key == "bad":
                raise ShardError("shard bad line 3: not valid JSON")
            yield from super().chunks(chunk_size)

    monkeypatch.setattr("dagster_gpuinfer.worker.run.coordinator.ShardReader", BreaksOnBad)
    with caplog.at_level(logging.ERROR, logger="dagster_gpuinfer.worker"):
        manifests, failed = _run_coordinator(tmp_path, ["bad", "good"])
    assert failed == ["bad"] and [m.partition_key for m in manifests] == ["good"]
    # The coordinator hands the failure to `on_failed` (the job logs and reports it there).
    assert [r for r in caplog.records if "bad" in r.getMessage()] == []


# --------------------------------------------------------------------------- engine time


class _Chunk:
    def __init__(self) -> None:
        self.engine_seconds = 0.0


def test_generation_steps_are_shared_by_the_requests_running_not_those_waiting():
    shares = EngineTimeShares(pooling=False, max_running=2)
    a, b, c = _Chunk(), _Chunk(), _Chunk()
    for request_id, chunk in (("1", a), ("2", b), ("3", c), ("4", c)):
        shares.submitted(request_id, chunk)  # 1 and 2 run; c's two wait in the queue
    shares.stepped(0.4, [])
    shares.stepped(0.4, [("1", a)])  # a's row ran in this step too; then 3 starts
    shares.stepped(0.2, [("2", b), ("3", c)])  # 4 starts
    shares.stepped(0.2, [("4", c)])
    assert a.engine_seconds == pytest.approx(0.4)
    assert b.engine_seconds == pytest.approx(0.2 + 0.2 + 0.1)
    assert c.engine_seconds == pytest.approx(0.1 + 0.2)
    total = a.engine_seconds + b.engine_seconds + c.engine_seconds
    assert total == pytest.approx(1.2)  # all the engine's step time, shared once


def test_pooling_steps_go_to_the_rows_they_finish_not_to_rows_waiting():
    # Two equal partitions' chunks submitted together into one window: the second's rows
    # wait in the engine's queue while the first's run; each gets its own steps' time.
    shares = EngineTimeShares(pooling=True, max_running=8)
    first, second = _Chunk(), _Chunk()
    for index, chunk in enumerate([first] * 4 + [second] * 4):
        shares.submitted(str(index), chunk)
    shares.stepped(0.5, [(str(i), first) for i in range(4)])
    shares.stepped(0.25, [])  # a step that finished nothing: its time goes to the next rows
    shares.stepped(0.25, [(str(i), second) for i in range(4, 8)])
    assert first.engine_seconds == pytest.approx(0.5)
    assert second.engine_seconds == pytest.approx(0.5)


def test_the_worker_start_figure_is_within_what_the_parent_saw():
    """`run_start_seconds` (process start to job start) must fit inside the time the
    launching process measured around it: a figure read off the wall clock against a boot
    time rounded to the second ran long by that second's fraction."""
    probe = (
        "import time; time.sleep(0.3);"
        "from dagster_gpuinfer.worker.run.job import process_age_seconds;"
        "print(process_age_seconds())"
    )
    for _ in range(3):
        before = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout
        elapsed = time.perf_counter() - before
        age = float(out.strip())
        assert 0.3 <= age <= elapsed, (age, elapsed)
