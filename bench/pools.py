"""Benchmark: engine pools (issue 37): `launch="pool"` against per-run launch.

Every part runs real Dagster runs of `inference_assets` pipelines (`bench/platform_run.py`)
on the small embed model, one lease queue (a SQLite file) for the whole section, pool
workers started by the steps' reconciler as local subprocesses:

- `arrivals` (a): N single-partition runs arriving one after another on a pool (the first
  one builds the engine), end to end, against ONE run of all N partitions with per-run
  launch (one worker, one engine build). Ratio: one run's wall / the N pool runs' wall.
- `batches` (b): OpenAI batches submitted together to the batch API on a pool. Not run
  here yet: the batch API has no pool routing on this branch (see `skipped`).
- `skew` (c): a backfill of two runs whose partitions are one 8x partition and small ones,
  the two runs at once: per-run launch (a worker per run) vs a pool of 2 workers. Work is
  the sum of the partitions' engine time (manifests' `engine_seconds`); the span runs from
  the first partition's start to the last commit (engine builds before it are not in it),
  against work / 2. The 8x partition goes first, then last, in its run: a pool leases
  whole partitions, so where the big one sits decides what the pool can balance.
- `kill` (d): a pool worker is killed with SIGKILL once a partition it holds has committed
  chunks and is not finished; its lease expires, another worker finishes; every partition
  is committed and its output ids are the input ids, each once.
- `scale_to_zero` (e): after the last run, the pool's workers exit after the idle TTL: no
  pool worker listed, and no process left of any worker seen (its session included).

Engine builds are counted from the workers' load log (`GPUINFER_MODEL_LOAD_LOG`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from bench.context import KV_CACHE_BYTES, BenchContext
from bench.platform_run import PlatformPipeline, RunTiming, local_resource
from bench.workloads import embed_texts, write_shard
from dagster_gpuinfer import EngineArgs, PoolSettings
from dagster_gpuinfer.launchers.pool import RANGE_MARK
from dagster_gpuinfer.pools import open_lease_queue
from dagster_gpuinfer.storage import filesystem_for, partition_dir, read_manifest
from dagster_gpuinfer.storage.layout import Manifest
from dagster_gpuinfer.worker.loop.engine import LOAD_LOG_ENV

log = logging.getLogger("bench")

PARTS = ("arrivals", "batches", "skew", "kill", "scale_to_zero")
# The per-run launch figure this section pairs against in (a) is measured here; the older
# one-partition-per-run figure (0.04) comes from the amortization section, cited in the report.
AMORTIZATION_SOURCE = (
    "bench/results/results.json, amortization section (`python -m bench --only amortization "
    "--no-ray --amortization-partitions 16 --amortization-per-run 1,4,8,16` of "
    "2026-11-30T13:39:35): 16 runs of 1 partition 973.7 s, 1 run of 16 partitions 40.4 s: 0.04"
)


@dataclass
class PoolBench:
    """The section's shared state: its folder, model, lease queue and engine-build log."""

    ctx: BenchContext
    root: Path
    model: str
    queue: Path
    load_log: Path
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, ctx: BenchContext) -> PoolBench:
        root = ctx.fresh_dir("pools")
        return cls(
            ctx=ctx,
            root=root,
            model=ctx.embed_model(),
            queue=root / "pools.db",
            load_log=root / "engine-builds.log",
        )

    def resource(self, *, max_workers: int = 1) -> Any:
        """The local resource, its pool on this section's queue with short TTLs (the bench
        waits out the idle TTL; a killed worker's lease lapses after the lease TTL)."""
        sizes = self.ctx.sizes
        settings = PoolSettings(
            queue=str(self.queue),
            max_workers=max_workers,
            idle_ttl_s=sizes.pools_idle_ttl_s,
            lease_ttl_s=sizes.pools_lease_ttl_s,
        )
        env = {**self.ctx.engine_env(), LOAD_LOG_ENV: str(self.load_log)}
        return local_resource(env=env, pool=settings)

    def pipeline(
        self,
        name: str,
        keys: list[str],
        *,
        launch: str,
        max_workers: int = 1,
        chunk_size: int | None = None,
        per_run: int | None = None,
    ) -> PlatformPipeline:
        """An embed pipeline over `root/inputs/<name>/<key>.parquet`."""
        return PlatformPipeline(
            name=name,
            model=self.model,
            task="embed",
            input_uri=str(self.inputs(name) / "{partition_key}.parquet"),
            root=self.root / name,
            keys=keys,
            resource=self.resource(max_workers=max_workers),
            engine=EngineArgs(dtype="float32", extra={"kv_cache_memory_bytes": KV_CACHE_BYTES}),
            chunk_size=chunk_size or self.ctx.sizes.chunk_size,
            partitions_per_run=per_run,
            launch=launch,
        )

    def inputs(self, name: str) -> Path:
        return self.root / "inputs" / name

    def write_shards(self, name: str, rows_by_key: dict[str, int], *, seed: int) -> int:
        """One shard per key with its number of rows; returns the rows written."""
        texts = embed_texts(sum(rows_by_key.values()), seed=seed)
        start = 0
        for key, rows in rows_by_key.items():
            write_shard(
                self.inputs(name) / f"{key}.parquet", texts[start : start + rows], id_prefix=key
            )
            start += rows
        return start

    def builds(self) -> list[tuple[int, str]]:
        """Engine builds so far: (pid of the process that built it, model)."""
        if not self.load_log.exists():
            return []
        lines = self.load_log.read_text().splitlines()
        return [(int(pid), model) for pid, _, model in (ln.partition("\t") for ln in lines)]


class PoolWatch(threading.Thread):
    """Samples the queue's pools and their live workers every `interval` seconds: which
    pools ran, every worker seen and its pid, and the most workers live at once per pool."""

    def __init__(self, queue: Path, interval: float = 0.25) -> None:
        super().__init__(name="pool-watch", daemon=True)
        self.queue = str(queue)
        self.interval = interval
        self.pool_keys: set[str] = set()
        self.worker_pids: dict[str, int] = {}
        self.worker_ids: set[str] = set()
        self.most_live: dict[str, int] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        with open_lease_queue(self.queue) as queue:
            while not self._stop_event.is_set():
                with contextlib.suppress(Exception):  # a locked store: the next sample
                    self.pool_keys.update(queue.pools())
                    for key in list(self.pool_keys):
                        live = queue.pool_workers(key)
                        self.most_live[key] = max(self.most_live.get(key, 0), len(live))
                        for worker in live:
                            self.worker_ids.add(worker.worker_id)
                            pid = worker.info.get("pid")
                            if isinstance(pid, int):
                                self.worker_pids[worker.worker_id] = pid
                self._stop_event.wait(self.interval)

    def most_live_now(self) -> int:
        return max(self.most_live.values(), default=0)

    def reset_most_live(self) -> None:
        self.most_live = {}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


@contextlib.contextmanager
def _load_log_env(path: Path) -> Iterator[None]:
    """`GPUINFER_MODEL_LOAD_LOG` in this process's environment too, for pool workers
    started with it; restored after."""
    before = os.environ.get(LOAD_LOG_ENV)
    os.environ[LOAD_LOG_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOAD_LOG_ENV, None)
        else:
            os.environ[LOAD_LOG_ENV] = before


def run_pools(ctx: BenchContext) -> dict[str, Any]:
    """The section: each part in turn, a failed part recorded in `errors` (the others run)."""
    bench = PoolBench.create(ctx)
    watch = PoolWatch(bench.queue)
    out: dict[str, Any] = {
        "model": "all-MiniLM-L6-v2 (embed)",
        "queue": "SQLite file (one for the whole section)",
        "idle_ttl_s": ctx.sizes.pools_idle_ttl_s,
        "lease_ttl_s": ctx.sizes.pools_lease_ttl_s,
        "amortization_reference": AMORTIZATION_SOURCE,
        "skipped": [],
    }
    steps: list[tuple[str, Callable[[PoolBench, PoolWatch], dict[str, Any]]]] = [
        ("arrivals", _arrivals),
        ("batches", _batches),
        ("skew", _skew),
        ("kill", _kill),
        ("scale_to_zero", _scale_to_zero),
    ]
    unknown = set(ctx.pools_parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown pools parts {sorted(unknown)}; choose among {PARTS}")
    steps = [(n, step) for n, step in steps if not ctx.pools_parts or n in ctx.pools_parts]
    with _load_log_env(bench.load_log):
        watch.start()
        try:
            for name, step in steps:
                started = time.perf_counter()
                log.info("pools: %s", name)
                try:
                    out[name] = step(bench, watch)
                except Exception:
                    bench.errors[name] = traceback.format_exc()
                    log.error("pools: %s failed:\n%s", name, bench.errors[name])
                out.setdefault("part_seconds", {})[name] = round(time.perf_counter() - started)
        finally:
            watch.stop()
    out["engine_builds"] = len(bench.builds())
    out["errors"] = bench.errors
    return out


def _arrivals(bench: PoolBench, watch: PoolWatch) -> dict[str, Any]:
    """(a) N runs of one partition one after another on a pool vs one run of N, per-run."""
    sizes = bench.ctx.sizes
    keys = [f"a-{i:03d}" for i in range(sizes.pools_arrivals)]
    rows = {key: sizes.pools_arrival_rows for key in keys}
    total_rows = bench.write_shards("arrive_run", rows, seed=37)
    bench.write_shards("arrive_pool", rows, seed=37)

    # One chunk per partition on both sides. Not the suite's 512: on main a run of many
    # partitions much smaller than its chunk size hangs (16 x 32 rows, chunk 512: the chunks
    # a run may hand out, 8 windows of rows / chunk size + 3 = 11 chunks, hold 352 rows, and
    # the loop's first batch waits for a full window of 512; seen twice, and on main).
    chunk = sizes.pools_arrival_rows
    one = bench.pipeline("arrive_run", keys, launch="run", chunk_size=chunk)
    builds = len(bench.builds())
    one_run = one.run(keys)
    one_builds = len(bench.builds()) - builds

    pool = bench.pipeline("arrive_pool", keys, launch="pool", chunk_size=chunk)
    builds = len(bench.builds())
    started = time.perf_counter()
    timings = [pool.run([key]) for key in keys]
    pool_wall = time.perf_counter() - started
    pool_builds = len(bench.builds()) - builds
    facts = [_pool_facts(pool.instance, t.run_id) for t in timings]
    warm = [f.get("pool_warm_engine") for fs in facts for f in fs.values()]
    # Each side's engine build (run metadata): on loaded cores one swings 2-3x from run to
    # run and sways the ratio, so the report also gives it without them.
    builds_s = (one_run.worker_split.get("load"), timings[0].worker_split.get("load"))
    result = {
        "partitions": len(keys),
        "rows_per_partition": sizes.pools_arrival_rows,
        "one_run_per_run_launch": {
            "wall_seconds": one_run.run_seconds,
            "engine_builds": one_builds,
            "rows": one_run.rows,
        },
        "pool_runs": {
            "wall_seconds": pool_wall,
            "run_seconds": [t.run_seconds for t in timings],
            "first_run_seconds": timings[0].run_seconds,
            "later_runs_median_seconds": _median([t.run_seconds for t in timings[1:]]),
            "engine_builds": pool_builds,
            "rows": sum(t.rows for t in timings),
            "warm_engine": warm,
            "partition_facts": facts,
        },
        "rows": total_rows,
        "ratio": one_run.run_seconds / pool_wall,
        "engine_build_seconds": {"one_run": builds_s[0], "pool": builds_s[1]},
        "ratio_without_builds": (one_run.run_seconds - builds_s[0]) / (pool_wall - builds_s[1])
        if None not in builds_s
        else None,
    }
    log.info(
        "pools arrivals: one run %.1fs, %d pool runs %.1fs: %.2f (%d pool engine builds)",
        one_run.run_seconds,
        len(keys),
        pool_wall,
        result["ratio"],
        pool_builds,
    )
    return result


def _batches(bench: PoolBench, watch: PoolWatch) -> dict[str, Any]:
    """(b) through the batch API (`bench/pool_batches.py`), unless the sizes say none."""
    if not bench.ctx.sizes.pools_batches:
        return {
            "skipped": "batches (b): not run at these sizes (a daemon, a service and a run "
            "per batch; the full run has them)"
        }
    from bench.pool_batches import run_batches

    return run_batches(bench, watch)


def _pool_facts(instance: dg.DagsterInstance, run_id: str) -> dict[str, dict[str, Any]]:
    """Per partition, the `pool_*` metadata its materialization carries (warm engine, queue
    wait, leases), as the UI shows it."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION
    ).records
    facts: dict[str, dict[str, Any]] = {}
    for record in records:
        event = record.event_log_entry.dagster_event
        if event is None:
            continue
        materialization = event.event_specific_data.materialization
        found = {k: v.value for k, v in materialization.metadata.items() if k.startswith("pool_")}
        if materialization.partition and found:
            facts[materialization.partition] = found
    return facts


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _manifests(pipeline: PlatformPipeline, keys: list[str]) -> dict[str, Manifest]:
    found = {}
    for key in keys:
        fs, path = filesystem_for(partition_dir(pipeline.output(), key))
        manifest = read_manifest(fs, path)
        if manifest is not None:
            found[key] = manifest
    return found


def _skew(bench: PoolBench, watch: PoolWatch) -> dict[str, Any]:
    """(c) A backfill of two runs at once, one partition 8x the others: per-run launch
    (the big partition first in its run) and a pool of 2 workers (big first, then last)."""
    sizes = bench.ctx.sizes
    keys = [f"s-{i:03d}" for i in range(sizes.pools_skew_partitions)]
    half = (len(keys) + 1) // 2
    runs = [keys[:half], keys[half:]]
    settings = []
    for placement in sizes.pools_skew_placements:
        big = 0 if placement == "first" else half - 1
        rows = {
            key: sizes.pools_skew_rows * (sizes.pools_skew_factor if i == big else 1)
            for i, key in enumerate(keys)
        }
        first = placement == sizes.pools_skew_placements[0]
        launches = ("run", "pool") if first and sizes.pools_skew_per_run else ("pool",)
        for launch in launches:
            settings.append(_skew_backfill(bench, watch, placement, launch, rows, runs))
    return {
        "partitions": len(keys),
        "small_rows": sizes.pools_skew_rows,
        "big_rows": sizes.pools_skew_rows * sizes.pools_skew_factor,
        "runs": runs,
        "settings": settings,
    }


def _skew_backfill(
    bench: PoolBench,
    watch: PoolWatch,
    placement: str,
    launch: str,
    rows: dict[str, int],
    runs: list[list[str]],
) -> dict[str, Any]:
    """One backfill of (c): its runs at once, in threads; makespan, span and work."""
    name = f"skew_{launch}_{placement}"
    keys = list(rows)
    bench.write_shards(name, rows, seed=41)
    pipeline = bench.pipeline(name, keys, launch=launch, max_workers=2, per_run=len(runs[0]))
    builds = len(bench.builds())
    warmup = _warm_pool(bench, f"{name}_warmup", workers=2) if launch == "pool" else None
    watch.reset_most_live()
    wall, _ = _concurrent_runs(pipeline, runs)
    manifests = _manifests(pipeline, keys)
    if len(manifests) != len(keys):
        raise RuntimeError(f"{name}: {len(manifests)} of {len(keys)} partitions committed")
    work = sum(m.engine_seconds for m in manifests.values())
    span = max(m.committed_at for m in manifests.values()) - min(
        m.committed_at - m.wall_seconds for m in manifests.values()
    )
    big = max(rows, key=rows.__getitem__)
    result = {
        "placement": placement,
        "launch": launch,
        "big_partition": big,
        "makespan_seconds": wall,
        "span_seconds": span,
        "work_seconds": work,
        "span_over_half_work": span / (work / 2) if work else None,
        "big_partition_seconds": manifests[big].wall_seconds,
        "engine_builds": len(bench.builds()) - builds,
        "pool_warmup": warmup,
        "pool_workers_at_once": watch.most_live_now() if launch == "pool" else None,
        "rows": sum(m.rows_out for m in manifests.values()),
    }
    log.info(
        "pools skew %s %s: makespan %.1fs, span %.1fs, work %.1fs: %.2f of work/2",
        launch,
        placement,
        wall,
        span,
        work,
        result["span_over_half_work"] or float("nan"),
    )
    return result


def _warm_pool(bench: PoolBench, name: str, *, workers: int) -> dict[str, Any]:
    """Bring the pool to `workers` warm idle workers before a timed backfill (a pool keeps
    warm engines; a cold one's build would sit inside the backfill's span, while the
    per-run side builds both of its engines before its first partition). A warm-up run of
    `2 * workers` tiny partitions: the workers the reconciler starts each lease one before
    any has built its engine (a worker builds on its first lease). Returns how long it took
    and the warm-up runs it needed (at most 3)."""
    started = time.perf_counter()
    for attempt in range(1, 4):
        keys = [f"w-{i:03d}" for i in range(2 * workers)]
        bench.write_shards(f"{name}{attempt}", dict.fromkeys(keys, 4), seed=53)
        pipeline = bench.pipeline(f"{name}{attempt}", keys, launch="pool", max_workers=workers)
        run_id = str(uuid.uuid4())
        pipeline.run(keys, run_id=run_id)
        if _wait_warm(bench.queue, f"{run_id}-{name}{attempt}-0", workers):
            return {"seconds": time.perf_counter() - started, "runs": attempt}
    raise RuntimeError(f"the pool did not reach {workers} warm workers in 3 warm-up runs")


def _wait_warm(queue_path: Path, job_id: str, workers: int, timeout_s: float = 300) -> bool:
    """Whether the job's pool has `workers` live workers, idle and warm, within the time."""
    deadline = time.monotonic() + timeout_s
    with open_lease_queue(str(queue_path)) as queue:
        pool_key = queue.job_progress(job_id).pool_key
        while time.monotonic() < deadline:
            live = queue.pool_workers(pool_key)
            if sum(1 for w in live if w.state == "idle" and w.info.get("warm")) >= workers:
                return True
            if (
                sum(1 for w in live if w.info.get("warm"))
                + sum(1 for w in live if w.state in ("starting", "loading", "busy"))
                < workers
            ):
                return False  # a worker left cold: another warm-up run
            time.sleep(0.5)
    return False


def _concurrent_runs(
    pipeline: PlatformPipeline, batches: list[list[str]]
) -> tuple[float, list[RunTiming]]:
    """One Dagster run per batch of keys, all at once, each in a process of its own (forked,
    with its own instance), as a backfill's runs are; the wall time until the last one has
    ended, and their timings. Not threads: two `execute_in_process` starting together in
    one process deadlock in `logging` (Dagster's log manager calls `logging.config.dictConfig`
    at each run's start while the other run's handlers hold their locks; seen here)."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [
        context.Process(target=_run_child, args=(pipeline, i, batch, results), daemon=True)
        for i, batch in enumerate(batches)
    ]
    started = time.perf_counter()
    for process in processes:
        process.start()
    timings: dict[int, RunTiming] = {}
    failures: list[str] = []
    for _ in processes:
        i, timing, failure = results.get(timeout=CHILD_RUN_TIMEOUT_S)
        if failure is not None:
            failures.append(failure)
        else:
            timings[i] = timing
    wall = time.perf_counter() - started
    for process in processes:
        process.join(timeout=60)
    if failures:
        raise RuntimeError("a run of the backfill failed:\n" + "\n".join(failures))
    return wall, [timings[i] for i in sorted(timings)]


CHILD_RUN_TIMEOUT_S = 1800


def _run_child(pipeline: PlatformPipeline, i: int, keys: list[str], results: Any) -> None:
    """In a forked process: run `keys` on an instance of its own; put (i, timing, failure)."""
    try:
        home = pipeline.instance.root_directory + f"-{i}"
        os.makedirs(home, exist_ok=True)
        instance = dg.DagsterInstance.local_temp(home, overrides={"telemetry": {"enabled": False}})
        results.put((i, pipeline.run(keys, instance=instance), None))
    except BaseException:
        results.put((i, None, traceback.format_exc()))


def _kill(bench: PoolBench, watch: PoolWatch) -> dict[str, Any]:
    """(d) SIGKILL a pool worker while a partition it holds has committed chunks and is not
    finished; the run still commits every partition, each input id once in its output."""
    sizes = bench.ctx.sizes
    keys = [f"k-{i:03d}" for i in range(sizes.pools_kill_partitions)]
    rows = {key: sizes.pools_kill_rows for key in keys}
    bench.write_shards("kill_pool", rows, seed=43)
    pipeline = bench.pipeline(
        "kill_pool", keys, launch="pool", max_workers=2, chunk_size=sizes.pools_kill_chunk
    )
    run_id = str(uuid.uuid4())
    job_id = f"{run_id}-kill_pool-0"  # the contract's job id: run, asset, retry number
    killed: dict[str, Any] = {}
    killer = threading.Thread(
        target=_kill_mid_partition,
        args=(bench.queue, pipeline, job_id, rows, killed),
        name="pool-killer",
        daemon=True,
    )
    builds = len(bench.builds())
    killer.start()
    timing = pipeline.run(keys, run_id=run_id)
    killer.join(timeout=5)
    if not killed:
        raise RuntimeError("no pool worker was caught mid-partition: nothing was killed")
    log.info(
        "pools kill: SIGKILL of %s (pid %s) on %s",
        killed["worker_id"],
        killed["pid"],
        killed["partition"],
    )
    outputs = _check_outputs(pipeline, rows)
    with open_lease_queue(str(bench.queue)) as queue:
        items = {item.key: item for item in queue.job_items(job_id)}
        expired = queue.pool_stats(killed["pool_key"]).expired_leases
    victim = items[killed["item"]]  # the partition, or the range of it, the victim held
    return {
        "partitions": len(keys),
        "rows_per_partition": sizes.pools_kill_rows,
        "chunk_size": sizes.pools_kill_chunk,
        "run_seconds": timing.run_seconds,
        "killed": killed,
        "killed_partition_leases": victim.leases,
        "killed_partition_finished_by": victim.worker_id,
        "finished_by_another_worker": victim.worker_id != killed["worker_id"],
        "victim_process_gone": not _alive(killed["pid"]),
        "expired_leases": expired,
        "leases": {key: item.leases for key, item in items.items()},
        "engine_builds": len(bench.builds()) - builds,
        **outputs,
    }


def _kill_mid_partition(
    queue_path: Path,
    pipeline: PlatformPipeline,
    job_id: str,
    rows: dict[str, int],
    killed: dict[str, Any],
    timeout_s: float = 600,
) -> None:
    """Watch the job's leases and partitions; SIGKILL the holder of the first partition
    seen with committed chunks and rows left, recording what was killed in `killed`."""
    from dagster_gpuinfer.pools import UnknownJobError
    from dagster_gpuinfer.storage.reading import partition_progress

    deadline = time.monotonic() + timeout_s
    with open_lease_queue(str(queue_path)) as queue:
        while time.monotonic() < deadline:
            try:
                items = queue.job_items(job_id)
                pool_key = queue.job_progress(job_id).pool_key
            except UnknownJobError:
                time.sleep(0.1)
                continue
            workers = {w.worker_id: w for w in queue.pool_workers(pool_key)}
            for item in items:
                worker = workers.get(item.worker_id or "")
                if item.state != "leased" or worker is None or "pid" not in worker.info:
                    continue
                # A big partition is leased as chunk ranges (`<key>#chunks=a-b`).
                partition = item.key.partition(RANGE_MARK)[0]
                committed, counts = partition_progress(pipeline.output(), partition)
                if committed or not 0 < counts.rows_in < rows[partition]:
                    continue
                os.kill(int(worker.info["pid"]), signal.SIGKILL)
                killed.update(
                    pool_key=pool_key,
                    partition=partition,
                    item=item.key,
                    worker_id=worker.worker_id,
                    pid=int(worker.info["pid"]),
                    rows_committed_at_kill=counts.rows_in,
                    other_workers_live=len(workers) - 1,
                    at=time.time(),
                )  # no logging here: a thread's log call beside a run's start can deadlock
                return
            time.sleep(0.05)


def _check_outputs(pipeline: PlatformPipeline, rows: dict[str, int]) -> dict[str, Any]:
    """Each partition's committed output ids against its input ids: lost, duplicated."""
    from dagster_gpuinfer.storage.reading import read_partition

    manifests = _manifests(pipeline, list(rows))
    lost = duplicated = extra = out_rows = 0
    for key, count in rows.items():
        if key not in manifests:
            continue
        ids = read_partition(pipeline.output(), key).column("id").to_pylist()
        expected = {f"{key}-{i:07d}" for i in range(count)}
        out_rows += len(ids)
        lost += len(expected - set(ids))
        duplicated += len(ids) - len(set(ids))
        extra += len(set(ids) - expected)
    return {
        "partitions_committed": len(manifests),
        "rows_in": sum(rows.values()),
        "rows_out": out_rows,
        "rows_lost": lost + sum(c for k, c in rows.items() if k not in manifests),
        "rows_duplicated": duplicated,
        "rows_unexpected": extra,
        "rows_resumed": {k: m.rows_resumed for k, m in manifests.items()},
    }


def _scale_to_zero(bench: PoolBench, watch: PoolWatch) -> dict[str, Any]:
    """(e) After the last run, wait for the pool to empty: no worker listed, no process of
    any worker seen (pid, process group or session) alive. Zombies (exited, not yet reaped
    by their parent) are counted apart."""
    ttl = bench.ctx.sizes.pools_idle_ttl_s
    started = time.monotonic()
    deadline = started + 3 * ttl + 120
    with open_lease_queue(str(bench.queue)) as queue:
        while True:
            keys = watch.pool_keys | set(queue.pools())
            listed = sum(len(queue.pool_workers(key)) for key in keys)
            pids = set(watch.worker_pids.values()) | {pid for pid, _ in bench.builds()}
            left, zombies = _processes_left(pids, watch.worker_ids)
            if (not listed and not left) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    return {
        "idle_ttl_s": ttl,
        "seconds_to_zero": time.monotonic() - started,
        "pools": sorted(keys),
        "pool_workers_listed": listed,
        "worker_pids_seen": sorted(pids),
        "worker_ids_seen": sorted(watch.worker_ids),
        "processes_left": left,
        "zombies": zombies,
    }


def _processes_left(pids: set[int], worker_ids: set[str]) -> tuple[list[str], list[int]]:
    """Live processes that are one of `pids`, in their process group or session, or carry
    one of `worker_ids` on their command line (`--worker-id`); and such processes that are
    zombies (exited, not yet reaped by their parent)."""
    left: list[str] = []
    zombies: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _ppid, pgrp, session = stat.rpartition(")")[2].split()[:4]
        pid = int(entry.name)
        named = any(f"--worker-id {worker_id}" in cmdline for worker_id in worker_ids)
        if not ({pid, int(pgrp), int(session)} & pids or named):
            continue
        if state == "Z":
            zombies.append(pid)
        else:
            left.append(f"{pid} {cmdline.strip()[:160]}")
    return left, zombies


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def report_lines(res: dict[str, Any]) -> list[str]:
    """The section's part of RESULTS.md."""
    lines = [
        "## Engine pools",
        "",
        f"{res['model']}; lease queue: {res['queue']}; pool idle TTL {res['idle_ttl_s']} s, "
        f"lease TTL {res['lease_ttl_s']} s; {res.get('engine_builds', 'n/a')} engine builds "
        "in the section (load log).",
        "",
    ]
    if "arrivals" in res:
        lines += _arrivals_lines(res["arrivals"], res["amortization_reference"])
    if "batches" in res:
        lines += _batches_lines(res["batches"])
    if "skew" in res:
        lines += _skew_lines(res["skew"])
    if "kill" in res:
        lines += _kill_lines(res["kill"])
    if "scale_to_zero" in res:
        zero = res["scale_to_zero"]
        lines += [
            f"(e) Scale to zero: {zero['seconds_to_zero']:.1f} s after the last run "
            f"(idle TTL {zero['idle_ttl_s']} s), {zero['pool_workers_listed']} pool workers "
            f"listed, {len(zero['processes_left'])} processes left of the "
            f"{len(zero['worker_pids_seen'])} worker and engine-building pids seen "
            f"({len(zero['zombies'])} zombies awaiting their parent's reaping).",
            "",
        ]
    lines += [f"- not run: {s}" for s in res.get("skipped", [])]
    lines += [f"- part {part} failed (see results.json)" for part in res.get("errors", {})]
    return lines + [""]


def _arrivals_lines(arr: dict[str, Any], reference: str) -> list[str]:
    one, pool = arr["one_run_per_run_launch"], arr["pool_runs"]
    warm = sum(1 for w in pool["warm_engine"] if w)
    return [
        f"(a) {arr['partitions']} partitions of {arr['rows_per_partition']} rows, one run "
        "per partition arriving one after another on a pool, against one run of all of "
        "them with per-run launch:",
        "",
        "| contestant | wall s | engine builds | rows |",
        "|---|---|---|---|",
        f"| 1 run, per-run launch | {one['wall_seconds']:.1f} | {one['engine_builds']} | "
        f"{one['rows']} |",
        f"| {arr['partitions']} runs, pool | {pool['wall_seconds']:.1f} | "
        f"{pool['engine_builds']} | {pool['rows']} |",
        "",
        f"**one run / pool runs: {arr['ratio']:.2f}** (target >= 0.7). Pool runs: first "
        f"{pool['first_run_seconds']:.1f} s (engine build in it), the others "
        f"{_num(pool['later_runs_median_seconds'])} s median; {warm} of "
        f"{len(pool['warm_engine'])} partitions on a warm engine (run metadata). "
        f"Per-run launch of one partition per run, for comparison: {reference}.",
        "",
    ] + _build_lines(arr)


def _build_lines(arr: dict[str, Any]) -> list[str]:
    builds = arr.get("engine_build_seconds") or {}
    if arr.get("ratio_without_builds") is None:
        return []
    return [
        f"Engine builds (run metadata): per-run launch {builds['one_run']:.1f} s, pool "
        f"{builds['pool']:.1f} s; on loaded cores a build's time swings 2-3x from one run to "
        "the next and sways the ratio with it. Without the builds (one run minus its build / "
        f"the pool runs minus theirs): {arr['ratio_without_builds']:.2f}.",
        "",
    ]


def _batches_lines(batches: dict[str, Any]) -> list[str]:
    if "skipped" in batches:
        return [f"(b) {batches['skipped']}.", ""]
    one, pool = batches["one_batch_per_run_launch"], batches["batches_on_pool"]
    n, lines = batches["batches"], batches["lines_per_batch"]
    return [
        f"(b) Batch API: {n} batches of {lines} lines created together on a pool route, "
        f"against one batch of {n * lines} lines on a per-run route (daemon, service, a run "
        f"per batch, at most {batches['max_concurrent_runs']} runs at once):",
        "",
        "| contestant | first create to last completed s | completed | engine builds | "
        "lines out | lost | duplicated |",
        "|---|---|---|---|---|---|---|",
        f"| 1 batch, per-run launch | {one['seconds']:.1f} | {one['completed']}/1 | "
        f"{one['engine_builds']} | {one['lines_out']} | {one['lost']} | {one['duplicated']} |",
        f"| {n} batches, pool | {pool['seconds']:.1f} | {pool['completed']}/{n} | "
        f"{pool['engine_builds']} | {pool['lines_out']} | {pool['lost']} | "
        f"{pool['duplicated']} |",
        "",
        f"**one batch / {n} pool batches: {batches['ratio']:.2f}**; target: all completed with "
        "at most 2 engine builds.",
        "",
    ]


def _skew_lines(skew: dict[str, Any]) -> list[str]:
    lines = [
        f"(c) Skewed backfill: {skew['partitions']} partitions, one of {skew['big_rows']} rows "
        f"and the others {skew['small_rows']}, in two runs at once ({skew['runs']}). Work: "
        "the partitions' engine seconds summed; span: first partition started to last "
        "committed (engine builds before it not counted); makespan: the runs' wall time. "
        "Before each pool backfill a warm-up run brings the pool to 2 warm idle workers "
        "(not timed here: a pool keeps its engines warm).",
        "",
        "| launch | big partition | makespan s | span s | work s | span / (work/2) | "
        "engine builds (a pool's in its warm-up) | pool workers at once |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in skew["settings"]:
        lines.append(
            f"| {s['launch']} | {s['placement']} in its run | {s['makespan_seconds']:.1f} | "
            f"{s['span_seconds']:.1f} | {s['work_seconds']:.1f} | "
            f"{_num(s['span_over_half_work'])} | {s['engine_builds']} | "
            f"{s['pool_workers_at_once'] if s['pool_workers_at_once'] is not None else '-'} |"
        )
    return lines + ["", "Target: span / (work/2) <= 1.15 on the pool.", ""]


def _kill_lines(kill: dict[str, Any]) -> list[str]:
    k = kill["killed"]
    return [
        f"(d) SIGKILL of a pool worker mid-partition ({kill['partitions']} partitions of "
        f"{kill['rows_per_partition']} rows, chunks of {kill['chunk_size']}): killed "
        f"{k['worker_id']} holding {k['partition']} with {k['rows_committed_at_kill']} rows "
        f"committed ({k['other_workers_live']} other workers live); that partition took "
        f"{kill['killed_partition_leases']} leases and was finished by "
        f"{'another worker' if kill['finished_by_another_worker'] else 'the same worker id'}; "
        f"{kill['expired_leases']} expired leases in the pool; "
        f"{kill['partitions_committed']} of {kill['partitions']} partitions committed, "
        f"rows in {kill['rows_in']}, out {kill['rows_out']}: **{kill['rows_lost']} lost, "
        f"{kill['rows_duplicated']} duplicated**; run {kill['run_seconds']:.1f} s.",
        "",
    ]


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
