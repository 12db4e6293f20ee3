"""Output layout and commit rules, on the local filesystem."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from dagster_gpuinfer import InferenceSpec, OutputSpec, storage
from dagster_gpuinfer.storage import (
    ERRORS_NAME,
    MANIFEST_NAME,
    ChunkMarker,
    FileEntry,
    Manifest,
    commit_partition,
    filesystem_for,
    partition_dir,
    partition_dir_name,
    partition_progress,
    read_manifest,
    read_partition,
    table_to_parquet_bytes,
    verify_manifest,
    write_bytes_atomic,
    write_chunk_marker,
    write_file_entry,
)
from dagster_gpuinfer.storage import files as storage_files
from dagster_gpuinfer.storage import layout as storage_layout
from dagster_gpuinfer.storage import reading as storage_reading


@pytest.mark.parametrize(
    "key",
    [
        "../../etc",
        "..",
        ".",
        "a/b",
        "/abs/path",
        "with space",
        "ünïcødé-ключ",
        "_SUCCESS",
        "a\\b",
        "%2F",
    ],
)
def test_partition_keys_never_escape_the_output_root(tmp_path, key):
    output = OutputSpec(root=str(tmp_path / "root"), asset_name="asset")
    path = Path(partition_dir(output, key))
    assert path.parent == tmp_path / "root" / "asset"
    assert os.path.realpath(path).startswith(str(tmp_path / "root" / "asset") + os.sep)
    assert path.name not in {".", "..", MANIFEST_NAME, "_chunks"}
    assert "/" not in partition_dir_name(key)


def test_distinct_partition_keys_get_distinct_folders():
    keys = ["a/b", "a%2Fb", "a b", "a+b", "..", "%2E%2E", ".a", "%2Ea"]
    assert len({partition_dir_name(k) for k in keys}) == len(keys)


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    fs, path = filesystem_for(str(tmp_path / "x" / "file.bin"))
    write_bytes_atomic(fs, path, b"one")
    write_bytes_atomic(fs, path, b"two")
    assert (tmp_path / "x" / "file.bin").read_bytes() == b"two"
    assert os.listdir(tmp_path / "x") == ["file.bin"]


def _committed_partition(tmp_path: Path, rows: int = 3) -> tuple[OutputSpec, str, Manifest]:
    output = OutputSpec(root=str(tmp_path), asset_name="asset")
    fs, path = filesystem_for(partition_dir(output, "p"))
    table = pa.table({"id": [str(i) for i in range(rows)], "text": ["x"] * rows})
    part = write_file_entry(fs, path, "part-h-00000.parquet", table_to_parquet_bytes(table), rows)
    manifest = Manifest(
        partition_key="p",
        spec_hash="h",
        model="m",
        task="generate",
        output_format="parquet",
        rows_in=rows,
        rows_out=rows,
        rows_errored=0,
        parts=[part],
        errors=FileEntry(name=ERRORS_NAME, rows=0, bytes=0, sha256=""),
    )
    return output, path, commit_partition(fs, path, manifest, [])


def test_commit_writes_errors_then_manifest_and_removes_unlisted_files(tmp_path):
    output = OutputSpec(root=str(tmp_path), asset_name="asset")
    fs, path = filesystem_for(partition_dir(output, "p"))
    os.makedirs(path)
    Path(path, "part-oldspec-00000.parquet").write_bytes(b"stale")
    Path(path, ".tmp-dead-part.parquet").write_bytes(b"half")
    _, path, manifest = _committed_partition(tmp_path)
    assert manifest.errors.name.startswith("errors-h-") and manifest.errors.name != ERRORS_NAME
    assert sorted(os.listdir(path)) == sorted(
        [MANIFEST_NAME, manifest.errors.name, "part-h-00000.parquet"]
    )
    assert read_manifest(fs, path) == manifest
    assert verify_manifest(fs, path, manifest) == []
    assert read_partition(output, "p").column("id").to_pylist() == ["0", "1", "2"]


def test_verify_manifest_catches_a_part_file_that_lost_rows(tmp_path):
    _, path, manifest = _committed_partition(tmp_path)
    fs, _ = filesystem_for(path)
    short = pa.table({"id": ["0"], "text": ["x"]})
    write_bytes_atomic(fs, f"{path}/part-h-00000.parquet", table_to_parquet_bytes(short))
    problems = verify_manifest(fs, path, manifest)
    assert any("holds 1 rows, the manifest says 3" in p for p in problems)


def test_verify_manifest_catches_unbalanced_counts(tmp_path):
    _, path, manifest = _committed_partition(tmp_path)
    fs, _ = filesystem_for(path)
    bad = manifest.model_copy(update={"rows_in": 5})
    assert any("rows_in=5" in p for p in verify_manifest(fs, path, bad))


def test_reading_an_uncommitted_partition_says_what_to_do(tmp_path):
    output = OutputSpec(root=str(tmp_path), asset_name="asset")
    with pytest.raises(FileNotFoundError, match="not committed.*materialize it first"):
        read_partition(output, "never")


def _partition_with_one_chunk(tmp_path: Path) -> tuple[OutputSpec, object, str]:
    """A partition mid-run: chunk 0 (2 of its 3 rows) committed, no manifest yet."""
    output = OutputSpec(root=str(tmp_path), asset_name="asset")
    fs, path = filesystem_for(partition_dir(output, "p"))
    write_chunk_marker(fs, path, ChunkMarker(index=0, spec_hash="h", rows_in=2, rows_out=2))
    return output, fs, path


def _patch_storage(monkeypatch, name: str, replacement) -> None:
    """Replace `name` wherever the storage package's modules call it."""
    for module in (storage_files, storage_layout, storage_reading):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, replacement)


@pytest.mark.parametrize("at", ["list_names", "read_bytes"])
def test_progress_read_while_the_worker_commits_gives_the_committed_counts(
    tmp_path, monkeypatch, at
):
    """The commit writes the manifest, then deletes the chunk markers: a reader that lists the
    markers (or opens one listed) as they go must report the committed partition, never
    raise (the batch API answered 500 to a poll here) nor report fewer rows than before."""
    output, _, path = _partition_with_one_chunk(tmp_path)
    assert partition_progress(output, "p") == (False, storage.RowCounts(rows_in=2, rows_out=2))
    real = getattr(storage, at)
    chunks = os.path.join(path, storage.CHUNKS_DIR)

    def commit_first(fs, where):
        if where.startswith(chunks) and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
            _committed_partition(tmp_path)  # the worker commits: manifest, then cleanup
        return real(fs, where)

    _patch_storage(monkeypatch, at, commit_first)
    committed, counts = partition_progress(output, "p")
    assert committed and counts.rows_out == 3


def test_a_marker_deleted_with_no_commit_behind_it_is_not_hidden(tmp_path, monkeypatch):
    output, _, path = _partition_with_one_chunk(tmp_path)
    real = storage.read_bytes
    chunks = os.path.join(path, storage.CHUNKS_DIR)

    def vanish(fs, where):
        if where.startswith(chunks):
            os.remove(where)
        return real(fs, where)

    _patch_storage(monkeypatch, "read_bytes", vanish)
    with pytest.raises(FileNotFoundError):
        partition_progress(output, "p")


def test_the_weights_digest_reads_no_weights(tmp_path):
    """The model folder's version is a digest of names, sizes and mtimes: a 140 GB folder
    costs a listing, and any rewrite of a file changes it."""
    from dagster_gpuinfer.storage import model_version

    folder = tmp_path / "m"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "w.bin").write_bytes(b"x" * 10)
    (folder / ".cache").mkdir()
    spec = InferenceSpec.model_validate(
        {
            "model": str(folder),
            "task": "embed",
            "input": {"uri": str(tmp_path / "{partition_key}.jsonl")},
            "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
        }
    )
    first = model_version(spec)
    assert first is not None and first.startswith("files:2:")
    (folder / ".cache" / "lock").write_text("download tool bookkeeping")
    assert model_version(spec) == first
    stat = os.stat(folder / "sub" / "w.bin")
    os.utime(folder / "sub" / "w.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert model_version(spec) != first
    hub = spec.model_copy(update={"model": "sentence-transformers/all-MiniLM-L6-v2"})
    assert model_version(hub) is None


def test_a_local_shard_version_changes_with_every_rewrite_and_not_with_a_read(tmp_path):
    from dagster_gpuinfer.storage import file_version

    fs, path = storage.filesystem_for(str(tmp_path / "s.jsonl"))
    with pytest.raises(FileNotFoundError):
        file_version(fs, path)
    (tmp_path / "s.jsonl").write_text('{"text": "a"}\n')
    first = file_version(fs, path)
    (tmp_path / "s.jsonl").read_bytes()
    assert file_version(fs, path) == first
    (tmp_path / "new").write_text('{"text": "b"}\n')  # same size, renamed into place
    os.replace(tmp_path / "new", tmp_path / "s.jsonl")
    assert file_version(fs, path) != first
