"""How close the backfill estimate comes to the measured time of the backfill it predicts.

    python -m bench.estimate_accuracy [--partitions 8] [--committed 2]

Embeds `--partitions` Parquet shards of different sizes with MiniLM through real Dagster
runs (local launcher, vLLM's CPU build): first `--committed` of them in one run, then the
estimate (`dagster_gpuinfer.estimate`) of the rest, then the rest as the backfill runs them
(`max_partitions_per_run` at a time, one pod slot: one run after the other). Prints the
estimated and measured wall time and their ratio, and writes them to
`bench/results/estimate_accuracy.json`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.estimate import estimate_asset

SENTENCE = "Batch inference turns a dataset and a model into another dataset, shard by shard"


def write_shards(root: Path, sizes: list[int]) -> list[str]:
    keys = []
    for index, rows in enumerate(sizes):
        key = f"shard-{index:03d}"
        texts = [f"{SENTENCE} ({key} row {i}, note {i * 7 % 13})" for i in range(rows)]
        (root / "in").mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table({"id": [f"{key}-{i}" for i in range(rows)], "text": texts}),
            root / "in" / f"{key}.parquet",
        )
        keys.append(key)
    return keys


def materialize(pipeline, keys: list[str], resource, instance) -> float:
    started = time.perf_counter()
    result = dg.materialize(
        pipeline.assets,
        selection=[pipeline.output_asset.key],
        instance=instance,
        resources={"gpu": resource},
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
    )
    assert result.success
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--committed", type=int, default=2)
    parser.add_argument("--per-run", type=int, default=3)
    args = parser.parse_args()

    from assets.models import minilm_path

    sizes = [600 + 400 * (i % 3) for i in range(args.partitions)]  # 600, 1000, 1400 rows
    with tempfile.TemporaryDirectory() as tmp, dg.instance_for_test() as instance:
        root = Path(tmp)
        keys = write_shards(root, sizes)
        pipeline = inference_assets(
            name="docs",
            model=minilm_path(),
            task="embed",
            input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
            output_root=str(root / "out"),
            partitions_def=dg.StaticPartitionsDefinition(keys),
            backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=args.per_run),
            engine={"dtype": "float32"},
            chunk_size=256,
        )
        resource = GpuInferenceResource(
            launcher="local",
            env={
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_LOGGING_LEVEL": "WARNING",
            },
            engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
        )
        first = materialize(pipeline, keys[: args.committed], resource, instance)
        estimate = estimate_asset(
            pipeline.output_asset, resource=resource, instance=instance, pool_slots=1
        )
        print(estimate.summary())
        pending = keys[args.committed :]
        measured_runs = [
            materialize(pipeline, pending[i : i + args.per_run], resource, instance)
            for i in range(0, len(pending), args.per_run)
        ]
    measured = sum(measured_runs)
    ratio = estimate.wall_seconds / measured
    report = {
        "partitions": args.partitions,
        "committed_first": args.committed,
        "rows": sizes,
        "first_run_seconds": round(first, 1),
        "estimated_wall_seconds": round(estimate.wall_seconds, 1),
        "estimated_run_seconds": [round(s, 1) for s in estimate.run_seconds],
        "measured_run_seconds": [round(s, 1) for s in measured_runs],
        "measured_wall_seconds": round(measured, 1),
        "estimate_over_measured": round(ratio, 3),
        "speed_rows_per_pod_second": round(estimate.speed_per_pod_second, 1),
        "model_load_seconds": round(estimate.model_load_seconds, 1),
    }
    print(json.dumps(report, indent=2))
    out = Path(__file__).parent / "results" / "estimate_accuracy.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
