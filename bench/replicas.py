"""One embed partition served by one engine and by two (cores split between them).

The worker's replicas pull chunks, not shards, so one partition keeps both engines busy. Each
round materializes the same partition (all-MiniLM-L6-v2, `replicas_rows` documents) with
`replicas=1` and with `replicas=2` (each engine pinned to its own cores by
`plan_replica_env`), in rotating order. The rate is rows over the partition's wall time in
the worker (reading starts once every engine is ready); the end-to-end rate divides by the
whole Dagster run (both engines are built at once).
"""

from __future__ import annotations

import logging
from typing import Any

from bench.context import KV_CACHE_BYTES, BenchContext
from bench.platform_run import PlatformPipeline, local_resource
from bench.stats import paired_ratios, rotations, summarize
from bench.workloads import embed_texts, write_shard
from dagster_gpuinfer import EngineArgs

log = logging.getLogger("bench")
SETTINGS = (1, 2)


def run_replicas(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir("replicas")
    texts = embed_texts(sizes.replicas_rows, seed=41)
    write_shard(root / "inputs" / "shard-0.parquet", texts, id_prefix="rep")
    resource = local_resource(env=ctx.engine_env())
    pipelines = {
        n: PlatformPipeline(
            name=f"replicas_{n}",
            model=ctx.embed_model(),
            task="embed",
            input_uri=str(root / "inputs" / "{partition_key}.parquet"),
            root=root / f"r{n}",
            keys=["shard-0"],
            resource=resource,
            engine=EngineArgs(dtype="float32", extra={"kv_cache_memory_bytes": KV_CACHE_BYTES}),
            chunk_size=sizes.chunk_size,
            replicas=n,
        )
        for n in SETTINGS
    }
    rates: dict[int, list[float]] = {n: [] for n in SETTINGS}
    end_to_end: dict[int, list[float]] = {n: [] for n in SETTINGS}
    runs: list[dict[str, Any]] = []
    for round_index, order in enumerate(rotations(list(SETTINGS), sizes.rounds)):
        for n in order:
            pipeline = pipelines[n]
            pipeline.clear_outputs()
            timing = pipeline.run(pipeline.keys)
            seconds = timing.partition_seconds["shard-0"]
            if timing.rows != len(texts):
                raise RuntimeError(f"replicas={n}: {timing.rows} rows out of {len(texts)}")
            from dagster_gpuinfer.storage import filesystem_for, partition_dir, read_manifest

            fs, path = filesystem_for(partition_dir(pipeline.output(), "shard-0"))
            served_by = read_manifest(fs, path).worker.get("replicas")
            rates[n].append(timing.rows / seconds)
            end_to_end[n].append(timing.rows / timing.run_seconds)
            runs.append(
                {
                    "round": round_index,
                    "replicas": n,
                    "partition_seconds": seconds,
                    "run_seconds": timing.run_seconds,
                    "served_by": served_by,
                    "model_loads": timing.model_loads,
                    "worker_split": timing.worker_split,
                }
            )
            log.info(
                "replicas round %d: replicas=%d %7.1f rows/s (served by %s)",
                round_index,
                n,
                rates[n][-1],
                served_by,
            )
    return {
        "rows": len(texts),
        "chunk_size": sizes.chunk_size,
        "model": "all-MiniLM-L6-v2 (embed)",
        "settings": {
            str(n): {
                "rows_per_s": rates[n],
                "rows_per_s_summary": summarize(rates[n]).__dict__,
                "end_to_end_rows_per_s_summary": summarize(end_to_end[n]).__dict__,
            }
            for n in SETTINGS
        },
        "ratio_2_over_1": paired_ratios(rates[2], rates[1]).__dict__,
        "ratio_2_over_1_end_to_end": paired_ratios(end_to_end[2], end_to_end[1]).__dict__,
        "runs": runs,
    }
