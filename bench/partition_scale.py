"""Dynamic partitions at scale: the control plane at N = 10,000 and 100,000 partitions.

    python -m bench.control_plane --scale 10000,100000 --json bench/results/...json

For each N, on a fresh SQLite instance with the arrival-sensor pipeline of
`bench.control_plane` watching a local folder:

1. registering N dynamic partitions;
2. a UI backfill of all N through the GraphQL `launchPartitionBackfill` mutation, and the
   backfill daemon's planning of it into runs;
3. the asset's partition page: the GraphQL queries the UI sends for it (partition health:
   keys and statuses; partition stats; the first page of keys), with 1,000 partitions
   materialized;
4. sensor ticks with N partitions registered and N + 100 files in the folder (100 new):
   the sensor's evaluation, and the sensor daemon's tick that registers the 100 and creates
   their backfill.

Each step runs once untimed by a profiler (the figure), then again under cProfile to split
its time into the project's code (`dagster_gpuinfer`, with what it calls outside Dagster:
pyarrow listing, the standard library) and the rest (Dagster, GraphQL, SQLite). The
project's share should grow with N no faster than N: `ours_us_per_partition` is compared
across sizes.
"""

from __future__ import annotations

import cProfile
import logging
import os
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OURS = f"{os.sep}dagster_gpuinfer{os.sep}"
DAGSTER = (f"{os.sep}dagster{os.sep}", f"{os.sep}dagster_graphql{os.sep}")
MATERIALIZED = 1_000
NEW_FILES = 100

PARTITION_HEALTH_QUERY = """
query PartitionHealthQuery($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) {
    ... on AssetNode {
      id
      partitionKeysByDimension { name type partitionKeys }
      assetPartitionStatuses {
        ... on DefaultPartitionStatuses {
          materializedPartitions materializingPartitions failedPartitions
        }
      }
    }
  }
}
"""
PARTITION_STATS_QUERY = """
query AssetPartitionStats($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) {
    ... on AssetNode {
      id
      partitionStats { numMaterialized numMaterializing numFailed numPartitions }
    }
  }
}
"""
PARTITION_PAGE_QUERY = """
query AssetPartitionKeys($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) {
    ... on AssetNode {
      id
      partitionKeyConnection(limit: 100, ascending: false) { results hasMore cursor }
    }
  }
}
"""


def ours_seconds(profile: cProfile.Profile) -> float:
    """Seconds in the project's code and what it calls outside Dagster: the time of the calls
    into its code from elsewhere, less that of its calls into Dagster (per call edge)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    inside = outside = 0.0
    for (filename, _line, _name), (_cc, _nc, _tt, cumulative, callers) in stats.items():
        if OURS in filename:
            if not callers:
                inside += cumulative
            inside += sum(edge[3] for caller, edge in callers.items() if OURS not in caller[0])
        elif any(part in filename for part in DAGSTER):
            outside += sum(edge[3] for caller, edge in callers.items() if OURS in caller[0])
    return max(inside - outside, 0.0)


def step(
    rows: list[dict[str, Any]], n: int, name: str, fn: Callable[[], Any], repeat: bool = True
) -> Any:
    """Time `fn` plainly, then once more under cProfile for the project's share; a step that
    cannot run twice (`repeat=False`) runs once, under cProfile, and that is its figure."""
    value = None
    if repeat:
        started = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - started
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    profiled_value = fn()
    profile.disable()
    profiled = time.perf_counter() - started
    if not repeat:
        value, seconds = profiled_value, profiled
    ours = ours_seconds(profile)
    row = {
        "partitions": n,
        "step": name,
        "seconds": round(seconds, 3),
        "seconds_profiled": round(profiled, 3),
        "ours_seconds_profiled": round(ours, 4),
        "ours_us_per_partition": round(ours / n * 1e6, 3),
    }
    rows.append(row)
    print(
        f"{n:>7,}  {name:<52} {seconds:8.2f} s   ours {ours:7.3f} s "
        f"({row['ours_us_per_partition']:.2f} us/partition)",
        flush=True,
    )
    return value


def graphql(context: Any, query: str) -> dict[str, Any]:
    from dagster_graphql.test.utils import execute_dagster_graphql

    result = execute_dagster_graphql(
        context.create_request_context(), query, variables={"assetKey": {"path": [ASSET]}}
    )
    assert not result.errors, result.errors
    node = result.data["assetNodeOrError"]
    assert node.get("id"), node
    return node


ASSET = "bench_embeddings"


def backfill_steps(rows: list[dict[str, Any]], instance: Any, context: Any, keys: list[str]):
    """Registration, the UI's backfill mutation and the daemon's planning of it."""
    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView
    from dagster._core.execution.asset_backfill import execute_asset_backfill_iteration_inner
    from dagster._core.execution.backfill import BulkActionStatus

    from bench.control_plane import launch_ui_backfill, load_bench_defs

    n = len(keys)

    def register() -> None:
        for start in range(0, n, 10_000):
            instance.add_dynamic_partitions("bench_arrivals", keys[start : start + 10_000])

    step(rows, n, f"register {n:,} dynamic partitions", register, repeat=False)
    backfill_id = step(
        rows,
        n,
        f"UI backfill of {n:,} (GraphQL mutation)",
        lambda: launch_ui_backfill(context, keys),
    )
    backfill = instance.get_backfill(backfill_id)
    defs = load_bench_defs()

    def plan() -> Any:
        return execute_asset_backfill_iteration_inner(
            backfill_id,
            backfill.asset_backfill_data,
            AssetGraphView.for_test(defs, instance),
            backfill.backfill_timestamp,
            logging.getLogger("bench"),
            None,
        )

    planned = step(rows, n, "backfill daemon planning it into runs", plan)
    rows[-1]["runs_planned"] = len(planned.run_requests)
    for each in instance.get_backfills():
        instance.update_backfill(each.with_status(BulkActionStatus.CANCELED))


def page_steps(rows: list[dict[str, Any]], instance: Any, context: Any, keys: list[str]):
    """The asset's partition page, with the first `MATERIALIZED` partitions materialized."""
    import dagster as dg

    n = len(keys)
    materialized_count = min(MATERIALIZED, n)
    for key in keys[:materialized_count]:
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=ASSET, partition=key))
    health = step(
        rows,
        n,
        "partition page: health (keys + statuses)",
        lambda: graphql(context, PARTITION_HEALTH_QUERY),
    )
    assert len(health["partitionKeysByDimension"][0]["partitionKeys"]) == n
    materialized = health["assetPartitionStatuses"]["materializedPartitions"]
    assert len(materialized) == materialized_count, len(materialized)
    stats = step(
        rows, n, "partition page: partition stats", lambda: graphql(context, PARTITION_STATS_QUERY)
    )
    assert stats["partitionStats"]["numPartitions"] == n, stats
    page = step(
        rows, n, "partition page: last 100 keys", lambda: graphql(context, PARTITION_PAGE_QUERY)
    )
    assert len(page["partitionKeyConnection"]["results"]) == 100


def sensor_steps(rows: list[dict[str, Any]], instance: Any, context: Any, landing: Path, n: int):
    """A tick over N registered files and `NEW_FILES` new ones: evaluation, then the
    daemon's tick (registers the new ones, creates their backfill)."""
    import dagster as dg
    from dagster._daemon.sensor import execute_sensor_iteration

    from bench.control_plane import drain, load_bench_defs

    for i in range(NEW_FILES):
        (landing / f"new-{i:04d}.jsonl").write_bytes(b'{"id": "x", "text": "y"}\n')
    defs = load_bench_defs()
    sensor = defs.resolve_sensor_def(f"{ASSET}_arrivals")

    def evaluate() -> Any:
        ctx = dg.build_sensor_context(instance=instance, resources={"gpu": defs.resources["gpu"]})
        return sensor(ctx)

    result = step(rows, n, f"sensor evaluation: {n + NEW_FILES:,} files, {NEW_FILES} new", evaluate)
    assert sum(len(r.partition_keys) for r in result.dynamic_partitions_requests) == NEW_FILES
    step(
        rows,
        n,
        f"sensor daemon tick: register the {NEW_FILES}, create backfill",
        lambda: drain(execute_sensor_iteration(context, logging.getLogger("bench"), None, None)),
        repeat=False,
    )
    registered = len(instance.get_dynamic_partitions("bench_arrivals"))
    assert registered == n + NEW_FILES, registered


def scale_at(n: int, work_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Every step at N partitions, on a fresh instance under `work_dir`."""
    import dagster as dg

    from bench.control_plane import DEFS_SOURCE, workspace

    keys = [f"bf-{i:06d}" for i in range(n)]
    landing = work_dir / "landing"
    landing.mkdir(parents=True)
    (work_dir / "home").mkdir()
    for key in keys:
        (landing / f"{key}.jsonl").write_bytes(b'{"id": "x", "text": "y"}\n')
    defs_file = work_dir / "bench_defs.py"
    defs_file.write_text(DEFS_SOURCE)
    os.environ.pop("BENCH_S3_ENDPOINT", None)
    os.environ.update(
        {
            "BENCH_INPUT_URI": str(landing) + "/{partition_key}.jsonl",
            "BENCH_FILES": "10000",
            "BENCH_DEFS_FILE": str(defs_file),
        }
    )
    launcher = {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}
    with dg.instance_for_test(
        overrides={"run_launcher": launcher}, temp_dir=str(work_dir / "home")
    ) as instance:
        with workspace(instance, defs_file) as context:
            # Untimed: the first request builds the GraphQL schema and loads the workspace.
            graphql(context, PARTITION_STATS_QUERY)
            backfill_steps(rows, instance, context, keys)
            page_steps(rows, instance, context, keys)
            sensor_steps(rows, instance, context, landing, n)


def scan_pairs(sizes: list[int], rounds: int, work_dir: Path | None = None) -> list[dict]:
    """The project's own arrival path alone (the known-key set from N registered keys, the
    listing of N + 100 local files, the scan for the 100 new), sizes alternating within
    each round so a busy spell on the machine falls on all of them: per-file cost at each
    size, paired."""
    from dagster_gpuinfer.arrivals import WatchedFiles, registered_file_keys, scan_arrivals
    from dagster_gpuinfer.listing import PrefixListing

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        folders = {}
        for n in sizes:
            keys = [f"bf-{i:06d}" for i in range(n)]
            landing = Path(tmp) / str(n)
            landing.mkdir()
            for name in [*keys, *(f"new-{i:04d}" for i in range(NEW_FILES))]:
                (landing / f"{name}.jsonl").write_bytes(b"{}\n")
            folders[n] = (landing, keys)
        for round_index in range(rounds):
            for n, (landing, keys) in folders.items():
                started = time.perf_counter()
                known = registered_file_keys(keys)
                watched = WatchedFiles(str(landing) + "/{partition_key}.jsonl")
                scan = scan_arrivals(
                    PrefixListing(watched.prefix),
                    watched,
                    start_after="",
                    is_known=known.__contains__,
                    max_new_files=10_000,
                    max_listed=1_000_000,
                )
                seconds = time.perf_counter() - started
                assert len(scan.new_files) == NEW_FILES and scan.listed == n + NEW_FILES
                rows.append({"round": round_index, "partitions": n, "seconds": round(seconds, 3)})
                rows[-1]["us_per_file"] = round(seconds / (n + NEW_FILES) * 1e6, 1)
                print(
                    f"round {round_index}  {n:>7,}  our arrival scan alone  {seconds:7.2f} s  "
                    f"{rows[-1]['us_per_file']:.1f} us/file",
                    flush=True,
                )
    return rows


def measure_scale(sizes: list[int], work_dir: Path | None = None) -> list[dict[str, Any]]:
    """`scale_at` for each size, in order; one row per step and size."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["DAGSTER_DISABLE_TELEMETRY"] = "yes"
    rows: list[dict[str, Any]] = []
    for n in sizes:
        with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
            scale_at(n, Path(tmp), rows)
    return rows


def sensor_pairs(sizes: list[int], rounds: int, work_dir: Path | None = None) -> list[dict]:
    """The arrival sensor's whole evaluation (Dagster's read of the registered keys
    included) with N registered and N + 100 files, one instance per size, sizes alternating
    within each round; Dagster's `get_dynamic_partitions` alone timed beside it."""
    import contextlib

    import dagster as dg

    from bench.control_plane import DEFS_SOURCE, load_bench_defs

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp, contextlib.ExitStack() as stack:
        setups = {}
        for n in sizes:
            folder = Path(tmp) / str(n)
            (folder / "landing").mkdir(parents=True)
            keys = [f"bf-{i:06d}" for i in range(n)]
            for name in [*keys, *(f"new-{i:04d}" for i in range(NEW_FILES))]:
                (folder / "landing" / f"{name}.jsonl").write_bytes(b"{}\n")
            (folder / "defs.py").write_text(DEFS_SOURCE)
            os.environ.pop("BENCH_S3_ENDPOINT", None)
            os.environ.update(
                BENCH_INPUT_URI=f"{folder}/landing/{{partition_key}}.jsonl",
                BENCH_FILES="10000",
                BENCH_DEFS_FILE=str(folder / "defs.py"),
            )
            instance = stack.enter_context(dg.instance_for_test(temp_dir=str(folder)))
            instance.add_dynamic_partitions("bench_arrivals", keys)
            defs = load_bench_defs()
            setups[n] = (instance, defs, defs.resolve_sensor_def(f"{ASSET}_arrivals"))
        for round_index in range(rounds):
            for n, (instance, defs, sensor) in setups.items():
                started = time.perf_counter()
                instance.get_dynamic_partitions("bench_arrivals")
                read = time.perf_counter() - started
                context = dg.build_sensor_context(
                    instance=instance, resources={"gpu": defs.resources["gpu"]}
                )
                started = time.perf_counter()
                result = sensor(context)
                seconds = time.perf_counter() - started
                assert len(result.dynamic_partitions_requests[0].partition_keys) == NEW_FILES
                row = {"round": round_index, "partitions": n, "seconds": round(seconds, 3)}
                row.update(dagster_read_seconds=round(read, 3), us_per_partition=seconds / n * 1e6)
                rows.append(row)
                print(
                    f"round {round_index} {n:>7,}  sensor evaluation {seconds:6.2f} s "
                    f"({row['us_per_partition']:.1f} us/partition); Dagster's read of the "
                    f"registered keys alone {read:.2f} s",
                    flush=True,
                )
    return rows
