"""`arrival_sensor`: new files under a prefix become dynamic partitions, and get processed.

Each tick lists the pipeline's input prefix (a local directory or `s3://bucket/prefix`) from
where the last tick stopped, registers every new input file as a partition of the
pipeline's `DynamicPartitionsDefinition` (or several partitions, one per row or byte range,
for a large file), and requests their processing: by default one backfill per tick, which
Dagster's backfill daemon splits into runs by the asset's backfill policy, so K files share
one model load.

Idempotent by construction: a file is new only if no partition of it is registered in the
Dagster instance, so no file is registered twice, even after a crash between a tick and its
cursor. The cursor only says where the listing goes on: a tick stops after
`max_new_files_per_tick` new files (or `max_files_listed_per_tick` listed) and the next tick
pages on from there; at the end of the listing the next tick starts over from the beginning,
so a file that landed behind the listing position during a tick is found on the next pass.

Scale (bench/control_plane.py, 2 CPU cores, moto S3 on loopback; bench/results/RESULTS.md):
evaluating a tick over 10,000 new files takes about 5.4 s, inside Dagster's 60 s sensor
timeout. The sensor daemon then registers the partitions, checking each key on its own, so
the whole tick of 10,000 files took about 34.6 s there on SQLite; lower
`max_new_files_per_tick` on a SQLite instance if ticks must stay short. With 100,000
partitions registered, a tick lists the whole prefix and reads every registered key: 2.6 s
of evaluation for 100 new files among 100,100 on local disk, the same per file as at 10,000
(`python -m bench.control_plane --scale 10000,100000`, bench/README.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Literal

import dagster as dg

from dagster_gpuinfer.arrivals import (
    SplitLargeFiles,
    WatchedFiles,
    plan_partition_keys,
    registered_file_keys,
    scan_arrivals,
)
from dagster_gpuinfer.asset_factory import InferencePipeline
from dagster_gpuinfer.aws import gpu_settings_from_s3_resource
from dagster_gpuinfer.listing import PrefixListing
from dagster_gpuinfer.spec import InputSpec, StorageOptions

ARRIVAL_SENSOR_TAG = "dagster-gpuinfer/arrival_sensor"
CURSOR_VERSION = 1


def parse_cursor(raw: str | None) -> dict[str, Any]:
    """The sensor's cursor; an empty or unreadable one starts the listing from the beginning
    (safe: registered files are never registered again)."""
    default = {"v": CURSOR_VERSION, "start_after": "", "passes": 0}
    if not raw:
        return default
    try:
        cursor = json.loads(raw)
    except ValueError:
        return default
    if not isinstance(cursor, dict) or cursor.get("v") != CURSOR_VERSION:
        return default
    return {**default, **cursor}


def _watched_input(pipeline: InferencePipeline) -> InputSpec:
    """The pipeline's input, when it is files a sensor can watch.

    Raises:
        ValueError: the input is a table (a Delta table scan).
    """
    input_spec = InputSpec.model_validate(pipeline.spec["input"])
    if input_spec.is_table():
        raise ValueError(
            f"pipeline {pipeline.output_asset.key.to_user_string()!r} reads a Delta table, "
            "which has no files to watch: list its partitions with "
            "storage.delta.partition_values (and observe the input asset for new versions)"
        )
    return input_spec


def arrival_sensor(
    pipeline: InferencePipeline,
    *,
    name: str | None = None,
    glob: str = "*",
    split: SplitLargeFiles | None = None,
    launch: Literal["backfill", "runs"] = "backfill",
    max_new_files_per_tick: int = 10_000,
    max_files_listed_per_tick: int = 200_000,
    keys_arrive_in_order: bool = False,
    storage: StorageOptions | None = None,
    resource_key: str = "gpu",
    s3_resource_key: str | None = None,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    run_tags: Mapping[str, str] | None = None,
    description: str | None = None,
) -> dg.SensorDefinition:
    """A sensor that registers new input files of `pipeline` as partitions and processes them.

    Args:
        pipeline: From `inference_assets(...)` with a `DynamicPartitionsDefinition`; its input
            uri template says where files land (`s3://bkt/in/{partition_key}.jsonl`).
        name: Sensor name; defaults to `<output asset>_arrivals`.
        glob: `fnmatch` pattern on the file name after the prefix, e.g. `2026-*/*.jsonl`.
        split: Split files at least `split.min_bytes` large into row or byte ranges.
        launch: `backfill` (one backfill per tick; runs of K partitions by the asset's backfill
            policy, the model loads once per run) or `runs` (one run per partition).
        max_new_files_per_tick: New files registered per tick; more wait for the next tick.
        max_files_listed_per_tick: Files listed per tick, new or not.
        keys_arrive_in_order: New files always sort after older ones (date-stamped names):
            each tick lists only after the newest file seen instead of passing over the
            whole prefix again.
        storage: S3 endpoint and region; defaults to those of the `GpuInferenceResource`.
        resource_key: Key of the pipeline's `GpuInferenceResource`.
        s3_resource_key: Key of a `dagster_aws.s3.S3Resource` to list S3 with; otherwise a
            boto3 client with the standard AWS credential chain is used.
        minimum_interval_seconds, default_status, description: passed to `dagster.sensor`.
        run_tags: Tags for the backfill or runs it requests.

    Returns:
        The sensor definition: add it to `dagster.Definitions(sensors=[...])`.

    Raises:
        ValueError: the pipeline's partitions are not dynamic, or its input uri cannot be
            watched.
    """
    partitions_def = dynamic_partitions_of(pipeline)
    if max_new_files_per_tick < 1 or max_files_listed_per_tick < 1:
        raise ValueError("max_new_files_per_tick and max_files_listed_per_tick must be positive")
    input_spec = _watched_input(pipeline)
    watched = WatchedFiles(uri_template=input_spec.uri, glob=glob)
    input_format = input_spec.resolved_format()
    output_key = pipeline.output_asset.key
    sensor_name = name or f"{output_key.to_python_identifier()}_arrivals"
    tags = {ARRIVAL_SENSOR_TAG: sensor_name, **(run_tags or {})}
    required = {resource_key} | ({s3_resource_key} if s3_resource_key else set())

    @dg.sensor(
        name=sensor_name,
        asset_selection=dg.AssetSelection.assets(output_key),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys=required,
        description=description
        or f"Registers new files at {watched.prefix}{glob} as partitions of "
        f"{output_key.to_user_string()} and processes them",
    )
    def _arrival_sensor(context: dg.SensorEvaluationContext, **_resources: Any) -> dg.SensorResult:
        # `**_resources`: invoking a sensor directly (tests) passes its resources as keywords.
        started = time.perf_counter()
        cursor = parse_cursor(context.cursor)
        known = registered_file_keys(
            context.instance.get_dynamic_partitions(partitions_def.name)  # type: ignore[arg-type]
        )
        lister = prefix_lister(context, watched.prefix, storage, resource_key, s3_resource_key)
        scan = scan_arrivals(
            lister,
            watched,
            start_after=cursor["start_after"],
            is_known=known.__contains__,
            max_new_files=max_new_files_per_tick,
            max_listed=max_files_listed_per_tick,
            keys_arrive_in_order=keys_arrive_in_order,
        )
        keys = plan_partition_keys(scan.new_files, watched, input_format, split, lister)
        next_cursor = _next_cursor(cursor, scan)
        for file_name, reason in scan.rejected:
            context.log.warning(f"skipped {watched.prefix}{file_name}: {reason}")
        summary = _scan_summary(scan, cursor["start_after"], time.perf_counter() - started, keys)
        context.log.info(summary)
        if not keys:
            return dg.SensorResult(skip_reason=summary, cursor=next_cursor)
        run_requests = arrival_requests(launch, sensor_name, output_key, partitions_def, keys, tags)
        return dg.SensorResult(
            run_requests=run_requests,
            dynamic_partitions_requests=[partitions_def.build_add_request(keys)],
            cursor=next_cursor,
        )

    return _arrival_sensor


def dynamic_partitions_of(pipeline: InferencePipeline) -> dg.DynamicPartitionsDefinition:
    """The pipeline's named dynamic partitions, which an arrival sensor adds to."""
    partitions_def = pipeline.output_asset.partitions_def
    if not isinstance(partitions_def, dg.DynamicPartitionsDefinition) or not partitions_def.name:
        raise ValueError(
            f"arrival_sensor needs a pipeline partitioned by a named "
            f"dg.DynamicPartitionsDefinition; {pipeline.output_asset.key.to_user_string()} has "
            f"{type(partitions_def).__name__}. Use partitions_def="
            "dg.DynamicPartitionsDefinition(name=...) in inference_assets"
        )
    return partitions_def


def prefix_lister(
    context: dg.SensorEvaluationContext,
    prefix: str,
    storage: StorageOptions | None,
    resource_key: str,
    s3_resource_key: str | None,
) -> PrefixListing:
    """The listing of the watched prefix, through the S3 resource when one is named."""
    if not s3_resource_key:
        options = storage or getattr(context.resources, resource_key).storage_options()
        return PrefixListing(prefix, options)
    # An S3Resource bound by `required_resource_keys` arrives as the resource or as its
    # boto3 client: list with that client, read footers with its endpoint and keys.
    s3 = getattr(context.resources, s3_resource_key)
    if hasattr(type(s3), "get_client"):
        settings = gpu_settings_from_s3_resource(s3)
        options = StorageOptions(
            endpoint_url=settings["s3_endpoint_url"],
            region=settings["s3_region"],
            allow_http=settings["s3_allow_http"],
        )
        return PrefixListing(prefix, options, client=s3.get_client(), credentials=settings["env"])
    endpoint = s3.meta.endpoint_url
    options = StorageOptions(
        endpoint_url=None if endpoint.endswith(".amazonaws.com") else endpoint,
        region=s3.meta.region_name,
        allow_http=endpoint.startswith("http://"),
    )
    return PrefixListing(prefix, options, client=s3)


def _next_cursor(cursor: Mapping[str, Any], scan: Any) -> str:
    return json.dumps(
        {
            "v": CURSOR_VERSION,
            "start_after": scan.next_start_after,
            "passes": cursor["passes"] + int(scan.reached_end),
        }
    )


def arrival_requests(
    launch: str,
    sensor_name: str,
    output_key: dg.AssetKey,
    partitions_def: dg.DynamicPartitionsDefinition,
    keys: list[str],
    tags: Mapping[str, str],
) -> list[Any]:
    """One backfill of the new partitions, or one run per partition."""
    if launch == "backfill":
        return [backfill_request(output_key, partitions_def, keys, tags)]
    return [
        dg.RunRequest(
            run_key=f"{sensor_name}:{key}",
            partition_key=key,
            asset_selection=[output_key],
            tags=tags,
        )
        for key in keys
    ]


def _scan_summary(scan: Any, start_after: Any, seconds: float, keys: list[str]) -> str:
    """One line on what a tick listed and found."""
    more = "" if scan.reached_end else f"; the next tick goes on after {scan.next_start_after!r}"
    return (
        f"listed {scan.listed} file(s) after {start_after!r} in {seconds:.2f}s: "
        f"{len(scan.new_files)} new, {len(keys)} partition(s){more}"
    )


def backfill_request(
    asset_key: dg.AssetKey,
    partitions_def: dg.PartitionsDefinition,
    partition_keys: list[str],
    tags: Mapping[str, str],
) -> dg.RunRequest:
    """A run request the sensor daemon turns into a backfill of `partition_keys` of one asset.

    The backfill daemon then launches runs as the asset's backfill policy says (multi-run:
    ceil(N / K) runs), which is what a backfill launched from the UI does.
    """
    # Dagster's own declarative automation builds backfills from sensors this way; the
    # constructor is public, AssetGraphSubset is not (pinned dagster==1.13.27).
    from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset

    subset = AssetGraphSubset(
        partitions_subsets_by_asset_key={
            asset_key: partitions_def.subset_with_partition_keys(partition_keys)
        },
        non_partitioned_asset_keys=set(),
    )
    return dg.RunRequest.for_asset_graph_subset(asset_graph_subset=subset, tags=dict(tags))
