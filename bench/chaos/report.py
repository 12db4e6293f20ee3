"""The chaos run's summary: faults by kind, retries, partitions, rows lost and duplicated,
wall time against the same backfill without faults."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

from bench.chaos import store_faults
from bench.chaos.faults import KINDS, POOL_KINDS, Fault


def verdict(phase: Any) -> list[str]:
    """What is wrong with a phase (empty: every partition committed, 0 lost, 0 duplicated,
    no process left)."""
    wrong = []
    if phase.committed != phase.asked:
        wrong.append(f"{phase.asked - phase.committed} of {phase.asked} partitions not committed")
    for name in ("lost", "duplicated", "unexpected"):
        if getattr(phase, name):
            wrong.append(f"{getattr(phase, name)} rows {name}")
    if phase.leftover_processes:
        wrong.append(f"processes left: {phase.leftover_processes}")
    if phase.backfill_status != "COMPLETED_SUCCESS":  # S3 complete, Dagster's record not
        wrong.append(f"backfill {phase.backfill_status}: {phase.runs_failed} run(s) failed")
    return wrong + store_faults.verdict(phase) + phase.problems


def faults_table(schedule: list[Fault], phase: Any) -> list[str]:
    planned = Counter(f.kind for f in schedule)
    done = Counter(i.fault.kind for i in phase.injected)
    skipped = Counter(f.kind for f in phase.skipped)
    lines = ["| fault | scheduled | injected | skipped |", "|---|---:|---:|---:|"]
    for kind in (*KINDS, *POOL_KINDS):
        if planned[kind]:
            lines.append(f"| {kind} | {planned[kind]} | {done[kind]} | {skipped[kind]} |")
    lines.append(f"| **all** | {len(schedule)} | {len(phase.injected)} | {len(phase.skipped)} |")
    return lines


def summary_table(baseline: Any | None, chaos: Any) -> list[str]:
    phases = [p for p in (baseline, chaos) if p is not None]
    rows = [
        ("wall time (s)", lambda p: f"{p.wall_s:.0f}"),
        ("partitions committed / asked", lambda p: f"{p.committed} / {p.asked}"),
        ("rows in / out / errored", lambda p: f"{p.rows_in} / {p.rows_out} / {p.rows_errored}"),
        ("rows lost", lambda p: str(p.lost)),
        ("rows duplicated", lambda p: str(p.duplicated)),
        ("runs (not succeeded)", lambda p: f"{p.runs} ({p.runs_failed})"),
        ("run retries (daemon)", lambda p: str(p.run_retries)),
        ("step retries (RetryPolicy)", lambda p: str(p.step_retries)),
        ("pods (OOM step-down relaunches)", lambda p: f"{p.pods} ({p.step_down_pods})"),
        ("backfill status", lambda p: p.backfill_status),
        *store_faults.summary_rows(),
        ("processes left", lambda p: str(len(p.leftover_processes))),
    ]
    extra = [name for p in phases for name in getattr(p, "extra", {})]  # pool mode's rows
    rows += [(n, lambda p, n=n: p.extra.get(n, "")) for n in dict.fromkeys(extra)]
    lines = ["| | " + " | ".join(p.label for p in phases) + " |"]
    lines.append("|---|" + "---:|" * len(phases))
    lines += [f"| {name} | " + " | ".join(cell(p) for p in phases) + " |" for name, cell in rows]
    if baseline is not None and baseline.wall_s:
        lines.append(f"| wall time chaos / baseline | | {chaos.wall_s / baseline.wall_s:.2f} |")
    return lines


def write(results: Path, options: Any, schedule: list[Fault], baseline: Any, chaos: Any) -> str:
    """RESULTS.md and results.json under `results`; returns the markdown."""
    results.mkdir(parents=True, exist_ok=True)
    injected = [
        f"- {i.at:6.1f} s (planned {i.fault.at:.1f}) {i.fault.kind} -> {i.target}"
        + (f": {i.note}" if i.note else "")
        + (f" ({i.fault.seconds} s at {i.fault.rate:.0%})" if i.fault.rate else "")
        for i in chaos.injected
    ]
    hits = ", ".join(f"{k} {v}" for k, v in sorted(chaos.proxy_hits.items())) or "none"
    wrong = verdict(chaos) + (verdict(baseline) if baseline else [])
    text = "\n".join(
        [
            f"# Chaos backfill, seed {options.seed}",
            "",
            f"`{options.command}`",
            "",
            *summary_table(baseline, chaos),
            "",
            *faults_table(schedule, chaos),
            "",
            f"S3 requests hit by the proxy: {hits}.",
            "",
            "Faults as injected:",
            *injected,
            "",
            "Verdict: "
            + (
                "PASS (0 lost, 0 duplicated, all committed, no process left)"
                if not wrong
                else "FAIL: " + "; ".join(wrong)
            ),
            "",
        ]
    )
    (results / "RESULTS.md").write_text(text)
    record = {
        "options": {k: v for k, v in vars(options).items() if k != "command"},
        "command": options.command,
        "schedule": [dataclasses.asdict(f) for f in schedule],
        "phases": [_phase_json(p) for p in (baseline, chaos) if p is not None],
    }
    (results / "results.json").write_text(json.dumps(record, indent=1, default=str))
    return text


def _phase_json(phase: Any) -> dict[str, Any]:
    data = dataclasses.asdict(phase)
    data["injected"] = [dataclasses.asdict(i) for i in phase.injected]
    return data
