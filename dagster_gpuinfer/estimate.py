"""Estimate a backfill before launching it: GPU-hours and wall time of the partitions not yet
committed, from their input sizes and the speed measured on the partitions already committed.

    python -m dagster_gpuinfer.estimate doc_embeddings [-m assets.definitions] [--pool-slots 4]

The formula (docs/observability.md, "Estimating a backfill"):

- work of a partition: its rows for Parquet input (read from the file's footer, no data
  read), its bytes for JSONL/OpenAI Batch input (the file's size; a `@rows=` part of a
  JSONL file gets its share of the file's bytes). A `@bytes=` or `@rows=` range counts
  only its part.
- speed: the work of the committed partitions over their `wall_seconds` (from their
  manifests: read, infer, write; one worker pod), i.e. work units per pod-second, leaving
  out partitions that resumed or copied rows (their time covers part of their work). Before
  any partition is committed: `DEFAULT_ROWS_PER_SECOND` or `DEFAULT_BYTES_PER_SECOND`.
- row reuse: a pending partition whose earlier output is still there (its shard changed)
  computes only its new and changed rows. Where its shard is a whole Parquet or JSONL file
  of at most `MAX_REUSE_READ_BYTES`, the estimate reads it, digests each row as the worker
  does and counts only the rows whose digest the earlier output lacks (`reuse_counts`;
  its share of the partition's work); other such partitions it counts in full (an upper
  bound). The summary says which (`partitions_reusable`, `partitions_reuse_counted`).
- runs: the pending partitions in groups of the backfill policy's `max_partitions_per_run`
  (K); each run pays one model load (mean `model_load_seconds` of the committed
  partitions, else `DEFAULT_MODEL_LOAD_SECONDS`) and a worker start
  (`DEFAULT_RUN_START_SECONDS`).
- run seconds = start + load + sum(work / speed) over its partitions;
  GPU-hours = sum(run seconds) x GPUs per pod (tensor_parallel_size x replicas) / 3600;
  wall time = the runs spread over the pool's pod slots (the Dagster pool limit: one slot
  per pod), in backfill order, each to the slot that frees first. Time queued behind Kueue is
  not in it.

On an engine pool (`launch="pool"`) the runs pay no model load each: the pending partitions
are spread over the pool's workers (`max_workers`), each a slot; a worker that is already
up and warm (idle or busy in the queue's worker reports) starts at once, every other one
pays one worker start and one model load first. GPU-hours add each worker's idle TTL after
its last partition (a pool worker holds its GPUs until it exits).

The same numbers reach the UI through `backfill_estimate_sensor`, which records them as an
observation of the output asset.
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import json
import logging
import os
import posixpath
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import dagster as dg
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import InferenceSpec, split_partition_key
from dagster_gpuinfer.storage import (
    adapter_versions,
    committed_manifests,
    filesystem_for,
    model_version,
    partition_dir,
    read_manifest,
)
from dagster_gpuinfer.storage.digests import (
    INPUT_DIGEST_COLUMN,
    LINES,
    REUSE_KEY_COLUMN,
    columns_digests,
    digest_columns_of,
    line_digest,
    reuse_scope_of,
)
from dagster_gpuinfer.task_table import task_facts

DEFAULT_ROWS_PER_SECOND = 100.0
DEFAULT_BYTES_PER_SECOND = 20_000.0
DEFAULT_MODEL_LOAD_SECONDS = 120.0
DEFAULT_RUN_START_SECONDS = 30.0
# Shard bytes one estimate reads, in all, to count the rows row reuse copies (the sensor
# runs it on every tick): partitions past it are counted in full.
MAX_REUSE_READ_BYTES = 256 * 2**20
SPEC_METADATA_KEY = "gpuinfer/spec"
LAUNCH_METADATA_KEY = "gpuinfer/launch"
log = logging.getLogger("dagster_gpuinfer")
WARM_STATES = frozenset({"idle", "busy"})  # a pool worker whose engine is built


@dataclass
class BackfillEstimate:
    """What the partitions not yet committed will cost."""

    asset: str
    work_unit: str  # rows or bytes
    partitions: int
    partitions_committed: int
    partitions_pending: int
    pending_work: float
    missing_inputs: list[str]
    speed_per_pod_second: float
    speed_source: str
    model_load_seconds: float
    run_start_seconds: float
    partitions_per_run: int
    runs: int
    gpus_per_pod: int
    pool_slots: int
    gpu_hours: float
    wall_seconds: float
    run_seconds: list[float] = field(default_factory=list)
    launch: str = "run"
    # Pending partitions whose earlier output is still there (their shard changed since):
    # with row reuse on, only their changed rows are computed. In `partitions_reuse_counted`
    # of them the estimate read the shard and counted those rows by input digest
    # (`reuse_counts`): `reuse_rows_to_compute` of their `reuse_rows`, the work it counts;
    # the others it counts in full (an upper bound) and says so.
    partitions_reusable: int = 0
    partitions_reuse_counted: int = 0
    reuse_rows: int = 0
    reuse_rows_to_compute: int = 0
    engine_builds: int = 0  # model loads the estimate counts (runs, or cold pool workers)
    warm_workers: int = 0  # pool workers found warm (launch="pool")

    def summary(self) -> str:
        if not self.partitions_pending:
            return f"{self.asset}: all {self.partitions} partitions are committed; nothing to run"
        missing = (
            f"; {len(self.missing_inputs)} input(s) missing, not counted"
            if self.missing_inputs
            else ""
        )
        if self.launch == "pool":
            shape = (
                f"on an engine pool of {self.pool_slots} worker(s), {self.warm_workers} warm, "
                f"{self.engine_builds} model load(s) ({self.model_load_seconds:.0f} s each)"
            )
        else:
            shape = (
                f"{self.runs} run(s) of up to {self.partitions_per_run} partitions, each "
                f"loading the model ({self.model_load_seconds:.0f} s)"
            )
        missing += self._reuse_summary()
        return (
            f"{self.asset}: {self.partitions_pending} of {self.partitions} partitions pending, "
            f"{self.pending_work:,.0f} {self.work_unit}{missing}. At "
            f"{self.speed_per_pod_second:,.1f} {self.work_unit}/s per pod ({self.speed_source}), "
            f"{shape}: {self.gpu_hours:.2f} GPU-hours on "
            f"{self.gpus_per_pod} GPU(s) per pod; wall time {format_seconds(self.wall_seconds)} "
            f"with {self.pool_slots} pod(s) at a time ({self.pool_slots * self.gpus_per_pod} GPUs)."
        )

    def _reuse_summary(self) -> str:
        if not self.partitions_reusable:
            return ""
        text = (
            f"; {self.partitions_reusable} of them have an earlier output whose unchanged "
            "rows row reuse copies"
        )
        if self.partitions_reuse_counted:
            text += (
                f": in {self.partitions_reuse_counted}, {self.reuse_rows_to_compute:,} of "
                f"{self.reuse_rows:,} rows are new or changed (counted by input digest), "
                "and only those are counted"
            )
        rest = self.partitions_reusable - self.partitions_reuse_counted
        if rest:
            text += (
                f"{',' if self.partitions_reuse_counted else ':'} {rest} counted in full "
                "(inputs not read: too large, images, ranges, tables, or no input digests), "
                "an upper bound"
            )
        return text

    def metadata(self) -> dict[str, Any]:
        """The estimate as Dagster metadata (numbers the UI can chart)."""
        return {
            "estimate_pending_partitions": self.partitions_pending,
            "estimate_committed_partitions": self.partitions_committed,
            "estimate_gpu_hours": round(self.gpu_hours, 3),
            "estimate_wall_hours": round(self.wall_seconds / 3600, 3),
            f"estimate_pending_{self.work_unit}": int(self.pending_work),
            f"estimate_{self.work_unit}_per_pod_second": round(self.speed_per_pod_second, 2),
            "estimate_speed_source": self.speed_source,
            "estimate_pool_slots": self.pool_slots,
            "estimate_gpus_per_pod": self.gpus_per_pod,
            "estimate_runs": self.runs,
            "estimate_launch": self.launch,
            "estimate_engine_builds": self.engine_builds,
            "estimate_missing_inputs": len(self.missing_inputs),
            "estimate_partitions_reusable": self.partitions_reusable,
            "estimate_partitions_reuse_counted": self.partitions_reuse_counted,
            "estimate_reuse_rows_to_compute": self.reuse_rows_to_compute,
            "estimate_summary": self.summary(),
        }


def format_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# --------------------------------------------------------------------------- input sizes


def work_unit(spec: InferenceSpec) -> str:
    return "rows" if spec.input.resolved_format() in ("parquet", "delta") else "bytes"


def _table_partition_size(spec: InferenceSpec, file_key: str) -> tuple[float, float] | None:
    """(rows, bytes) of a Delta table's partition, from its log (no data file is read);
    None when the table or the partition is not there."""
    from dagster_gpuinfer.storage.delta import table_partition

    try:
        found = table_partition(
            spec.input.uri, spec.storage, spec.input.partition_column or "", file_key
        )
    except FileNotFoundError:
        return None
    return float(found.rows), float(sum(found.sizes))


def input_work(spec: InferenceSpec, partition_keys: Sequence[str]) -> dict[str, float | None]:
    """Each partition's work (rows or bytes, see `work_unit`); None when its input is missing.

    Reads Parquet footers and file sizes only, never the data.
    """
    unit = work_unit(spec)
    by_file: dict[str, list[str]] = defaultdict(list)
    for key in partition_keys:
        by_file[split_partition_key(key)[0]].append(key)
    work: dict[str, float | None] = {}
    for file_key, keys in by_file.items():
        rows: float | None = None
        if spec.input.is_table():
            found = _table_partition_size(spec, file_key)
            if found is None:
                work.update({key: None for key in keys})
                continue
            rows, size = found
        else:
            fs, path = filesystem_for(spec.input.shard_uri(file_key), spec.storage)
            info = fs.get_file_info(path)
            if info.type != pafs.FileType.File:
                work.update({key: None for key in keys})
                continue
            size = float(info.size or 0)
            if unit == "rows":
                with fs.open_input_file(path) as handle:
                    rows = float(pq.ParquetFile(handle).metadata.num_rows)
        row_ranges = [r for k in keys if (r := split_partition_key(k)[1]) and r.unit == "rows"]
        rows_seen = max((r.end for r in row_ranges), default=0)
        for key in keys:
            part = split_partition_key(key)[1]
            if unit == "rows":
                assert rows is not None
                if part is None:
                    work[key] = rows
                elif part.unit == "rows":
                    work[key] = float(max(0, min(part.end, rows) - part.start))
                else:  # bytes of a Parquet file: its share of the rows
                    work[key] = rows * max(0.0, min(part.end, size) - part.start) / max(size, 1.0)
            elif part is None:
                work[key] = size
            elif part.unit == "bytes":
                work[key] = float(max(0.0, min(part.end, size) - part.start))
            else:  # rows of a JSONL file: its share of the bytes the file's ranges cover
                work[key] = size * (part.end - part.start) / max(rows_seen, 1)
    return work


# --------------------------------------------------------------------------- the estimate


@dataclass
class ReuseCount:
    """What row reuse will copy in the pending partitions (see `reuse_counts`)."""

    partitions: int = 0  # pending partitions with an earlier committed output
    counted: int = 0  # of them, those whose changed rows were counted by input digest
    rows: int = 0  # the counted partitions' rows
    rows_to_compute: int = 0  # of those, rows no earlier output row has the digest of
    fractions: dict[str, float] = field(default_factory=dict)  # counted: share to compute


def reuse_counts(spec: InferenceSpec, pending: Sequence[str]) -> ReuseCount:
    """Which rows of the `pending` partitions row reuse will copy: for each with an earlier
    committed output (`row_reuse` not off; one manifest read), whose keyed parts (Parquet
    parts, or an `openai_batch` output's reuse files: `Manifest.keyed_parts`)
    record input digests under this spec's reuse scope and the model files as they are now,
    and whose shard is a whole Parquet or JSONL file (`MAX_REUSE_READ_BYTES` in all):
    the shard's rows are digested as the worker does (`storage.digests`: the columns the
    worker reads, or the line) and those whose digest no earlier keyed row has are the
    rows to compute. Exact but for two cases, both counted as computed (an upper bound):
    a JSONL line changed only in its `custom_id`, and in-run duplicates. Image rows (their
    bytes lie behind references), Delta tables and ranges of a file are counted in full."""
    count = ReuseCount()
    budget = [MAX_REUSE_READ_BYTES]  # shard bytes left to read
    if spec.row_reuse == "off":
        return count
    try:
        now = (model_version(spec), adapter_versions(spec))
    except FileNotFoundError:  # not visible here (a pod's cache): taken as recorded, as
        now = None  # `committed_manifests` does; the worker checks them
    for key in pending:
        fs, path = filesystem_for(partition_dir(spec.output, key), spec.storage)
        try:
            manifest = read_manifest(fs, path)
        except (OSError, ValueError):
            continue
        if manifest is None:
            continue
        count.partitions += 1
        if now is not None and (manifest.source.model, manifest.source.adapters) != now:
            continue  # new model files: every key changes, every row is computed
        try:
            found = _rows_to_compute(spec, key, fs, path, manifest, budget)
        except (OSError, ValueError) as exc:
            log.info("estimate: %s counted in full (%s)", key, exc)
            continue
        if found is not None:
            count.counted += 1
            count.rows += found[1]
            count.rows_to_compute += found[0]
            count.fractions[key] = found[0] / found[1] if found[1] else 0.0
    return count


def _discount_reuse(
    spec: InferenceSpec, pending: Sequence[str], work: dict[str, float | None]
) -> ReuseCount:
    """`reuse_counts`, and each counted partition's `work` cut to the share of its rows
    that row reuse will not copy."""
    reuse = reuse_counts(spec, pending)
    for key, share in reuse.fractions.items():
        amount = work.get(key)
        if amount is not None:
            work[key] = amount * share
    return reuse


def _earlier_digests(
    spec: InferenceSpec, fs: pafs.FileSystem, path: str, manifest: Any
) -> tuple[set[str], list[str] | str] | None:
    """The input digests of the earlier output's keyed rows and what they cover, or None
    when a part records none or was keyed under another reuse scope."""
    digests: set[str] = set()
    covers: list[str] | str | None = None
    for part in manifest.keyed_parts():
        if not part.name.endswith(".parquet"):
            return None
        with fs.open_input_file(posixpath.join(path, part.name)) as handle:
            parquet = pq.ParquetFile(handle)
            schema = parquet.schema_arrow
            if not {INPUT_DIGEST_COLUMN, REUSE_KEY_COLUMN} <= set(schema.names):
                return None
            if reuse_scope_of(schema.metadata) != spec.reuse_scope():
                return None
            part_covers = digest_columns_of(schema.metadata)
            if part_covers is None or covers not in (None, part_covers):
                return None
            covers = part_covers
            table = parquet.read(columns=[INPUT_DIGEST_COLUMN, REUSE_KEY_COLUMN])
        for digest, key in zip(*(c.to_pylist() for c in table.columns), strict=True):
            if digest is not None and key is not None:  # unkeyed rows are always computed
                digests.add(digest)
    return None if covers is None else (digests, covers)


def _rows_to_compute(
    spec: InferenceSpec,
    key: str,
    fs: pafs.FileSystem,
    path: str,
    manifest: Any,
    budget: list[int],
) -> tuple[int, int] | None:
    """(rows to compute, rows) of one pending partition (see `reuse_counts`), or None;
    its shard's bytes come off `budget`."""
    file_key, part = split_partition_key(key)
    if part is not None or spec.input.is_table() or task_facts(spec.task).images:
        return None
    earlier = _earlier_digests(spec, fs, path, manifest)
    if earlier is None:
        return None
    digests, covers = earlier
    in_fs, in_path = filesystem_for(spec.input.shard_uri(file_key), spec.storage)
    info = in_fs.get_file_info(in_path)
    if info.type != pafs.FileType.File or (info.size or 0) > budget[0]:
        return None
    budget[0] -= info.size or 0
    if covers == LINES:
        with in_fs.open_input_stream(in_path) as stream:
            lines = [line for line in stream.read().split(b"\n") if line.strip()]
        shard = [line_digest(line) for line in lines]
    else:
        with in_fs.open_input_file(in_path) as handle:
            parquet = pq.ParquetFile(handle)
            present = [c for c in covers if c in parquet.schema_arrow.names]
            table = parquet.read(columns=present)
        values = [
            table.column(c).to_pylist() if c in present else [None] * table.num_rows for c in covers
        ]
        shard = columns_digests(values, table.num_rows)
    return sum(1 for digest in shard if digest not in digests), len(shard)


def makespan(durations: Sequence[float], slots: int) -> float:
    """Wall time of `durations` on `slots` parallel slots: in backfill order (as the daemon
    launches runs), each to the slot that frees first."""
    if not durations:
        return 0.0
    free = [0.0] * max(1, min(slots, len(durations)))
    for duration in durations:
        heapq.heapreplace(free, free[0] + duration)
    return max(free)


def estimate_backfill(
    spec: InferenceSpec,
    partition_keys: Sequence[str],
    *,
    asset: str,
    partitions_per_run: int | None,
    pool_slots: int = 1,
    speed_per_pod_second: float | None = None,
    model_load_seconds: float | None = None,
    run_start_seconds: float = DEFAULT_RUN_START_SECONDS,
    pool: PoolShape | None = None,
) -> BackfillEstimate:
    """The estimate for `partition_keys` of the pipeline `spec` (see the module docstring).

    Args:
        spec: The pipeline's spec as the environment runs it (resource overrides applied).
        partition_keys: Every partition of the asset; the committed ones give the speed.
        asset: The asset's name, for the summary.
        partitions_per_run: The backfill policy's K; None: one run for all.
        pool_slots: Worker pods that may run at once (the Dagster pool limit).
        speed_per_pod_second: Overrides the measured speed (work units per pod-second).
        model_load_seconds: Overrides the measured model load.
        run_start_seconds: Worker start per run (process, imports, pod start).
        pool: The engine pool the partitions run on (`launch="pool"`); None: per-run launch.
    """
    unit = work_unit(spec)
    work = input_work(spec, partition_keys)
    committed = committed_manifests(spec, partition_keys)
    pending = [key for key in partition_keys if key not in committed]
    reuse = _discount_reuse(spec, pending, work)
    measured_work = 0.0
    measured_seconds = 0.0
    for key, manifest in committed.items():
        amount = work.get(key)
        if amount is None and unit == "rows":
            amount = float(manifest.rows_in)
        copied = manifest.rows_resumed or manifest.rows_reused or manifest.rows_deduplicated
        if amount is None or manifest.wall_seconds <= 0 or copied:
            continue  # input gone (bytes unknown), or resumed or reused rows (partial time)
        measured_work += amount
        measured_seconds += manifest.wall_seconds
    if speed_per_pod_second is not None:
        speed, source = speed_per_pod_second, "given"
    elif measured_seconds > 0:
        speed = measured_work / measured_seconds
        source = f"measured on {len(committed)} committed partition(s)"
    else:
        speed = DEFAULT_ROWS_PER_SECOND if unit == "rows" else DEFAULT_BYTES_PER_SECOND
        source = "default: nothing committed yet"
    loads = [m.model_load_seconds for m in committed.values() if m.model_load_seconds > 0]
    if model_load_seconds is None:
        model_load_seconds = sum(loads) / len(loads) if loads else DEFAULT_MODEL_LOAD_SECONDS
    per_run = partitions_per_run or max(1, len(pending))
    runs = [pending[i : i + per_run] for i in range(0, len(pending), per_run)]
    missing = [key for key in pending if work.get(key) is None]
    run_seconds = [
        run_start_seconds + model_load_seconds + sum((work.get(k) or 0.0) / speed for k in run)
        for run in runs
    ]
    gpus = spec.tensor_parallel_size * spec.replicas
    builds, wall = len(runs), makespan(run_seconds, pool_slots)
    gpu_seconds = sum(run_seconds)
    if pool is not None:
        seconds = [(work.get(k) or 0.0) / speed for k in pending]
        builds, wall, gpu_seconds = pool.cost(seconds, run_start_seconds + model_load_seconds)
        pool_slots = pool.max_workers
    return BackfillEstimate(
        partitions_reusable=reuse.partitions,
        partitions_reuse_counted=reuse.counted,
        reuse_rows=reuse.rows,
        reuse_rows_to_compute=reuse.rows_to_compute,
        asset=asset,
        work_unit=unit,
        partitions=len(partition_keys),
        partitions_committed=len(committed),
        partitions_pending=len(pending),
        pending_work=sum(work.get(k) or 0.0 for k in pending),
        missing_inputs=missing,
        speed_per_pod_second=speed,
        speed_source=source,
        model_load_seconds=model_load_seconds,
        run_start_seconds=run_start_seconds,
        partitions_per_run=per_run,
        runs=len(runs),
        gpus_per_pod=gpus,
        pool_slots=max(1, pool_slots),
        gpu_hours=gpu_seconds * gpus / 3600,
        wall_seconds=wall,
        run_seconds=run_seconds,
        launch="pool" if pool is not None else "run",
        engine_builds=builds,
        warm_workers=pool.warm_workers if pool is not None else 0,
    )


@dataclass(frozen=True)
class PoolShape:
    """An engine pool as the estimate sees it.

    Attributes:
        max_workers: Workers the pool may run (`PoolSettings.max_workers`).
        warm_workers: Workers up with a built engine now (idle or busy).
        idle_ttl_s: How long a worker holds its GPUs after its last partition.
    """

    max_workers: int
    warm_workers: int = 0
    idle_ttl_s: float = 0.0

    def cost(self, seconds: Sequence[float], cold_start: float) -> tuple[int, float, float]:
        """(engine builds, wall seconds, GPU-seconds) of partitions taking `seconds` each on
        this pool: each to the worker that frees first, a cold worker free after
        `cold_start` (its start and model load), a warm one at once. The reconciler starts
        a worker per partition up to `max_workers`, so every cold one counts as a build;
        the wall time is when the last partition is done."""
        workers = max(1, min(self.max_workers, len(seconds)))
        if not seconds:
            return 0, 0.0, 0.0
        warm = min(self.warm_workers, workers)
        free = [(0.0 if n < warm else cold_start, n) for n in range(workers)]
        heapq.heapify(free)
        done = 0.0
        for duration in seconds:
            at, n = free[0]
            done = max(done, at + duration)
            heapq.heapreplace(free, (at + duration, n))
        builds = workers - warm
        gpu_seconds = sum(seconds) + builds * cold_start + workers * self.idle_ttl_s
        return builds, done, gpu_seconds


# --------------------------------------------------------------------------- Dagster glue


def pool_slots_of(instance: Any, pool: str | None) -> int | None:
    """The instance's limit of `pool` (pods at a time), or None when it has none."""
    if not pool or instance is None:
        return None
    for limit in instance.event_log_storage.get_pool_limits():
        if limit.name == pool:
            return int(limit.limit)
    return None


def estimate_asset(
    assets_def: Any,
    *,
    resource: Any = None,
    instance: Any = None,
    pool_slots: int | None = None,
    **overrides: Any,
) -> BackfillEstimate:
    """`estimate_backfill` for an output asset made by `inference_assets`.

    Args:
        assets_def: The output `AssetsDefinition` (its metadata carries the spec).
        resource: The `GpuInferenceResource` the pipeline runs with (engine overrides, S3).
        instance: The Dagster instance: dynamic partitions and the pool's limit.
        pool_slots: Pods at a time; default: the pool's limit in the instance, else 1.
    """
    key = assets_def.key
    raw = assets_def.metadata_by_key[key].get(SPEC_METADATA_KEY)
    if raw is None:
        raise ValueError(
            f"asset {key.to_user_string()!r} was not made by inference_assets (its metadata "
            f"has no {SPEC_METADATA_KEY!r}); estimates cover inference output assets only"
        )
    raw = dict(getattr(raw, "data", raw))
    partitions_def = assets_def.partitions_def
    keys = list(partitions_def.get_partition_keys(dynamic_partitions_store=instance))
    spec = InferenceSpec.model_validate({**raw, "partition_keys": keys})
    if resource is not None and hasattr(resource, "prepare_spec"):
        spec = resource.prepare_spec(spec)
    policy = assets_def.backfill_policy
    per_run = getattr(policy, "max_partitions_per_run", None) if policy is not None else None
    pool = getattr(assets_def.op, "pool", None)
    slots = pool_slots or pool_slots_of(instance, pool) or 1
    launch = assets_def.metadata_by_key[key].get(LAUNCH_METADATA_KEY)
    launch = getattr(launch, "value", launch) or "run"
    if launch == "pool" and resource is not None and hasattr(resource, "pool"):
        overrides.setdefault("pool", engine_pool_shape(resource, spec))
    return estimate_backfill(
        spec,
        keys,
        asset=key.to_user_string(),
        partitions_per_run=per_run,
        pool_slots=slots,
        **overrides,
    )


def engine_pool_shape(resource: Any, spec: InferenceSpec) -> PoolShape:
    """The pool `spec` runs on, from `resource.pool` and the queue's live workers (idle or
    busy ones are warm); no warm worker when the queue cannot be read."""
    from dagster_gpuinfer.launchers.pool import job_pool_key
    from dagster_gpuinfer.pools.stores import open_lease_queue

    settings = resource.pool
    try:
        with open_lease_queue(settings.location()) as queue:
            live = queue.pool_workers(job_pool_key(spec))
    except Exception:  # noqa: BLE001 - an estimate without the queue assumes cold workers
        live = []
    warm = sum(1 for worker in live if worker.state in WARM_STATES)
    return PoolShape(settings.max_workers, warm_workers=warm, idle_ttl_s=settings.idle_ttl_s)


def backfill_estimate_sensor(
    pipeline: Any,
    *,
    resource_key: str = "gpu",
    name: str | None = None,
    minimum_interval_seconds: int = 600,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor that records the backfill estimate of `pipeline`'s output asset as an
    observation (metadata `estimate_gpu_hours`, `estimate_wall_hours`, ...), so the asset's
    page shows what the missing partitions will cost, refreshed as partitions commit.

    Returns:
        The sensor definition: add it to `dagster.Definitions(sensors=[...])`.
    """
    output = pipeline.output_asset
    sensor_name = name or f"{output.key.to_python_identifier()}_backfill_estimate"

    @dg.sensor(
        name=sensor_name,
        minimum_interval_seconds=minimum_interval_seconds,
        required_resource_keys={resource_key},
        default_status=default_status,
        description=f"Records what backfilling the missing partitions of "
        f"{output.key.to_user_string()} will cost (GPU-hours, wall time).",
    )
    def _estimate_sensor(context: dg.SensorEvaluationContext, **_resources: Any) -> dg.SensorResult:
        # `**_resources`: invoking a sensor directly (tests) passes its resources as keywords.
        resource = getattr(context.resources, resource_key)
        estimate = estimate_asset(output, resource=resource, instance=context.instance)
        digest = json.dumps(estimate.metadata(), sort_keys=True)
        if digest == context.cursor:
            return dg.SensorResult(skip_reason="estimate unchanged", cursor=digest)
        return dg.SensorResult(
            asset_events=[dg.AssetObservation(asset_key=output.key, metadata=estimate.metadata())],
            cursor=digest,
        )

    return _estimate_sensor


def load_definitions(module: str, attribute: str) -> Any:
    sys.path.insert(0, ".")
    loaded = getattr(importlib.import_module(module), attribute)
    return loaded() if callable(loaded) else loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dagster_gpuinfer.estimate",
        description="Estimate GPU-hours and wall time of the partitions not yet committed.",
    )
    parser.add_argument("asset", help="output asset key, e.g. doc_embeddings or prefix/name")
    parser.add_argument(
        "-m",
        "--module",
        default="assets.definitions",
        help="module holding the Definitions (default: assets.definitions)",
    )
    parser.add_argument("-a", "--attribute", default="defs", help="Definitions attribute")
    parser.add_argument(
        "--pool-slots",
        type=int,
        default=None,
        help="worker pods at a time (default: the pool's limit, else 1)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=None,
        help="rows (Parquet) or bytes (JSONL) per pod-second, instead of measured",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = parser.parse_args(argv)

    from dagster_gpuinfer.resource import GpuInferenceResource

    defs = load_definitions(args.module, args.attribute)
    key = dg.AssetKey.from_user_string(args.asset)
    assets_def = defs.resolve_assets_def(key)
    resource_key = next(iter(assets_def.required_resource_keys), "gpu")
    resource = (defs.resources or {}).get(resource_key)
    if not isinstance(resource, GpuInferenceResource):
        resource = None
    instance = (
        dg.DagsterInstance.get()
        if os.environ.get("DAGSTER_HOME")
        else dg.DagsterInstance.ephemeral()
    )
    with instance:
        estimate = estimate_asset(
            assets_def,
            resource=resource,
            instance=instance,
            pool_slots=args.pool_slots,
            speed_per_pod_second=args.speed,
        )
    if args.json:
        print(json.dumps(asdict(estimate), indent=2))
    else:
        print(estimate.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
