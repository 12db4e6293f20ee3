"""Control-plane scale: how long Dagster-side work takes at real dataset sizes. No model runs.

    python -m bench.control_plane                 # the issue's sizes
    python -m bench.control_plane --partitions 20000 --backfill 2000 --files 2000   # quicker

Measures, on a fresh SQLite instance in a temporary DAGSTER_HOME:

1. Defining an inference asset over N static partitions: `inference_assets(...)`, building
   `Definitions`, resolving the asset graph and the job, listing the keys, and the
   repository snapshot a code server sends to the webserver.
2. The same over N dynamic partitions: registering them in the instance, listing them.
3. Planning a backfill of B partitions as the UI does: the GraphQL `launchPartitionBackfill`
   mutation, then one backfill daemon iteration that plans and submits ceil(B/K) runs (the
   run launcher records runs instead of executing them).
4. One arrival-sensor tick over F new files on a loopback S3 server (moto): the sensor
   evaluation, which must fit Dagster's 60 s sensor timeout, and the sensor daemon acting on
   it (registering F partitions, creating the backfill).

Prints one line per measurement; `--json PATH` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.context import BenchContext

RESULTS: dict[str, float | int] = {}
UNITS: dict[str, str] = {}  # measurement -> "s" for timings
PER_RUN = 4  # default_backfill_policy: partitions per run


def timed(name: str, fn: Callable[[], Any], note: str = "") -> Any:
    started = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - started
    RESULTS[name] = round(seconds, 3)
    UNITS[name] = "s"
    print(f"{name:<58} {seconds:8.2f} s  {note}", flush=True)
    return value


def record(name: str, value: int | float, unit: str = "") -> None:
    RESULTS[name] = value
    print(f"{name:<58} {value:>8} {unit}", flush=True)


# --------------------------------------------------------------------------- 1, 2


def bench_definitions(n: int) -> None:
    import dagster as dg
    from dagster._core.remote_representation.external_data import RepositorySnap

    from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets

    keys = [f"shard-{i:06d}" for i in range(n)]

    def define():
        pipeline = inference_assets(
            name="big_embeddings",
            model="/models/minilm",
            task="embed",
            input=InputSpec(uri="s3://bucket/in/{partition_key}.parquet"),
            output_root="s3://bucket/out",
            partitions_def=dg.StaticPartitionsDefinition(keys),
        )
        job = dg.define_asset_job("embed_all", selection=[pipeline.output_asset.key])
        return dg.Definitions(
            assets=pipeline.assets, jobs=[job], resources={"gpu": GpuInferenceResource()}
        )

    defs = timed(f"define asset + Definitions, {n:,} static partitions", define)
    timed("resolve asset graph and job", lambda: defs.resolve_job_def("embed_all"))
    timed(
        "list partition keys",
        lambda: defs.resolve_assets_def("big_embeddings").partitions_def.get_partition_keys(),
    )
    repo = defs.get_repository_def()
    timed("repository snapshot (what the code server sends)", lambda: RepositorySnap.from_def(repo))


def bench_dynamic(instance, n: int) -> None:
    keys = [f"file-{i:06d}" for i in range(n)]

    def register():
        for start in range(0, n, 10_000):
            instance.add_dynamic_partitions("bench_files", keys[start : start + 10_000])

    timed(f"register {n:,} dynamic partitions (SQLite)", register)
    listed = timed("list them", lambda: instance.get_dynamic_partitions("bench_files"))
    assert len(listed) == n


# --------------------------------------------------------------------------- 3, 4: daemons

DEFS_SOURCE = textwrap.dedent(
    """
    import os
    import dagster as dg
    from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
    from dagster_gpuinfer.sensors import arrival_sensor

    pipeline = inference_assets(
        name="bench_embeddings",
        model="/models/minilm",
        task="embed",
        input=InputSpec(uri=os.environ["BENCH_INPUT_URI"]),
        output_root="/tmp/bench-out",
        partitions_def=dg.DynamicPartitionsDefinition(name="bench_arrivals"),
    )
    endpoint = os.environ.get("BENCH_S3_ENDPOINT")
    defs = dg.Definitions(
        assets=pipeline.assets,
        sensors=[arrival_sensor(pipeline, default_status=dg.DefaultSensorStatus.RUNNING,
                                max_new_files_per_tick=int(os.environ["BENCH_FILES"]))],
        resources={"gpu": GpuInferenceResource(
            s3_endpoint_url=endpoint, s3_region="us-east-1", s3_allow_http=True)},
    )
    """
)


@contextmanager
def workspace(instance, defs_file: Path):
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.test_utils import (
        InProcessTestWorkspaceLoadTarget,
        create_test_daemon_workspace_context,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    origin = InProcessCodeLocationOrigin(
        LoadableTargetOrigin(python_file=str(defs_file), attribute="defs"),
        location_name="bench",
    )
    with create_test_daemon_workspace_context(
        InProcessTestWorkspaceLoadTarget(origin), instance
    ) as context:
        yield context


def drain(results) -> None:
    for error in results:
        if error is not None and hasattr(error, "to_string"):
            raise RuntimeError(error.to_string())


def load_bench_defs():
    from importlib import util

    spec = util.spec_from_file_location("bench_defs_eval", os.environ["BENCH_DEFS_FILE"])
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.defs


def launch_ui_backfill(context, keys: list[str]) -> str:
    from dagster_graphql.client.query import LAUNCH_PARTITION_BACKFILL_MUTATION
    from dagster_graphql.test.utils import execute_dagster_graphql

    result = execute_dagster_graphql(
        context.create_request_context(),
        LAUNCH_PARTITION_BACKFILL_MUTATION,
        variables={
            "backfillParams": {
                "partitionNames": keys,
                "assetSelection": [{"path": ["bench_embeddings"]}],
            }
        },
    )
    data = result.data["launchPartitionBackfill"]
    assert data["__typename"] == "LaunchBackfillSuccess", data
    return data["backfillId"]


def bench_backfill(instance, context, b: int, submit_sample: int) -> None:
    """The UI path at full size; the daemon's planning at full size; run submission (storage
    bound) on a sample, since it costs the same per run whatever the backfill's size."""
    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView
    from dagster._core.execution.asset_backfill import execute_asset_backfill_iteration_inner
    from dagster._core.execution.backfill import BulkActionStatus
    from dagster._core.storage.dagster_run import RunsFilter
    from dagster._core.storage.tags import BACKFILL_ID_TAG
    from dagster._daemon.backfill import execute_backfill_iteration

    keys = [f"bf-{i:06d}" for i in range(b)]
    instance.add_dynamic_partitions("bench_arrivals", keys)
    backfill_id = timed(
        f"UI backfill of {b:,} partitions (GraphQL mutation)",
        lambda: launch_ui_backfill(context, keys),
    )
    backfill = instance.get_backfill(backfill_id)
    defs = load_bench_defs()
    logger = logging.getLogger("bench")

    def plan():
        return execute_asset_backfill_iteration_inner(
            backfill_id,
            backfill.asset_backfill_data,
            AssetGraphView.for_test(defs, instance),
            backfill.backfill_timestamp,
            logger,
            None,
        )

    planned = timed(f"backfill daemon planning: {b:,} partitions into runs", plan)
    record(
        "runs planned",
        len(planned.run_requests),
        f"(ceil({b}/{PER_RUN}) = {math.ceil(b / PER_RUN)})",
    )
    # Cancel it: submitting 2,500 runs is measured per run on a sample below.
    instance.update_backfill(backfill.with_status(BulkActionStatus.CANCELED))

    sample = keys[:submit_sample]
    sample_id = launch_ui_backfill(context, sample)
    timed(
        f"backfill daemon: plan + submit a {len(sample)}-partition backfill",
        lambda: drain(execute_backfill_iteration(context, logger)),
    )
    runs = instance.get_runs_count(filters=RunsFilter(tags={BACKFILL_ID_TAG: sample_id}))
    per_run = RESULTS[f"backfill daemon: plan + submit a {len(sample)}-partition backfill"] / max(
        runs, 1
    )
    record("runs submitted", runs, f"({per_run:.3f} s per run on this instance's storage)")
    RESULTS["submit_seconds_per_run"] = round(per_run, 4)


def bench_sensor(instance, context, files: int, endpoint: str, bucket: str) -> None:
    import boto3
    import dagster as dg
    from dagster._core.execution.backfill import BulkActionsFilter
    from dagster._daemon.sensor import execute_sensor_iteration

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def upload():
        with ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda i: client.put_object(
                        Bucket=bucket,
                        Key=f"landing/day-{i // 1000:02d}/part-{i:06d}.jsonl",
                        Body=b'{"id": "x", "text": "y"}\n',
                    ),
                    range(files),
                )
            )

    timed(f"upload {files:,} files to the loopback S3 (setup, not sensor)", upload)
    # The evaluation alone, as the code server runs it under the 60 s timeout.
    defs = load_bench_defs()
    sensor = defs.resolve_sensor_def("bench_embeddings_arrivals")

    def evaluate():
        ctx = dg.build_sensor_context(instance=instance, resources={"gpu": defs.resources["gpu"]})
        return sensor(ctx)

    result = timed(f"sensor evaluation over {files:,} new files (limit 60 s)", evaluate)
    added = sum(len(r.partition_keys) for r in result.dynamic_partitions_requests)
    record("partitions requested by that tick", added)
    backfills_before = len(instance.get_backfills(filters=BulkActionsFilter()))
    logger = logging.getLogger("bench")
    timed(
        "sensor daemon tick: evaluate, register partitions, create backfill",
        lambda: drain(execute_sensor_iteration(context, logger, None, None)),
    )
    record("partitions registered", len(instance.get_dynamic_partitions("bench_arrivals")))
    record(
        "backfills created",
        len(instance.get_backfills(filters=BulkActionsFilter())) - backfills_before,
    )


SMOKE_SIZES = {"partitions": 500, "backfill": 40, "files": 40, "submit_sample": 8}
FULL_SIZES = {"partitions": 100_000, "backfill": 10_000, "files": 10_000, "submit_sample": 200}


def run_control_plane(ctx: BenchContext) -> dict[str, Any]:
    """The `control-plane` section of `python -m bench`: the issue's sizes, or tiny ones."""
    sizes = SMOKE_SIZES if ctx.smoke else FULL_SIZES
    measured = measure(work_dir=ctx.fresh_dir("control-plane"), **sizes)
    rows = [
        {"measurement": name, "value": f"{value:.2f} s" if UNITS.get(name) == "s" else value}
        for name, value in measured.items()
        if name != "submit_seconds_per_run"
    ]
    return {"sizes": sizes, "rows": rows, "values": measured}


def measure(
    *, partitions: int, backfill: int, files: int, submit_sample: int, work_dir: Path | None = None
) -> dict[str, float | int]:
    """Every measurement of this module, on fresh instances; returns name -> value."""
    RESULTS.clear()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "DAGSTER_DISABLE_TELEMETRY": "yes",
        }
    )
    import warnings

    warnings.filterwarnings("ignore")
    import boto3
    import dagster as dg
    from moto.server import ThreadedMotoServer

    print(f"control plane at scale (python {sys.version.split()[0]}, {os.cpu_count()} cpus)\n")
    bench_definitions(partitions)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="bench-landing"
        )
        with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
            defs_file = Path(tmp) / "bench_defs.py"
            defs_file.write_text(DEFS_SOURCE)
            os.environ.update(
                {
                    "BENCH_INPUT_URI": "s3://bench-landing/landing/{partition_key}.jsonl",
                    "BENCH_S3_ENDPOINT": endpoint,
                    "BENCH_FILES": str(files),
                    "BENCH_DEFS_FILE": str(defs_file),
                }
            )
            launcher = {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}
            for home in ("backfill", "sensor"):
                (Path(tmp) / home).mkdir()
            with dg.instance_for_test(
                overrides={"run_launcher": launcher}, temp_dir=str(Path(tmp) / "backfill")
            ) as instance:
                print()
                bench_dynamic(instance, partitions)
                with workspace(instance, defs_file) as context:
                    print()
                    bench_backfill(instance, context, backfill, submit_sample)
            with dg.instance_for_test(
                overrides={"run_launcher": launcher}, temp_dir=str(Path(tmp) / "sensor")
            ) as instance:
                with workspace(instance, defs_file) as context:
                    print()
                    bench_sensor(instance, context, files, endpoint, "bench-landing")
    finally:
        server.stop()
    return dict(RESULTS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane")
    parser.add_argument("--partitions", type=int, default=FULL_SIZES["partitions"])
    parser.add_argument("--backfill", type=int, default=FULL_SIZES["backfill"])
    parser.add_argument("--files", type=int, default=FULL_SIZES["files"])
    parser.add_argument(
        "--submit-sample",
        type=int,
        default=FULL_SIZES["submit_sample"],
        help="partitions of the backfill whose runs are really submitted (storage bound)",
    )
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    parser.add_argument(
        "--scale",
        help="instead: dynamic partitions at these sizes, e.g. 10000,100000 "
        "(bench/partition_scale.py: registration, UI backfill, partition page, sensor ticks)",
    )
    args = parser.parse_args(argv)
    if args.scale:
        from bench.partition_scale import measure_scale, scan_pairs

        sizes = [int(size) for size in args.scale.split(",")]
        rows = measure_scale(sizes)
        pairs = scan_pairs(sizes, rounds=3)
        if args.json:
            command = "python -m bench.control_plane " + " ".join(argv or sys.argv[1:])
            Path(args.json).write_text(
                json.dumps({"command": command, "rows": rows, "our_scan_paired": pairs}, indent=2)
            )
        return 0
    measured = measure(
        partitions=args.partitions,
        backfill=args.backfill,
        files=args.files,
        submit_sample=args.submit_sample,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
