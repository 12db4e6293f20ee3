"""`make demo` leaves an input file for every partition of every reference pipeline, so
"Materialize all" in the UI can run each of them (no engine needed to check that)."""

from __future__ import annotations

from datetime import date

import pytest


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUINFER_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("GPUINFER_INPUT_ROOT", raising=False)
    return tmp_path


def test_every_daily_partition_up_to_today_has_its_input(data_dir):
    from assets.daily import DAILY_NOTES, write_daily_notes
    from assets.prepare import daily_note_days

    write_daily_notes(daily_note_days())
    keys = DAILY_NOTES.get_partition_keys()
    assert keys, "the daily partitions definition has no partitions"
    missing = [k for k in keys if not (data_dir / "inputs" / "daily_notes" / f"{k}.jsonl").exists()]
    assert missing == []


def test_daily_days_run_from_the_start_to_the_given_day():
    from assets.prepare import daily_note_days

    days = daily_note_days(date(2026, 11, 3))
    assert days == ["2026-11-01", "2026-11-02", "2026-11-03"]


def test_request_pipelines_inputs_cover_their_partitions(data_dir):
    import json

    import pyarrow.parquet as pq

    from assets.prepare import write_rerank_shards, write_ticket_shards
    from assets.request_pipelines import RERANK_SHARDS, TICKET_SHARDS, TicketFields
    from dagster_gpuinfer.worker.tasks.openai_batch import BatchRequestLine

    write_ticket_shards()
    write_rerank_shards()
    for key in TICKET_SHARDS.get_partition_keys():
        table = pq.read_table(data_dir / "inputs" / "ticket_texts" / f"{key}.parquet")
        assert table.num_rows > 0 and set(table.column_names) == {"ticket_id", "prompt"}
    for key in RERANK_SHARDS.get_partition_keys():
        lines = (data_dir / "inputs" / "rerank" / f"{key}.jsonl").read_text().splitlines()
        for line in lines:
            request = BatchRequestLine.model_validate(json.loads(line))
            assert request.url == "/v1/rerank" and len(request.body["documents"]) == 5
    assert TicketFields.model_json_schema()["required"] == ["product", "urgency", "summary"]
