"""Row reuse for OpenAI Batch output (`output_format="openai_batch"`, the batch API's) on the
fake engine of `test_engine_loop`: the rows' reuse keys and input digests live in a Parquet
file beside each JSONL part (`ChunkMarker.reuse_part`), the JSONL a user downloads stays
OpenAI's lines, and a re-run or another partition under `row_reuse_scope="pipeline"` reads
the keys back and computes only the lines no committed output holds. Shards, part files,
markers and commits are real (local storage).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from test_engine_loop import FakeEngine, _serve

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.metadata import rows_computed
from dagster_gpuinfer.storage import (
    PartitionOutput,
    SourceVersion,
    read_manifest,
    read_openai_batch_files,
    verify_manifest,
)
from dagster_gpuinfer.storage.digests import line_digest
from dagster_gpuinfer.storage.openai_lines import request_id
from dagster_gpuinfer.worker.loop.reuse import RowKeys, RowReuse, pipeline_outputs
from dagster_gpuinfer.worker.rows.validate import ValidChunk

OPENAI_KEYS = {"id", "custom_id", "response", "error"}


def _spec(root: Path, out: str = "out", key: str = "s0", **fields) -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "embed",
            "input": {"uri": str(root / "in" / "{partition_key}.jsonl"), "format": "openai_batch"},
            "output": {"root": str(root / out), "asset_name": "emb", "format": "openai_batch"},
            "chunk_size": 4,
            "partition_keys": [key],
            **fields,
        }
    )


def _line(custom_id: str, number: int) -> str:
    body = {"model": "/m", "input": f"row {number}"}
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}
    return json.dumps(request)


def _write(root: Path, lines: list[tuple[str, int]], key: str = "s0") -> list[str]:
    """The shard `key`: (custom_id, number) lines; the fake engine's embedding of a line is
    [number, prompt length]. Returns the lines as written."""
    (root / "in").mkdir(parents=True, exist_ok=True)
    text = [_line(custom_id, number) for custom_id, number in lines]
    (root / "in" / f"{key}.jsonl").write_text("".join(t + "\n" for t in text))
    return text


def _output(spec: InferenceSpec, key: str = "s0") -> list[dict]:
    files = read_openai_batch_files(spec.output, key)
    assert files.committed
    return [json.loads(line) for line in files.output.splitlines()]


def _answers(lines: list[dict]) -> list[tuple[str, list[float]]]:
    """(custom_id, embedding) of each output line, in order."""
    return [(x["custom_id"], x["response"]["body"]["data"][0]["embedding"]) for x in lines]


def _request_ids(spec: InferenceSpec, lines: list[tuple[str, int]]) -> list[str]:
    """The line ids a computation of `lines` under `spec` gives (its spec hash, custom_id)."""
    return [f"batch_req_{request_id(spec.spec_hash(), custom_id)}" for custom_id, _ in lines]


def _counts(manifest) -> tuple[int, int, int]:
    """(computed, reused, deduplicated): the partition metadata's figures."""
    return rows_computed(manifest), manifest.rows_reused, manifest.rows_deduplicated


def test_a_re_run_of_a_changed_batch_computes_only_new_lines_and_the_output_stays_openai(
    tmp_path,
):
    lines = [(f"c{i}", 100 + i) for i in range(10)]
    _write(tmp_path, lines)
    spec = _spec(tmp_path)
    ((first, _),), done, error = _serve(spec, FakeEngine())
    assert error is None and done and _counts(first) == (10, 0, 0)

    lines[3] = ("c3", 203)  # one line edited
    lines[5] = ("renamed", 105)  # one renamed: the same request
    lines += [("c10", 110), ("c11", 111)]  # two appended
    written = _write(tmp_path, lines)
    engine = FakeEngine()
    ((again, computed),), done, error = _serve(spec, engine)
    assert error is None and done and computed
    assert sorted(engine.submitted) == [110, 111, 203]
    assert _counts(again) == (3, 9, 0)
    assert (again.rows_out, again.computed.rows_reused) == (12, 9)

    out = _output(spec)
    assert all(set(line) == OPENAI_KEYS for line in out)  # no key leaks into the file
    assert "reuse_key" not in read_openai_batch_files(spec.output, "s0").output.decode()
    assert _answers(out) == [(c, [float(n), 7.0]) for c, n in lines]

    full = _spec(tmp_path, out="full")
    _serve(full, FakeEngine())
    assert [(x["custom_id"], x["response"]["body"]["data"]) for x in out] == [
        (x["custom_id"], x["response"]["body"]["data"]) for x in _output(full)
    ]
    assert [x["id"] for x in out] == _request_ids(spec, lines)  # the renamed line's own

    where = PartitionOutput.of(spec, "s0", source=again.source)
    assert verify_manifest(where.fs, where.path, again) == []
    assert len(again.reuse_parts) == len(again.parts) == 3
    keyed = [pq.read_table(tmp_path / "out" / "emb" / "s0" / p.name) for p in again.reuse_parts]
    ids = [i for table in keyed for i in table.column("id").to_pylist()]
    digests = [d for table in keyed for d in table.column("input_digest").to_pylist()]
    assert ids == [x["custom_id"] for x in out]
    assert digests == [line_digest(t.encode()) for t in written]
    names = {p.name for p in (tmp_path / "out" / "emb" / "s0").iterdir()}
    assert {p.name for p in again.reuse_parts} <= names
    assert not {n for n in names if n.startswith("reuse-")} - {p.name for p in again.reuse_parts}


def test_the_keys_written_beside_the_jsonl_are_the_keys_a_lookup_finds(tmp_path):
    """The round trip: each key in the reuse files is the key the worker computes for that
    line's request (its tokens, not its custom_id), and the pipeline index maps it to the
    reuse file row holding that line's output."""
    lines = [("a", 300), ("b", 301), ("c", 300)]  # c repeats a's request
    _write(tmp_path, lines)
    spec = _spec(tmp_path)
    ((manifest, _),), _, error = _serve(spec, FakeEngine())
    assert error is None and _counts(manifest) == (2, 0, 1)

    keys = RowKeys(spec)
    expected = [
        keys.key(None, [[ord(c) for c in f"row {n}"]], None) for _, n in lines
    ]  # the fake tokenizer: one token a character
    index = pipeline_outputs(spec)
    assert set(index) == {expected[0], expected[1]} and expected[0] == expected[2]
    for (custom_id, number), key in zip(lines[:2], expected[:2], strict=True):
        ref = index[key]
        row = pq.read_table(ref.path).slice(ref.row, 1).to_pylist()[0]
        assert row["reuse_key"] == key and row["id"] == custom_id
        assert row["embedding"][0] == number
    assert read_manifest(*_fs_path(spec)).keyed_parts() == manifest.reuse_parts


def _fs_path(spec: InferenceSpec):
    where = PartitionOutput.of(spec, "s0", source=SourceVersion(input="x"))
    return where.fs, where.path


def test_a_second_batch_under_pipeline_scope_computes_only_lines_no_batch_holds(tmp_path):
    _write(tmp_path, [(f"a{i}", 100 + i) for i in range(8)], "s0")
    _write(tmp_path, [(f"b{i}", 104 + i) for i in range(8)], "s1")  # 4 of s0's, 4 new
    scoped = _spec(tmp_path, out="by_partition")
    wide = _spec(tmp_path, row_reuse_scope="pipeline")
    for spec in (scoped, wide):
        _, done, error = _serve(spec, FakeEngine())
        assert error is None and done
    narrow = FakeEngine()
    ((alone, _),), _, _ = _serve(_spec(tmp_path, out="by_partition", key="s1"), narrow)
    assert len(narrow.submitted) == 8 and _counts(alone) == (8, 0, 0)

    engine = FakeEngine()
    second = _spec(tmp_path, key="s1", row_reuse_scope="pipeline")
    ((manifest, _),), done, error = _serve(second, engine)
    assert error is None and done
    assert sorted(engine.submitted) == [108, 109, 110, 111]
    assert _counts(manifest) == (4, 4, 0)
    out = _output(wide, "s1")
    assert all(set(line) == OPENAI_KEYS for line in out)
    assert _answers(out) == _answers(_output(scoped, "s1"))
    assert [x["id"] for x in out] == _request_ids(second, [(f"b{i}", 0) for i in range(8)])


def test_row_reuse_off_writes_no_reuse_files_and_computes_every_line(tmp_path):
    _write(tmp_path, [(f"c{i}", 100 + i % 2) for i in range(6)])
    spec = _spec(tmp_path, row_reuse="off")
    engine = FakeEngine()
    ((manifest, _),), done, error = _serve(spec, engine)
    assert error is None and done and len(engine.submitted) == 6
    assert manifest.reuse_parts == [] and _counts(manifest) == (6, 0, 0)
    assert not list((tmp_path / "out").rglob("reuse-*"))


def test_unseeded_sampling_lines_get_no_reuse_file(tmp_path):
    """A chunk none of whose rows has a key (unseeded sampling) keeps no reuse file: its
    rows are never copied, so nothing is stored for them."""
    import pyarrow as pa

    from dagster_gpuinfer.worker.commit import _keeps_keys

    spec = InferenceSpec.model_validate(
        {**_spec(tmp_path).model_dump(), "task": "chat", "sampling": {"temperature": 0.8}}
    )
    keys = RowKeys(spec)
    assert keys.keyed and keys.key(None, [[1, 2]], None) is None
    unkeyed = pa.table({"id": ["a"], "reuse_key": pa.array([None], pa.string())})
    assert not _keeps_keys(spec, unkeyed)
    keyed = pa.table({"id": ["a", "b"], "reuse_key": pa.array([None, "k"], pa.string())})
    assert _keeps_keys(spec, keyed)
    plan = RowReuse(spec).plan(
        "s0", SourceVersion(input="v"), ValidChunk(index=0, rows=[0], ids=["a"], token_ids=[[1]])
    )
    assert plan.compute == [0] and plan.keys == [None]


def test_the_estimate_counts_changed_lines_of_an_openai_batch_output(tmp_path):
    from dagster_gpuinfer.estimate import estimate_backfill

    lines = [(f"c{i}", 100 + i) for i in range(8)]
    _write(tmp_path, lines)
    spec = _spec(tmp_path)
    _serve(spec, FakeEngine())
    _write(tmp_path, [*lines[:6], ("c6", 206), *lines[7:], ("c8", 108)])
    estimate = estimate_backfill(spec, ["s0"], asset="emb", partitions_per_run=1)
    assert (estimate.partitions_reusable, estimate.partitions_reuse_counted) == (1, 1)
    assert (estimate.reuse_rows_to_compute, estimate.reuse_rows) == (2, 9)


def test_a_rerank_line_assembled_by_reuse_still_names_its_documents_and_top_n(tmp_path):
    """Every openai_batch chunk now goes through `RowReuse.assemble`: the rows it keeps
    carry their pairs and requests, so a rerank body names its documents and honours its
    `top_n` (without them: empty documents, every result)."""
    import pyarrow as pa

    from dagster_gpuinfer.worker.rows.writers import encode_openai_batch
    from dagster_gpuinfer.worker.tasks.params import RowRequest
    from dagster_gpuinfer.worker.tasks.pooling import ScorePairs
    from dagster_gpuinfer.worker.tasks.table import SCORE_SCHEMA

    spec = InferenceSpec.model_validate({**_spec(tmp_path).model_dump(), "task": "score"})
    valid = ValidChunk(
        index=0,
        rows=[0, 1],
        ids=["r0", "r1"],
        pairs=[ScorePairs(["q", "q"], ["cold", "warm"], rerank=True)] * 2,
        requests=[RowRequest(top_n=1), RowRequest()],
    )
    plan = RowReuse(spec).plan("s0", SourceVersion(input="v"), valid)
    assert plan.compute == [0, 1] and None not in plan.keys
    computed = pa.Table.from_pydict(
        {
            "id": ["r0", "r1"],
            "score": [None, None],
            "scores": [[0.1, 0.9], [0.1, 0.9]],
            "endpoint": ["rerank", "rerank"],
            "prompt_tokens": [4, 4],
        },
        schema=SCORE_SCHEMA,
    )
    kept, table, _, _ = RowReuse(spec).assemble(plan, valid.subset([0, 1]), computed, "s0")
    lines = encode_openai_batch("score", "m", "h", table, kept).decode().splitlines()
    results = [json.loads(line)["response"]["body"]["results"] for line in lines]
    assert [[r["document"]["text"] for r in rows] for rows in results] == [
        ["warm"],
        ["warm", "cold"],
    ]
