"""The batch pipelines of a routing table, and the sensor that turns batches into runs.

One pipeline per route: `inference_assets` over a dynamic partitions definition
(`<pipeline>_batches`, one partition per batch id) reading OpenAI Batch input
(`<files root>/inputs/{partition_key}.jsonl`) and writing OpenAI Batch output. The sensor
(`batch_api_sensor`) reads the API's store for batches that are `in_progress` and not yet
running, adds each one's partition and requests one run for it (run key = batch id, so a
batch runs once however many ticks see it), tagged with the batch id, the tenant and the
tenant's Kueue LocalQueue. The daemon launches the run like any other: retries, lineage and
the UI come from Dagster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import dagster as dg

from dagster_gpuinfer.asset_factory import InferencePipeline, inference_assets
from dagster_gpuinfer.batch_api import settings
from dagster_gpuinfer.batch_api.files import FileBytes
from dagster_gpuinfer.batch_api.routing import Route, RoutingTable, routing_table
from dagster_gpuinfer.batch_api.tags import BATCH_ID_TAG, QUEUE_TAG, TENANT_TAG
from dagster_gpuinfer.spec import InputSpec


@dataclass(frozen=True)
class BatchPipelines:
    """The definitions serving a routing table: pass `defs` to `dagster.Definitions.merge`."""

    pipelines: dict[str, InferencePipeline]
    jobs: list[dg.UnresolvedAssetJobDefinition]
    sensor: dg.SensorDefinition

    @property
    def defs(self) -> dg.Definitions:
        assets = [a for pipeline in self.pipelines.values() for a in pipeline.assets]
        return dg.Definitions(assets=assets, jobs=self.jobs, sensors=[self.sensor])


def batch_run_tags(batch: Mapping[str, Any], kueue_queue: str | None) -> dict[str, str]:
    tags = {BATCH_ID_TAG: batch["id"], TENANT_TAG: batch["tenant"]}
    if kueue_queue:
        tags[QUEUE_TAG] = kueue_queue
    return tags


def batch_pipelines(
    routes: RoutingTable | list[Route | Mapping[str, Any]],
    *,
    files_root: str | None = None,
    store_url: str | None = None,
    group_name: str = "batch_api",
    retry_policy: dg.RetryPolicy | None = None,
    pool: str | None = None,
    minimum_interval_seconds: int = 5,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    launch: Literal["run", "pool"] = "run",
) -> BatchPipelines:
    """Build the batch pipelines of `routes` and their sensor.

    Every batch is its own run of one partition, the case engine pools are for: with
    `launch="pool"` twenty tenants' small batches on one model share warm engines instead
    of paying twenty engine builds. The default stays `run` because a pool needs a queue
    every step and pool worker reaches (`GpuInferenceResource.pool.queue`: PostgreSQL on a
    cluster; the SQLite default serves one host only), which the deployment must set up;
    a deployment that has it passes `launch="pool"`, and a route may choose for itself
    (`Route.launch`).

    Args:
        routes: The routing table the API service validates batches against.
        files_root: Where the API keeps files and the pipelines read and write; default
            `GPUINFER_BATCH_FILES_ROOT`.
        store_url: The API's metadata store; default `GPUINFER_BATCH_STORE_URL` (read when
            the sensor ticks, so the code location loads without a database).
        group_name, retry_policy, pool: passed to every pipeline's output asset.
        launch: `run` or `pool` for the routes that do not set `Route.launch`.
        minimum_interval_seconds, default_status: of the sensor.
    """
    table = routing_table(routes)
    files = FileBytes(files_root or settings.files_root(), settings.storage_options())
    pipelines: dict[str, InferencePipeline] = {}
    jobs = []
    for route in table.routes:
        partitions = dg.DynamicPartitionsDefinition(name=route.partitions_name)
        pipeline = inference_assets(
            name=route.pipeline,
            model=route.model_path,
            served_model_name=route.model,  # output lines name the requested model
            lora_adapters=dict(route.lora_adapters),  # lines naming them run on them
            task=route.task,  # type: ignore[arg-type]
            input=InputSpec(
                uri=files.input_template,
                format="openai_batch",
                **({"images": route.images} if route.images is not None else {}),
            ),
            input_asset_key=f"{route.pipeline}_input",
            output_root=files.output_root,
            output_format="openai_batch",
            partitions_def=partitions,
            engine=route.engine,
            sampling=route.sampling,
            chunk_size=route.chunk_size,
            row_reuse=route.row_reuse,
            row_reuse_scope=route.row_reuse_scope,
            retry_policy=retry_policy,
            pool=pool,
            launch=route.launch or launch,
            group_name=group_name,
            description=f"OpenAI batches of model {route.model!r} on {route.endpoint} "
            "(one partition per batch)",
        )
        pipelines[route.pipeline] = pipeline
        jobs.append(
            dg.define_asset_job(
                route.job_name,
                selection=[pipeline.output_asset.key],
                partitions_def=partitions,
                tags={"gpuinfer/batch_pipeline": route.pipeline},
            )
        )

    @dg.sensor(
        name="batch_api_sensor",
        jobs=jobs,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Requests one run per batch created through the batch API",
    )
    def batch_api_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        return _queue_batches(context, table, store_url)

    return BatchPipelines(pipelines=pipelines, jobs=jobs, sensor=batch_api_sensor)


def _queue_batches(
    context: dg.SensorEvaluationContext, table: RoutingTable, store_url: str | None
) -> dg.SensorResult:
    from dagster_gpuinfer.batch_api.store import BatchStore, now

    store = BatchStore(store_url or settings.store_url())
    try:
        pending = store.batches_in(["in_progress"])
        queues = {batch["tenant"]: store.tenant_queue(batch["tenant"]) for batch in pending}
    finally:
        store.close()
    new_partitions: dict[str, list[str]] = {}
    run_requests = []
    for batch in pending:
        route = table.by_pipeline(batch["pipeline"] or "")
        if route is None or batch["expires_at"] <= now():
            continue
        if not context.instance.has_dynamic_partition(route.partitions_name, batch["id"]):
            new_partitions.setdefault(route.partitions_name, []).append(batch["id"])
        run_requests.append(
            dg.RunRequest(
                run_key=batch["id"],
                job_name=route.job_name,
                partition_key=batch["id"],
                tags=batch_run_tags(batch, queues[batch["tenant"]]),
            )
        )
    return dg.SensorResult(
        run_requests=run_requests,
        dynamic_partitions_requests=[
            dg.AddDynamicPartitionsRequest(partitions_def_name=name, partition_keys=keys)
            for name, keys in new_partitions.items()
        ],
    )
