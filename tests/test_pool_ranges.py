"""Chunk-range leases (dagster_gpuinfer/pools/ranges.py): a big partition split into ranges
of its chunks that several pool workers share, committed once by the range that finishes
last.

Pool workers on the fake engine of `pool_worker_fakes` (no vLLM) against a real lease
queue (SQLite) and real storage (shards, chunk files, markers, the exclusive manifest): two
workers one after the other, two finishing at once, and a worker killed mid-range.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pool_worker_fakes import POOL, FakePoolEngine, spec_dict, text
from test_pool_worker import start_fake_worker, wait_for_markers

from dagster_gpuinfer import InferenceSpec, read_partition
from dagster_gpuinfer.launchers.pool import job_items, partition_messages, pool_job
from dagster_gpuinfer.pools import JobSubmission, SqliteLeaseQueue, WorkItem
from dagster_gpuinfer.pools.ranges import ChunkRange, range_rows, split_chunks
from dagster_gpuinfer.storage import (
    filesystem_for,
    input_version,
    list_names,
    partition_dir,
    read_chunk_markers,
    read_manifest,
    verify_manifest,
)
from dagster_gpuinfer.worker.pool.loop import PoolWorkerLoop
from dagster_gpuinfer.worker.run.coordinator import RunCoordinator

KEY = "big"


def write_shard(root: Path, key: str, rows: int, *, duplicate: tuple[int, int] | None = None):
    """Rows `{key}-{i}`; with `duplicate=(first, again)` row `again` repeats row `first`'s
    id (the later one is quarantined, whichever range holds it)."""
    ids = [f"{key}-{i}" for i in range(rows)]
    if duplicate is not None:
        ids[duplicate[1]] = ids[duplicate[0]]
    (root / "in").mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": ids, "text": [text(1, i) for i in range(rows)]})
    pq.write_table(table, root / "in" / f"{key}.parquet")


def range_job(job_id: str, spec: dict, spans: list[tuple[int, int]] | None = None):
    """The job the step submits (`job_items`, 2 workers), or one of the given chunk ranges."""
    parsed = InferenceSpec.model_validate(spec)
    if spans is None:
        items = job_items(parsed, max_workers=2)
    else:
        version = input_version(parsed, KEY)
        total = spans[-1][1]
        items = [
            WorkItem(f"{KEY}#{a}", ChunkRange(a, b, total, version).payload(KEY)) for a, b in spans
        ]
    return JobSubmission(job_id, POOL, items, payload={"spec": spec, "run_id": job_id})


class Builds:
    def __init__(self, **engine_kwargs) -> None:
        self.engines: list[FakePoolEngine] = []
        self.engine_kwargs = engine_kwargs

    def __call__(self, spec: InferenceSpec, on_death) -> FakePoolEngine:
        self.engines.append(FakePoolEngine(spec, **self.engine_kwargs))
        return self.engines[-1]


def worker(queue, worker_id: str, builds: Builds, **kwargs) -> PoolWorkerLoop:
    settings = {"idle_ttl_s": 0.3, "lease_ttl_s": 30.0, "poll_s": 0.02} | kwargs
    return PoolWorkerLoop(queue, POOL, worker_id=worker_id, engine_builder=builds, **settings)


def results(queue, job_id: str) -> dict[str, dict]:
    return {e.item_key: e.payload for e in queue.job_events(job_id) if e.kind == "result"}


def where(spec: dict) -> tuple:
    parsed = InferenceSpec.model_validate(spec)
    return filesystem_for(partition_dir(parsed.output, KEY), parsed.storage)


def served_rows(engines: list[FakePoolEngine]) -> list[int]:
    return sorted(number % 10_000 for engine in engines for number in engine.submitted)


# --------------------------------------------------------------------------- the split


def test_the_step_splits_only_a_big_countable_partition_and_only_for_two_workers(tmp_path):
    assert split_chunks(10, 4, 16) == [(0, 3)]  # not bigger than a range: whole
    assert split_chunks(64, 4, 16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert split_chunks(30, 4, 8) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # last chunk short
    assert range_rows(2816, 2, 512) == 512  # never below a chunk
    assert range_rows(64_000, 2, 512) == 8192

    write_shard(tmp_path, KEY, 64)
    write_shard(tmp_path, "small", 8)
    spec = InferenceSpec.model_validate(spec_dict(tmp_path, [KEY, "small", "gone"]))
    items = pool_job(spec, run_id="r", retry_number=0, max_workers=2).items
    # 72 rows over 2 workers x 4 leases: ranges of 3 chunks (12 rows); the missing shard
    # stays one item, for the worker to report.
    assert [i.key for i in items][:2] == [f"{KEY}#chunks=0-2", f"{KEY}#chunks=3-4"]
    assert [i.key for i in items][-2:] == ["small", "gone"]
    ranges = [ChunkRange.of_item(i.payload, "j") for i in items[:-2]]
    assert [(r.start, r.end) for r in ranges] == [
        (0, 3),
        (3, 5),
        (5, 8),
        (8, 11),
        (11, 13),
        (13, 16),
    ]
    assert {r.total for r in ranges} == {16} and ranges[0].input_version
    one = pool_job(spec, run_id="r", retry_number=0, max_workers=1).items
    assert [i.key for i in one] == [KEY, "small", "gone"]
    with pytest.raises(ValueError, match="total_chunks"):
        ChunkRange.of_item({"partition_key": KEY, "chunks": [0, 2]}, "j")


# --------------------------------------------------------------------------- exactly once


def test_a_partition_split_across_two_workers_commits_every_row_once_as_one_worker_would(
    tmp_path,
):
    rows = 64
    write_shard(tmp_path, KEY, rows, duplicate=(3, 50))  # a repeated id in another range
    split = spec_dict(tmp_path, [KEY], asset="split")
    whole = spec_dict(tmp_path, [KEY], asset="whole")
    with SqliteLeaseQueue(tmp_path / "pools.db") as queue:
        job = range_job("run-split", split)
        assert len(job.items) == 8  # 2 chunks each
        queue.submit(job)
        item = WorkItem(KEY, {"partition_key": KEY})  # the same shard as one whole lease
        queue.submit(JobSubmission("run-whole", POOL, [item], payload={"spec": whole}, priority=-1))
        first, second = Builds(), Builds()
        # w1 serves the first range only; w2 then serves the others and commits.
        lease = queue.lease(POOL, worker_id="w1", ttl_s=30)
        assert worker(queue, "w1", first).serve(lease) is None
        assert worker(queue, "w2", second).run() == 0
        split_results = results(queue, "run-split")
        items = queue.job_items("run-split")

    assert {i.worker_id for i in items} == {"w1", "w2"} and {i.state for i in items} == {"done"}
    assert served_rows(first.engines) == list(range(8))  # w1: range 0
    messages = partition_messages(list(split_results.values()))
    (committed,) = [m for m in messages if m["type"] == "partition"]
    assert committed["computed"] is True
    manifest = committed["manifest"]
    assert manifest["worker"]["job"] == "run-split"
    assert manifest["worker"]["range"] == [14, 15]  # w2's last range found all chunks in

    fs, path = where(split)
    assert verify_manifest(fs, path, read_manifest(fs, path)) == []
    one = read_manifest(*where(whole))
    for field in ("rows_in", "rows_out", "rows_errored", "error_types"):
        assert manifest[field] == getattr(one, field), field
    assert (manifest["rows_in"], manifest["rows_errored"]) == (rows, 1)
    assert manifest["rows_resumed"] == 0 and manifest["computed"]["rows_in"] == rows
    assert manifest["engine_seconds"] > 0 and manifest["wall_seconds"] > 0
    got = read_partition(InferenceSpec.model_validate(split).output, KEY)
    want = read_partition(InferenceSpec.model_validate(whole).output, KEY)
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    assert got.column("embedding").to_pylist() == want.column("embedding").to_pylist()
    assert len(got) == rows - 1 and f"{KEY}-50" not in got.column("id").to_pylist()
    assert sorted(list_names(fs, path)) == sorted(
        ["_SUCCESS", manifest["errors"]["name"], *(p["name"] for p in manifest["parts"])]
    )


def test_two_ranges_finishing_at_once_commit_the_partition_once(tmp_path, monkeypatch):
    """Both workers see every chunk committed and race on the manifest: one commits, the
    other yields; the rows are there once and nothing of the loser is left."""
    rows = 32
    write_shard(tmp_path, KEY, rows)
    spec = spec_dict(tmp_path, [KEY])
    both_in = threading.Barrier(2, timeout=30)
    original = RunCoordinator._commit_if_complete

    def at_once(self, run, span):
        both_in.wait()  # each range's chunks are in: both now find all of them
        return original(self, run, span)

    monkeypatch.setattr(RunCoordinator, "_commit_if_complete", at_once)
    with SqliteLeaseQueue(tmp_path / "pools.db") as queue:
        queue.submit(range_job("run-1", spec, spans=[(0, 4), (4, 8)]))
        leases = [queue.lease(POOL, worker_id=w, ttl_s=30) for w in ("w1", "w2")]
        loops = [worker(queue, w, Builds()) for w in ("w1", "w2")]
        threads = [
            threading.Thread(target=loop.serve, args=(lease,))
            for loop, lease in zip(loops, leases, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        served = results(queue, "run-1")
        assert queue.job_progress("run-1").state == "done"

    commits = [m for r in served.values() for m in r["messages"] if m["type"] == "partition"]
    assert sorted(m["computed"] for m in commits) == [False, True]  # one commit, one yield
    (reported,) = [m for m in partition_messages(list(served.values())) if "manifest" in m]
    assert reported["computed"] is True
    fs, path = where(spec)
    manifest = read_manifest(fs, path)
    assert manifest.committed_at == reported["manifest"]["committed_at"]
    assert verify_manifest(fs, path, manifest) == []
    assert (manifest.rows_in, manifest.rows_out, manifest.computed.rows_in) == (rows, rows, rows)
    assert sorted(list_names(fs, path)) == sorted(
        ["_SUCCESS", manifest.errors.name, *(p.name for p in manifest.parts)]
    )
    ids = read_partition(InferenceSpec.model_validate(spec).output, KEY).column("id")
    assert ids.to_pylist() == [f"{KEY}-{i}" for i in range(rows)]


def test_a_killed_workers_range_expires_and_another_worker_computes_only_its_missing_chunks(
    tmp_path,
):
    rows, chunk = 200, 4
    write_shard(tmp_path, KEY, rows)
    spec = spec_dict(tmp_path, [KEY])
    location = tmp_path / "pools.db"
    with SqliteLeaseQueue(location) as queue:
        queue.submit(range_job("run-1", spec, spans=[(0, 25), (25, 50)]))
    first = start_fake_worker(location, "first", step_seconds=0.02, lease_ttl=1.0)
    wait_for_markers(spec, KEY, 3, first)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    fs, path = where(spec)
    parsed = InferenceSpec.model_validate(spec)
    kept = set(read_chunk_markers(fs, path, parsed.spec_hash()))
    assert 3 <= len(kept) < 25 and kept < set(range(25))  # mid-way through range 0

    builds = Builds()
    with SqliteLeaseQueue(location) as queue:
        # Idle longer than the killed lease's TTL: range 1 first, then range 0 once lapsed.
        assert worker(queue, "second", builds, idle_ttl_s=5.0, lease_ttl_s=1.0).run() == 0
        items = {i.key: i for i in queue.job_items("run-1")}

    missing = [r for c in range(50) if c not in kept for r in range(c * chunk, (c + 1) * chunk)]
    assert served_rows(builds.engines) == missing  # each missing row once, nothing kept again
    assert (items[f"{KEY}#0"].leases, items[f"{KEY}#0"].failures) == (2, 1)
    assert {i.state for i in items.values()} == {"done"}
    manifest = read_manifest(fs, path)
    assert verify_manifest(fs, path, manifest) == []
    # Both workers wrote chunks for this job: all computed, none resumed.
    assert (manifest.rows_in, manifest.rows_resumed, manifest.computed.rows_in) == (rows, 0, rows)
    ids = read_partition(parsed.output, KEY).column("id").to_pylist()
    assert ids == [f"{KEY}-{i}" for i in range(rows)]
