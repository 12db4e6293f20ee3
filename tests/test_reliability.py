"""Faults on purpose: crashes in the commit window, SIGKILL mid-shard, racing runs.

Nothing is lost and nothing is written twice: every input id ends up exactly once in the
output or the errors file, and a committed partition always verifies against its files.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import psutil
import pyarrow as pa
import pytest
from support import (
    cpu_resource,
    gen_pipeline,
    materialize_partitions,
    model_loads,
    partition_metadata,
    step_attempts,
    write_prompts,
)

from dagster_gpuinfer import (
    InferenceSpec,
    OutputSpec,
    read_partition,
    storage,
)
from dagster_gpuinfer.storage import (
    ChunkMarker,
    PartitionOutput,
    read_chunk_markers,
    table_to_parquet_bytes,
    verify_manifest,
    write_chunk_marker,
    write_file_entry,
)
from dagster_gpuinfer.storage import commit as storage_commit
from dagster_gpuinfer.storage import files as storage_files
from dagster_gpuinfer.worker.commit import PartitionTimes, commit_chunks, write_chunk
from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.rows.readers import RawChunk
from dagster_gpuinfer.worker.rows.validate import ValidChunk
from dagster_gpuinfer.worker.rows.writers import errors_table
from dagster_gpuinfer.worker.stage_messages import ChunkResult

# --------------------------------------------------------------------------- commit window

SOURCE = storage.SourceVersion(input="test shard")


def _spec(root: Path) -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "generate",
            "input": {"uri": str(root / "in" / "{partition_key}.jsonl")},
            "output": {"root": str(root / "out"), "asset_name": "gen"},
        }
    )


def _chunks_ready_to_commit(root: Path) -> tuple[InferenceSpec, PartitionOutput]:
    """A partition whose three chunks are committed (markers written), not yet the partition."""
    spec = _spec(root)
    where = PartitionOutput.of(spec, "p", source=SOURCE)
    for index in range(3):
        ids = [f"r{index}-{i}" for i in range(4)]
        table = pa.table({"id": ids, "text": ["t"] * 4})
        part = write_file_entry(
            where.fs,
            where.path,
            storage.chunk_part_name(where.spec_hash, index, "a1", ".parquet"),
            table_to_parquet_bytes(table),
            4,
        )
        bad = errors_table([RowError(f"bad{index}", "s", 99, "empty_input", "empty")])
        errors = write_file_entry(
            where.fs,
            storage.chunk_dir(where.path, where.spec_hash),
            f"errors-{index:05d}-a1.parquet",
            table_to_parquet_bytes(bad),
            1,
        )
        write_chunk_marker(
            where.fs,
            where.path,
            ChunkMarker(
                index=index,
                spec_hash=where.spec_hash,
                rows_in=5,
                rows_out=4,
                rows_errored=1,
                part=part,
                errors=errors,
            ),
        )
    return spec, where


def _commit(spec: InferenceSpec, where: PartitionOutput):
    markers = read_chunk_markers(where.fs, where.path, where.spec_hash)
    return commit_chunks(
        where,
        spec,
        markers,
        computed=set(markers),
        rows_resumed=0,
        times=PartitionTimes(started_at=time.time(), model_load_seconds=0.0),
        worker={},
    )


def _crash_during_commit(root: str, crash_at: int, torn: bool) -> None:
    """Child process: commit, dying (like SIGKILL: no cleanup) at storage operation `crash_at`.
    With `torn`, the dying write leaves half a temporary file behind first."""
    spec, where = _spec(Path(root)), PartitionOutput.of(_spec(Path(root)), "p", source=SOURCE)
    calls = {"n": 0}
    real_write, real_delete = storage.write_bytes_atomic, storage.delete_quietly
    real_create = storage.create_exclusive

    def dying(real):
        def write(fs, path, data, *args):
            if calls["n"] == crash_at:
                if torn:
                    torn_name = ".tmp-torn-" + Path(path).name
                    Path(path).with_name(torn_name).write_bytes(data[: len(data) // 2])
                os._exit(137)
            calls["n"] += 1
            return real(fs, path, data, *args)

        return write

    def delete(fs, paths):
        paths = list(paths)
        if calls["n"] == crash_at:
            real_delete(fs, paths[:1])
            os._exit(137)
        calls["n"] += 1
        real_delete(fs, paths)

    replacements = {
        "write_bytes_atomic": dying(real_write),
        "create_exclusive": dying(real_create),
        "delete_quietly": delete,
    }
    for module in (storage_files, storage_commit):  # wherever the commit calls them
        for name, replacement in replacements.items():
            if hasattr(module, name):
                setattr(module, name, replacement)
    _commit(spec, where)
    os._exit(0)


@pytest.mark.parametrize("crash_at", [0, 1, 2])
@pytest.mark.parametrize("torn", [False, True])
def test_crash_in_commit_window_leaves_partition_all_or_nothing(tmp_path, crash_at, torn):
    spec, where = _chunks_ready_to_commit(tmp_path)
    child = multiprocessing.get_context("fork").Process(
        target=_crash_during_commit, args=(str(tmp_path), crash_at, torn)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 137, "the injected crash did not happen"

    after_crash = where.committed()
    if after_crash is not None:  # crashed after the manifest: it must already verify
        assert verify_manifest(where.fs, where.path, after_crash) == []
    # The retry: a worker finds it committed, or commits from the surviving chunk markers.
    manifest = where.committed() or _commit(spec, where)
    assert verify_manifest(where.fs, where.path, manifest) == []
    assert (manifest.rows_in, manifest.rows_out, manifest.rows_errored) == (15, 12, 3)
    ids = read_partition(spec.output, "p").column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{c}-{i}" for c in range(3) for i in range(4))
    errors = storage.read_errors(spec.output, "p").column("id").to_pylist()
    assert sorted(errors) == ["bad0", "bad1", "bad2"]
    leftovers = {n for n in os.listdir(where.path) if not n.startswith(".tmp-")}
    assert leftovers == {"_SUCCESS", manifest.errors.name, *(p.name for p in manifest.parts)}


# --------------------------------------------------------------------------- SIGKILL


def _worker_processes() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "dagster_gpuinfer.worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _kill_worker_tree() -> int:
    killed = 0
    for worker in _worker_processes():
        try:
            family = [worker, *worker.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in family:
            try:
                process.send_signal(signal.SIGKILL)
                killed += 1
            except psutil.NoSuchProcess:
                pass
    return killed


@pytest.mark.engine
def test_killed_worker_resumes_without_recomputing_committed_chunks(tmp_path, tiny_llama_dir):
    write_prompts(tmp_path / "in" / "p0.jsonl", 600)
    pipeline = gen_pipeline(tmp_path, tiny_llama_dir, chunk_size=10, retries=1)
    spec_hash = InferenceSpec.model_validate(pipeline.spec).spec_hash()
    markers_dir = tmp_path / "out" / "gen" / "p0" / "_chunks" / spec_hash
    load_log = tmp_path / "loads.log"
    killed: dict[str, object] = {}

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if markers_dir.exists() and any(markers_dir.glob("[0-9]*.json")):
                killed["processes"] = _kill_worker_tree()
                time.sleep(0.5)  # let the last marker write (if any) settle before reading
                where = PartitionOutput(
                    *storage.filesystem_for(str(tmp_path / "out" / "gen" / "p0")),
                    spec_hash=spec_hash,
                    partition_key="p0",
                    source=SOURCE,
                )
                killed["markers"] = read_chunk_markers(where.fs, where.path, spec_hash)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p0"], resource=cpu_resource(load_log), instance=instance
        )
        metadata = partition_metadata(instance, pipeline.output_asset.key, "p0")
    thread.join(5)

    assert killed.get("processes"), "the worker was never killed"
    committed_before_kill: dict[int, ChunkMarker] = killed["markers"]  # type: ignore[assignment]
    assert 1 <= len(committed_before_kill) < 60, "kill must land mid-shard"
    assert result.success and step_attempts(result) == 2
    assert model_loads(load_log) == 2

    output = OutputSpec(root=str(tmp_path / "out"), asset_name="gen")
    fs, path = storage.filesystem_for(str(tmp_path / "out" / "gen" / "p0"))
    manifest = storage.read_manifest(fs, path)
    assert verify_manifest(fs, path, manifest) == []
    # Chunks committed before the kill are the very files of the first attempt: not recomputed.
    final_parts = {p.name for p in manifest.parts}
    first_attempt_parts = {m.part.name for m in committed_before_kill.values()}
    assert first_attempt_parts <= final_parts
    resumed_rows = sum(m.rows_in for m in committed_before_kill.values())
    assert manifest.rows_resumed == resumed_rows == metadata["rows_resumed"]
    second_attempt_rows = sum(p.rows for p in manifest.parts if p.name not in first_attempt_parts)
    assert second_attempt_rows == 600 - resumed_rows
    # The partition's own figures are the second attempt's: its rows, over its engine time.
    assert manifest.computed.rows_in == 600 - resumed_rows
    assert metadata["rows_per_second"] == pytest.approx(
        manifest.computed.rows_in / manifest.engine_seconds, rel=0.01
    )
    assert 0 < manifest.inference_seconds <= manifest.wall_seconds
    ids = read_partition(output, "p0").column("id").to_pylist()
    assert len(ids) == 600 and set(ids) == {f"id-{i}" for i in range(600)}


# --------------------------------------------------------------------------- racing runs


def _error_lines(log: str, limit: int = 12_000) -> str:
    """The lines of a run's log that say why it failed: tracebacks and error lines, wherever
    in the log they are (an engine's traceback sits between thousands of warning lines)."""
    lines, keep = log.splitlines(), set()
    for index, line in enumerate(lines):
        if "Traceback" in line or "rror" in line:
            keep.update(range(max(0, index - 2), min(len(lines), index + 25)))
    return "\n".join(lines[index] for index in sorted(keep))[:limit]


@pytest.mark.engine
def test_two_concurrent_runs_of_one_partition_commit_it_exactly_once(tmp_path, tiny_llama_dir):
    write_prompts(tmp_path / "in" / "p0.jsonl", 400)
    script = Path(__file__).with_name("concurrent_run.py")
    # Each run's output (its worker's and engine's with it) goes to a file, so a failed run
    # shows why in the assertion: the head holds an engine process's traceback.
    logs = [tmp_path / f"run-{index}.log" for index in range(2)]
    runs = []
    for log in logs:
        with open(log, "w") as out:
            runs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(tmp_path), tiny_llama_dir],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = [run.wait(timeout=900) for run in runs]
    outputs = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "both runs must succeed; " + "\n".join(
        f"run {index} exited {code}; its errors:\n{_error_lines(text)}\n...\n{text[-3000:]}"
        for index, (code, text) in enumerate(zip(codes, outputs, strict=True))
        if code != 0
    )

    fs, path = storage.filesystem_for(str(tmp_path / "out" / "gen" / "p0"))
    manifest = storage.read_manifest(fs, path)
    assert verify_manifest(fs, path, manifest) == []
    output = OutputSpec(root=str(tmp_path / "out"), asset_name="gen")
    ids = read_partition(output, "p0").column("id").to_pylist()
    assert len(ids) == 400 and len(set(ids)) == 400
    # One part per chunk, whichever worker wrote it.
    chunk_indexes = [p.name.split("-")[2] for p in manifest.parts]
    assert sorted(chunk_indexes) == [f"{i:05d}" for i in range(20)]
    # Nothing but the committed files remains (once both workers are gone).
    names = {n for n in os.listdir(path) if not n.startswith(".tmp-")}
    assert names == {"_SUCCESS", manifest.errors.name, *(p.name for p in manifest.parts)}


# --------------------------------------------------------------------------- instance config


def test_local_instance_config_enables_run_retries_for_lost_run_workers(tmp_path):
    import shutil

    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "deploy" / "local" / "dagster.yaml", tmp_path / "dagster.yaml")
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    try:
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        # Step failures are left to RetryPolicy (which a non-retryable Failure stops), so a
        # bad shard is not retried by the daemon as a whole run.
        assert instance.run_retries_retry_on_asset_or_op_failure is False
        assert instance.run_monitoring_enabled
    finally:
        instance.dispose()


def _write_attempt(where: PartitionOutput, attempt: str, chunks: int = 2) -> dict[int, ChunkMarker]:
    markers = {}
    for index in range(chunks):
        table = pa.table({"id": [f"r{index}-{i}" for i in range(3)], "text": [attempt] * 3})
        part = write_file_entry(
            where.fs,
            where.path,
            storage.chunk_part_name(where.spec_hash, index, attempt, ".parquet"),
            table_to_parquet_bytes(table),
            3,
        )
        markers[index] = ChunkMarker(
            index=index, spec_hash=where.spec_hash, rows_in=3, rows_out=3, rows_errored=0, part=part
        )
    return markers


def test_of_two_workers_committing_one_partition_exactly_one_wins(tmp_path):
    spec = _spec(tmp_path)
    where = PartitionOutput.of(spec, "p", source=SOURCE)
    winner, loser = _write_attempt(where, "aaaa1111"), _write_attempt(where, "bbbb2222")
    args = dict(computed=set(), rows_resumed=0, times=PartitionTimes(0.0, 0.0), worker={})
    committed = commit_chunks(where, spec, winner, **args)
    with pytest.raises(storage.CommitConflict) as conflict:
        commit_chunks(where, spec, loser, **args)
    assert conflict.value.manifest == committed
    # The loser stops and removes only its own files; the winner's commit stays intact.
    where.yield_to(conflict.value.manifest, "bbbb2222")
    assert verify_manifest(where.fs, where.path, where.committed()) == []
    assert not [n for n in os.listdir(where.path) if "bbbb2222" in n]
    assert set(read_partition(spec.output, "p").column("text").to_pylist()) == {"aaaa1111"}


@pytest.mark.parametrize("raced", ["part", "marker"])
def test_a_chunk_write_that_meets_another_workers_commit_is_written_again_then_yielded(
    tmp_path, monkeypatch, raced
):
    """Two runs of one partition: the winner's commit clears what its manifest does not name
    (temporary files, the chunk folder) while the loser is writing a chunk, which pulls the
    loser's file from under it. The loser's write goes on; its yield removes what it wrote."""
    spec = _spec(tmp_path)
    where = PartitionOutput.of(spec, "p", source=SOURCE)
    winner = _write_attempt(where, "aaaa1111")
    args = dict(computed=set(), rows_resumed=0, times=PartitionTimes(0.0, 0.0), worker={})
    real_copy, commits = storage_files.local_temporary_copy, []

    def copy_then_commit_elsewhere(path: str, data: bytes) -> str:
        tmp = real_copy(path, data)
        if "bbbb2222" in path or (raced == "marker" and path.endswith("00005.json")):
            if not commits:  # the winner commits between the loser's write and its rename
                commits.append(commit_chunks(where, spec, winner, **args))
        return tmp

    if raced == "part":
        monkeypatch.setattr(storage_files, "local_temporary_copy", copy_then_commit_elsewhere)
    else:
        real_marker = storage.layout.write_chunk_marker

        def marker_then_commit(fs, path, marker):
            with monkeypatch.context() as patch:
                patch.setattr(storage_files, "local_temporary_copy", copy_then_commit_elsewhere)
                real_marker(fs, path, marker)

        monkeypatch.setattr("dagster_gpuinfer.worker.commit.write_chunk_marker", marker_then_commit)
    chunk = RawChunk(index=5, source="s", rows=[(0, "x", "hi")], rows_in=1)
    valid = ValidChunk(index=5, rows=[0], ids=["x"], token_ids=[[1]])
    result = ChunkResult(
        texts=["out"], finish_reasons=["stop"], prompt_tokens=[1], generated_tokens=[1]
    )
    marker = write_chunk(spec, where, chunk, valid, result, "bbbb2222")

    assert commits and marker.part is not None and marker.index == 5
    assert where.committed() == commits[0]
    where.yield_to(commits[0], "bbbb2222")
    assert verify_manifest(where.fs, where.path, where.committed()) == []
    assert not [n for n in os.listdir(where.path) if "bbbb2222" in n or n == storage.CHUNKS_DIR]
    assert set(read_partition(spec.output, "p").column("text").to_pylist()) == {"aaaa1111"}


def test_a_chunk_write_that_fails_with_no_commit_elsewhere_raises(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    where = PartitionOutput.of(spec, "p", source=SOURCE)

    def full_disk(path: str, data: bytes) -> str:
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(storage_files, "local_temporary_copy", full_disk)
    chunk = RawChunk(index=0, source="s", rows=[(0, "x", "hi")], rows_in=1)
    valid = ValidChunk(index=0, rows=[0], ids=["x"], token_ids=[[1]])
    result = ChunkResult(
        texts=["out"], finish_reasons=["stop"], prompt_tokens=[1], generated_tokens=[1]
    )
    with pytest.raises(OSError, match="No space left"):
        write_chunk(spec, where, chunk, valid, result, "cccc3333")


def test_a_new_spec_replaces_the_manifest_of_an_old_one(tmp_path):
    spec = _spec(tmp_path)
    where = PartitionOutput.of(spec, "p", source=SOURCE)
    args = dict(computed=set(), rows_resumed=0, times=PartitionTimes(0.0, 0.0), worker={})
    commit_chunks(where, spec, _write_attempt(where, "old00000"), **args)
    new_spec = spec.model_copy(update={"chunk_size": 3})
    new_where = PartitionOutput.of(new_spec, "p", source=SOURCE)
    assert new_where.committed() is None
    manifest = commit_chunks(new_where, new_spec, _write_attempt(new_where, "new00000"), **args)
    assert new_where.committed() == manifest
    assert not [n for n in os.listdir(where.path) if spec.spec_hash() in n]
