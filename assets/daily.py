"""A daily time-partitioned pipeline: each day's notes land in one file named by the date.

`<input root>/daily_notes/2026-11-29.jsonl` is partition `2026-11-29` of `daily_note_embeddings`.
The schedule, built by `build_schedule_from_partitioned_job`, runs at 02:00 UTC and
materializes the day that just ended; older days are backfilled from the UI (several days
per run, one model load per run, by the default backfill policy).

`python -m assets.daily 2026-11-27 2026-11-29` writes example input files for those days.
"""

from __future__ import annotations

import json
import random
import sys
from datetime import date, timedelta
from pathlib import Path

import dagster as dg

from assets.paths import embedding_model_dir, input_root, output_root
from dagster_gpuinfer import EngineArgs, InputSpec, inference_assets

DAILY_START = "2026-11-01"
DAILY_NOTES = dg.DailyPartitionsDefinition(start_date=DAILY_START, timezone="UTC")

daily_note_embeddings = inference_assets(
    name="daily_note_embeddings",
    model=embedding_model_dir(),
    task="embed",
    input=InputSpec(uri=f"{input_root()}/daily_notes/{{partition_key}}.jsonl", id_column="id"),
    input_asset_key="daily_notes",
    output_root=output_root(),
    partitions_def=DAILY_NOTES,
    engine=EngineArgs(dtype="float32"),
    chunk_size=256,
    group_name="daily",
    description="all-MiniLM-L6-v2 embeddings of each day's notes, one partition per day",
)

daily_embeddings_job = dg.define_asset_job(
    "embed_daily_notes",
    selection=[daily_note_embeddings.output_asset.key],
    partitions_def=DAILY_NOTES,
)

# Runs at 02:00 UTC for the partition of the day that ended two hours before.
daily_embeddings_schedule = dg.build_schedule_from_partitioned_job(
    daily_embeddings_job,
    hour_of_day=2,
    minute_of_hour=0,
    description="Embed yesterday's notes every night at 02:00 UTC",
)


def write_daily_notes(days: list[str], *, rows: int = 50, seed: int = 3) -> list[str]:
    """Write `<input root>/daily_notes/<day>.jsonl` for each day (existing files are kept)."""
    directory = Path(input_root()) / "daily_notes"
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for day in days:
        path = directory / f"{date.fromisoformat(day).isoformat()}.jsonl"
        if path.exists():
            continue
        rng = random.Random(f"{seed}-{day}")
        lines = [
            json.dumps(
                {
                    "id": f"{day}-{i:04d}",
                    "text": f"Note {i} of {day}: "
                    f"{rng.choice(['sunny', 'rainy', 'windy'])} day, "
                    f"{rng.randint(1, 40)} visitors, {rng.choice(['calm', 'busy'])} shift.",
                }
            )
            for i in range(rows)
        ]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(path)
        written.append(str(path))
    return written


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m assets.daily FIRST_DAY LAST_DAY  (dates as YYYY-MM-DD)")
    first, last = (date.fromisoformat(a) for a in argv)
    days = [(first + timedelta(d)).isoformat() for d in range((last - first).days + 1)]
    print(f"wrote {len(write_daily_notes(days))} daily note file(s) under {input_root()}")


if __name__ == "__main__":
    main(sys.argv[1:])
