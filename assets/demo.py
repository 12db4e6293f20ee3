"""`make demo`: prepare inputs and models, materialize every partition of both reference
pipelines through Dagster, and print a summary read back from the Dagster instance.

Runs are real Dagster runs on the instance in `DAGSTER_HOME` (the Makefile sets
`.dagster_home`), so `dagster dev` shows them afterwards. Each run covers as many partitions
as the asset's backfill policy allows (the model loads once per run). A second demo finds
every partition committed and finishes in seconds without loading a model.

The terminal gets a short view: a line per run and partition, then the summary table.
Everything else (Dagster's DEBUG events, the worker's vLLM warnings) goes to the log file
named at the start, `<data dir>/demo.log`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

import dagster as dg

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def partition_batches(keys: list[str], per_run: int | None) -> list[list[str]]:
    per_run = per_run or len(keys)
    return [keys[i : i + per_run] for i in range(0, len(keys), per_run)]


@contextlib.contextmanager
def output_to_log(log_path: str) -> Iterator[TextIO]:
    """Send this process's stdout and stderr (and so its worker subprocesses') to `log_path`;
    yields a stream to the terminal for the short view."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        terminal.close()


def materialize_all(
    defs: dg.Definitions,
    job_name: str,
    asset_def: dg.AssetsDefinition,
    instance: dg.DagsterInstance,
    terminal: TextIO = sys.stdout,
    log_path: str = "",
) -> None:
    job = defs.resolve_job_def(job_name)
    keys = job.partitions_def.get_partition_keys()
    policy = asset_def.backfill_policy
    for batch in partition_batches(keys, policy.max_partitions_per_run if policy else None):
        started = time.perf_counter()
        print(
            f"{job_name}: {len(batch)} partition(s) {batch[0]}...{batch[-1]} ...",
            end="",
            flush=True,
            file=terminal,
        )
        result = job.execute_in_process(
            instance=instance,
            tags={RANGE_START: batch[0], RANGE_END: batch[-1]},
            raise_on_error=False,
        )
        status = "ok" if result.success else "FAILED"
        print(
            f" {status} in {time.perf_counter() - started:.0f}s (run {result.run_id[:8]})",
            file=terminal,
        )
        for key in batch:
            print(f"    {key}: {partition_line(instance, asset_def.key, key)}", file=terminal)
        if not result.success:
            raise SystemExit(f"demo run of {job_name} failed; see {log_path or 'the log'}")


def partition_line(instance: dg.DagsterInstance, asset_key: dg.AssetKey, key: str) -> str:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[key]), limit=1
    ).records
    if not records:
        return "not materialized"
    md = {k: v.value for k, v in records[0].asset_materialization.metadata.items()}
    line = f"{md['rows_out']} rows, {md['rows_errored']} quarantined"
    if md.get("rows_invalid_output"):
        line += f", {md['rows_invalid_output']} invalid outputs"
    return line + ("" if md["computed_in_this_run"] else " (already committed)")


def summary_rows(instance: dg.DagsterInstance, asset_key: dg.AssetKey) -> list[list[str]]:
    rows = []
    partitions = sorted(instance.get_materialized_partitions(asset_key))
    for key in partitions:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[key]), limit=1
        ).records
        materialization = records[0].asset_materialization
        md = {k: v.value for k, v in materialization.metadata.items()}
        rows.append(
            [
                asset_key.to_user_string(),
                key,
                str(md["rows_out"]),
                str(md["rows_errored"]),
                rate(md["rows_per_second"]),
                rate(md["tokens_per_second"]),
                f"{md['model_load_seconds']:.1f}",
                "yes" if md["computed_in_this_run"] else "reused",
                str(md["output_path"]),
            ]
        )
    return rows


def rate(value: object) -> str:
    """A rate from partition metadata: a number, or `n/a` (no active span, e.g. resumed)."""
    return f"{value:.0f}" if isinstance(value, (int, float)) else str(value)


def print_table(rows: list[list[str]]) -> None:
    header = [
        "asset",
        "partition",
        "rows",
        "errors",
        "rows/s",
        "tokens/s",
        "load s",
        "computed",
        "output",
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def main() -> None:
    from assets import prepare
    from assets.paths import data_dir

    if not os.environ.get("DAGSTER_HOME"):
        sys.exit("set DAGSTER_HOME (make demo sets it to .dagster_home) so runs are kept")
    data_dir().mkdir(parents=True, exist_ok=True)
    log_path = str(data_dir() / "demo.log")
    print(f"Dagster events and vLLM warnings go to {log_path}", flush=True)
    with output_to_log(log_path) as terminal:
        prepare.main()
        print("inputs and models ready", file=terminal)
        from assets.definitions import JOBS, PIPELINES, defs

        instance = dg.DagsterInstance.get()
        for name, pipeline in PIPELINES.items():
            materialize_all(
                defs, JOBS[name].name, pipeline.output_asset, instance, terminal, log_path
            )
    rows = []
    for pipeline in PIPELINES.values():
        rows.extend(summary_rows(instance, pipeline.output_asset.key))
    print()
    print_table(rows)
    expected = sum(
        len(p.output_asset.partitions_def.get_partition_keys()) for p in PIPELINES.values()
    )
    if len(rows) != expected:
        raise SystemExit(f"expected {expected} materialized partitions, found {len(rows)}")
    print(f"\nall {expected} partitions materialized; open the UI with `make dev`")


if __name__ == "__main__":
    main()
