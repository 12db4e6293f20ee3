"""Benchmark 3: model-load amortization over a backfill of small partitions.

The same N small shards are materialized with 1, 4, 8, ... partitions per Dagster run (what
`BackfillPolicy.multi_run(max_partitions_per_run=K)` produces; each run is executed the way
`assets/demo.py` executes one, with its partition range in the run tags). Reported: wall time
of the whole backfill, runs, and model loads counted from the worker's load log.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bench.context import KV_CACHE_BYTES, BenchContext
from bench.platform_run import PlatformPipeline, local_resource
from bench.workloads import embed_texts, write_shard
from dagster_gpuinfer import EngineArgs

log = logging.getLogger("bench")


def run_amortization(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir("amortization")
    texts = embed_texts(sizes.amortization_partitions * sizes.amortization_rows, seed=23)
    keys = [f"part-{i:03d}" for i in range(sizes.amortization_partitions)]
    for i, key in enumerate(keys):
        rows = texts[i * sizes.amortization_rows : (i + 1) * sizes.amortization_rows]
        write_shard(root / "inputs" / f"{key}.parquet", rows, id_prefix=key)
    load_log = root / "model-loads.log"
    resource = local_resource(env={**ctx.engine_env(), "GPUINFER_MODEL_LOAD_LOG": str(load_log)})
    results: list[dict[str, Any]] = []
    for per_run in sizes.amortization_per_run:
        pipeline = PlatformPipeline(
            name=f"amortize_{per_run}",
            model=ctx.embed_model(),
            task="embed",
            input_uri=str(root / "inputs" / "{partition_key}.parquet"),
            root=root / f"k{per_run}",
            keys=keys,
            resource=resource,
            engine=EngineArgs(dtype="float32", extra={"kv_cache_memory_bytes": KV_CACHE_BYTES}),
            chunk_size=sizes.chunk_size,
            partitions_per_run=per_run,
        )
        loads_before = _count_lines(load_log)
        batches = [keys[i : i + per_run] for i in range(0, len(keys), per_run)]
        wall = load_seconds = partition_seconds = 0.0
        for batch in batches:
            timing = pipeline.run(batch)
            wall += timing.run_seconds
            load_seconds += timing.model_load_seconds
            partition_seconds += sum(timing.partition_seconds.values())
        loads = _count_lines(load_log) - loads_before
        row = {
            "partitions_per_run": per_run,
            "runs": len(batches),
            "model_loads": loads,
            "wall_seconds": wall,
            "model_load_seconds": load_seconds,
            "partition_seconds": partition_seconds,
            "rows": len(texts),
            "rows_per_s_end_to_end": len(texts) / wall,
        }
        log.info(
            "amortization %2d/run: %d runs, %d loads, %.1fs wall",
            per_run,
            len(batches),
            loads,
            wall,
        )
        results.append(row)
    return {
        "partitions": len(keys),
        "rows_per_partition": sizes.amortization_rows,
        "model": "all-MiniLM-L6-v2 (embed)",
        "settings": results,
    }


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0
