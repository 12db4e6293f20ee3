"""Shard readers: exact chunk boundaries, streaming, and bad lines kept as row errors."""

from __future__ import annotations

import json

import pytest
from support import write_jsonl, write_parquet

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.worker.errors import ShardError
from dagster_gpuinfer.worker.rows.readers import ShardReader


def make_spec(uri: str, task: str = "generate", **input_fields) -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": task,
            "input": {"uri": uri, **input_fields},
            "output": {"root": "/out", "asset_name": "a"},
        }
    )


def test_parquet_chunks_are_exact_across_row_groups(tmp_path):
    write_parquet(
        tmp_path / "s.parquet",
        {"id": [f"r{i}" for i in range(25)], "text": [f"t{i}" for i in range(25)]},
        row_group_size=7,
    )
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.parquet")), "s")
    reader.preflight()
    chunks = list(reader.chunks(10))
    assert [c.rows_in for c in chunks] == [10, 10, 5]
    assert [c.index for c in chunks] == [0, 1, 2]
    rows = [r for c in chunks for r in c.rows]
    assert [r[0] for r in rows] == list(range(25))
    assert rows[13] == (13, "r13", "t13")


def test_jsonl_bad_lines_become_row_errors_and_keep_their_row_numbers(tmp_path):
    write_jsonl(
        tmp_path / "s.jsonl",
        [
            {"id": "a", "text": "fine"},
            b"{not json",
            b"\xff\xfe not utf-8",
            b"[1, 2]",
            {"id": "b", "text": "also fine"},
        ],
    )
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.jsonl")), "s")
    reader.preflight()
    (chunk,) = list(reader.chunks(100))
    assert chunk.rows_in == 5
    assert [r[:2] for r in chunk.rows] == [(0, "a"), (4, "b")]
    assert [(e.row, e.error_type) for e in chunk.errors] == [
        (1, "invalid_json"),
        (2, "invalid_utf8"),
        (3, "invalid_json"),
    ]
    assert "line 2: not valid JSON" in chunk.errors[0].message
    assert "quarantined" in chunk.errors[0].message


def test_rows_without_an_id_column_get_partition_and_row_number(tmp_path):
    write_parquet(tmp_path / "s.parquet", {"text": ["x", "y"]})
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.parquet"), id_column=None), "s")
    (chunk,) = list(reader.chunks(10))
    assert [r[1] for r in chunk.rows] == ["s:0", "s:1"]


def test_openai_batch_lines_map_to_the_task_and_reject_other_urls(tmp_path):
    def request(custom_id, url, body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    write_jsonl(
        tmp_path / "b.jsonl",
        [
            request(
                "c1",
                "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            ),
            request("c2", "/v1/embeddings", {"model": "m", "input": "x"}),
            request("c3", "/v1/images/generations", {"prompt": "cat"}),
            request("c4", "/v1/chat/completions", {"model": "m"}),
        ],
    )
    spec = make_spec(str(tmp_path / "{partition_key}.jsonl"), task="chat", format="openai_batch")
    (chunk,) = list(ShardReader(spec, "b").chunks(10))
    assert chunk.rows == [(0, "c1", [{"role": "user", "content": "hi"}])]
    assert [(e.id, e.error_type) for e in chunk.errors] == [
        ("c2", "unsupported_url"),
        ("c3", "unsupported_url"),
        ("c4", "invalid_request"),
    ]
    assert "/v1/images/generations" in chunk.errors[1].message


def test_missing_shard_fails_fast_naming_the_file(tmp_path):
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.parquet")), "nope")
    with pytest.raises(ShardError, match=r"nope\.parquet.*does not exist"):
        reader.preflight()


def test_missing_text_column_fails_fast_naming_the_column(tmp_path):
    write_parquet(tmp_path / "s.parquet", {"id": ["1"], "body": ["x"]})
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.parquet")), "s")
    with pytest.raises(ShardError, match=r"no column 'text' \(columns: id, body\)"):
        reader.preflight()


def test_missing_column_in_jsonl_is_found_from_the_first_row(tmp_path):
    write_jsonl(tmp_path / "s.jsonl", [{"id": "1", "prompt": "x"}])
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.jsonl")), "s")
    with pytest.raises(ShardError, match="no column 'text'"):
        reader.preflight()


def test_corrupt_parquet_fails_fast(tmp_path):
    (tmp_path / "s.parquet").write_bytes(b"PAR1 not really")
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.parquet")), "s")
    with pytest.raises(ShardError, match="not a readable Parquet file"):
        reader.preflight()


def test_jsonl_is_streamed_not_loaded_whole(tmp_path):
    lines = [{"id": str(i), "text": "x" * 100} for i in range(30_000)]
    write_jsonl(tmp_path / "big.jsonl", lines)
    reader = ShardReader(make_spec(str(tmp_path / "{partition_key}.jsonl")), "big")
    chunks = reader.chunks(1000)
    first = next(chunks)
    assert first.rows_in == 1000 and first.rows[-1][1] == "999"
    assert sum(c.rows_in for c in chunks) == 29_000
    assert json.loads((tmp_path / "big.jsonl").read_text().splitlines()[-1])["id"] == "29999"
