"""Downstream of inference: per-partition statistics of an embedding pipeline, with polars.

The stats asset shares its upstream's partitions and carries
`AutomationCondition.eager()`: when `dagster dev` runs the daemon, a partition of the stats
is materialized as soon as the same partition of the embeddings is updated (a backfill, a
sensor run, a re-run), and not while the upstream is still in progress.
"""

import posixpath

import dagster as dg
import polars as pl
from dagster import AssetExecutionContext

from dagster_gpuinfer import GpuInferenceResource, InferencePipeline, read_partition
from dagster_gpuinfer.spec import OutputSpec
from dagster_gpuinfer.storage import (
    filesystem_for,
    partition_dir,
    table_to_parquet_bytes,
    write_bytes_atomic,
)

STATS_FILE = "stats.parquet"
EMPTY_EMBEDDINGS_SCHEMA = {
    "id": pl.String,
    "embedding": pl.Array(pl.Float32, 1),
    "prompt_tokens": pl.Int32,
}


def embedding_stats(frame: pl.DataFrame) -> pl.DataFrame:
    """One row of statistics over an embedding output (`id`, `embedding`, `prompt_tokens`)."""
    norms = frame.select(
        norm=pl.col("embedding").arr.eval(pl.element().pow(2)).arr.sum().sqrt(),
        prompt_tokens=pl.col("prompt_tokens"),
        id=pl.col("id"),
    )
    return norms.select(
        rows=pl.len(),
        distinct_ids=pl.col("id").n_unique(),
        mean_prompt_tokens=pl.col("prompt_tokens").mean(),
        max_prompt_tokens=pl.col("prompt_tokens").max(),
        min_norm=pl.col("norm").min(),
        max_norm=pl.col("norm").max(),
        mean_norm=pl.col("norm").mean(),
    )


def embedding_stats_asset(
    pipeline: InferencePipeline,
    *,
    name: str | None = None,
    resource_key: str = "gpu",
    automation_condition: dg.AutomationCondition | None = None,
) -> dg.AssetsDefinition:
    """A polars asset with the statistics of each partition of an `embed` pipeline.

    It reads the committed output through its manifest (local or S3, with the storage
    settings of the `GpuInferenceResource`) and writes `stats.parquet` beside the outputs,
    under `<output_root>/<name>/<partition>/`.
    """
    if pipeline.spec["task"] != "embed":
        raise ValueError(
            f"embedding_stats_asset needs an embed pipeline; {pipeline.output_asset.key} runs "
            f"{pipeline.spec['task']!r}"
        )
    upstream = pipeline.output_asset
    output = OutputSpec.model_validate(pipeline.spec["output"])
    stats_name = name or f"{upstream.key.path[-1]}_stats"
    stats_output = OutputSpec(root=output.root, asset_name=stats_name)

    @dg.asset(
        key=dg.AssetKey([*upstream.key.path[:-1], stats_name]),
        deps=[upstream],
        partitions_def=upstream.partitions_def,
        automation_condition=automation_condition or dg.AutomationCondition.eager(),
        group_name=upstream.group_names_by_key.get(upstream.key),
        kinds={"polars", "parquet"},
        required_resource_keys={resource_key},
        description=f"Row counts, prompt tokens and embedding norms of each partition of "
        f"{upstream.key.to_user_string()}",
    )
    def _stats(context: AssetExecutionContext) -> dg.MaterializeResult:
        gpu: GpuInferenceResource = getattr(context.resources, resource_key)
        storage = gpu.storage_options()
        table = read_partition(output, context.partition_key, storage)
        if table.num_rows == 0:  # every row quarantined: no part files, no columns
            frame = pl.DataFrame(schema=EMPTY_EMBEDDINGS_SCHEMA)
        else:
            frame = pl.from_arrow(table)  # type: ignore[assignment]
        stats = embedding_stats(frame)  # type: ignore[arg-type]
        fs, directory = filesystem_for(partition_dir(stats_output, context.partition_key), storage)
        write_bytes_atomic(
            fs, posixpath.join(directory, STATS_FILE), table_to_parquet_bytes(stats.to_arrow())
        )
        row = stats.row(0, named=True)
        return dg.MaterializeResult(
            metadata={
                **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()},
                "stats_path": dg.MetadataValue.path(
                    partition_dir(stats_output, context.partition_key) + "/" + STATS_FILE
                ),
            }
        )

    return _stats
