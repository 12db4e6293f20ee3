"""The reference code location: document embeddings, prompt completions, structured
extraction to JSON, passage reranking, image embeddings and image captions with vLLM.

`dagster dev -w workspace.yaml` loads this module. Models and data come from `make demo`
(or `python -m assets.prepare`); environment variables point the pipelines elsewhere:
`GPUINFER_EMBED_MODEL`, `GPUINFER_GENERATE_MODEL`, `GPUINFER_INPUT_ROOT`,
`GPUINFER_OUTPUT_ROOT`, and `GPUINFER_ENV` (local or k8s) for the resources.
"""

from __future__ import annotations

import os

import dagster as dg

from assets.batch_pipelines import batch_api
from assets.daily import daily_embeddings_job, daily_embeddings_schedule, daily_note_embeddings
from assets.downstream import embedding_stats_asset
from assets.image_pipelines import (
    caption_images_job,
    embed_images_job,
    image_captions,
    image_embeddings,
)
from assets.paths import embedding_model_dir, generation_model_dir, input_root, output_root
from assets.request_pipelines import (
    extract_tickets_job,
    passage_rerank,
    rerank_job,
    ticket_fields,
)
from assets.yaml_pipelines import load_yaml_pipelines
from dagster_gpuinfer import (
    EngineArgs,
    InputSpec,
    SamplingParams,
    backfill_estimate_sensor,
    inference_assets,
    pool_reconciler_sensor,
)
from resources import resources_for_environment

DOC_SHARDS = dg.StaticPartitionsDefinition([f"docs-{i:03d}" for i in range(4)])
PROMPT_SHARDS = dg.StaticPartitionsDefinition([f"prompts-{i:03d}" for i in range(4)])

# Transient failures (a killed pod, a storage hiccup) are retried with backoff; a bad shard or
# spec raises a non-retryable Failure, which this policy leaves alone.
TRANSIENT_RETRIES = dg.RetryPolicy(
    max_retries=2, delay=5, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
)

# The Dagster concurrency pool that caps GPU pods in use (deploy/ sets its limit). Unset
# locally: one laptop runs what it is asked to.
GPU_POOL = os.environ.get("GPUINFER_GPU_POOL") or None

doc_embeddings = inference_assets(
    name="doc_embeddings",
    model=embedding_model_dir(),
    task="embed",
    input=InputSpec(uri=f"{input_root()}/docs/{{partition_key}}.parquet", id_column="doc_id"),
    input_asset_key="doc_shards",
    output_root=output_root(),
    partitions_def=DOC_SHARDS,
    # A small encoder: float32 costs little and keeps embeddings equal to the reference.
    engine=EngineArgs(dtype="float32"),
    chunk_size=256,
    retry_policy=TRANSIENT_RETRIES,
    pool=GPU_POOL,
    group_name="embeddings",
    description="all-MiniLM-L6-v2 embeddings (384-d, L2-normalised) of every document shard",
)

prompt_completions = inference_assets(
    name="prompt_completions",
    model=generation_model_dir(),
    task="generate",
    input=InputSpec(
        uri=f"{input_root()}/prompts/{{partition_key}}.jsonl", id_column="id", text_column="prompt"
    ),
    input_asset_key="prompt_shards",
    output_root=output_root(),
    partitions_def=PROMPT_SHARDS,
    engine=EngineArgs(max_model_len=256),
    sampling=SamplingParams(temperature=0.0, max_tokens=32),
    chunk_size=128,
    retry_policy=TRANSIENT_RETRIES,
    pool=GPU_POOL,
    group_name="generation",
    description="Greedy completions of every prompt shard by the local test Llama",
)

PIPELINES = {
    "doc_embeddings": doc_embeddings,
    "prompt_completions": prompt_completions,
    "ticket_fields": ticket_fields,
    "passage_rerank": passage_rerank,
    "image_embeddings": image_embeddings,
    "image_captions": image_captions,
}

embed_docs_job = dg.define_asset_job(
    "embed_docs", selection=[doc_embeddings.output_asset.key], partitions_def=DOC_SHARDS
)
complete_prompts_job = dg.define_asset_job(
    "complete_prompts",
    selection=[prompt_completions.output_asset.key],
    partitions_def=PROMPT_SHARDS,
)

JOBS = {
    "doc_embeddings": embed_docs_job,
    "prompt_completions": complete_prompts_job,
    "ticket_fields": extract_tickets_job,
    "passage_rerank": rerank_job,
    "image_embeddings": embed_images_job,
    "image_captions": caption_images_job,
}

# Per-partition polars statistics of the embeddings, materialized by the automation daemon
# whenever a partition of doc_embeddings updates (AutomationCondition.eager()).
doc_embedding_stats = embedding_stats_asset(doc_embeddings)

defs = dg.Definitions.merge(
    dg.Definitions(
        assets=[
            *doc_embeddings.assets,
            *prompt_completions.assets,
            *daily_note_embeddings.assets,
            *ticket_fields.assets,
            *passage_rerank.assets,
            *image_embeddings.assets,
            image_captions.output_asset,  # reads image_embeddings' input shards
            doc_embedding_stats,
        ],
        jobs=[
            embed_docs_job,
            complete_prompts_job,
            daily_embeddings_job,
            extract_tickets_job,
            rerank_job,
            embed_images_job,
            caption_images_job,
        ],
        schedules=[daily_embeddings_schedule],
        # What backfilling the missing partitions costs, on each output asset's page.
        sensors=[
            *(backfill_estimate_sensor(p) for p in PIPELINES.values()),
            # Engine pools (runs with launch="pool"): starts workers for queued work.
            pool_reconciler_sensor(),
        ],
        resources=resources_for_environment(),
    ),
    # ticket_embeddings: declared in YAML (assets/defs/ticket_embeddings/defs.yaml).
    load_yaml_pipelines(),
    # The OpenAI Batch API's pipelines: one per route, one partition per batch.
    batch_api.defs,
)
