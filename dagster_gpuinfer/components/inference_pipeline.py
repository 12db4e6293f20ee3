"""`InferencePipelineComponent`: an inference pipeline declared in YAML, no Python.

In a defs folder, `defs.yaml`::

    type: dagster_gpuinfer.components.InferencePipelineComponent
    attributes:
      name: ticket_embeddings
      model: /models/all-MiniLM-L6-v2
      task: embed
      input:
        uri: s3://tickets/in/{partition_key}.jsonl
        text_column: body
      output_root: s3://tickets/out
      partitioning:
        type: dynamic            # static (keys: [...]) | dynamic | daily (start_date: ...)
      arrival_sensor:
        glob: "*.jsonl"
      engine:
        dtype: float16
        max_model_len: 512
      tensor_parallel_size: 1
      replicas: 2
      max_partitions_per_run: 8
      launch: run                # or pool: warm engines shared across runs
      resource:                  # optional: this pipeline's own GpuInferenceResource
        launcher: k8s

builds the same definitions as `inference_assets(...)` (plus `arrival_sensor(...)` or a
daily schedule) would in Python. Without `resource`, the pipeline uses the code location's
`GpuInferenceResource` under `resource_key` (default `gpu`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import dagster as dg
from pydantic import Field, ValidationError, create_model

from dagster_gpuinfer.arrivals import SplitLargeFiles
from dagster_gpuinfer.asset_factory import InferencePipeline, inference_assets, recompute_stale
from dagster_gpuinfer.resource import GpuInferenceResource, InvalidInferenceSpec
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.spec import InferenceSpec, Task, pipeline_fields

# The attribute models are `Resolvable` too: Dagster then checks their `Field` constraints
# while it reads the YAML, and its error names the attribute and the YAML line.


class StaticPartitioning(dg.Resolvable, dg.Model):
    """One partition per listed key (shard)."""

    type: Literal["static"]
    keys: list[str] = Field(description="The partition keys, one per input shard.")


class DynamicPartitioning(dg.Resolvable, dg.Model):
    """Partitions registered at run time, usually by the arrival sensor."""

    type: Literal["dynamic"]
    name: str | None = Field(
        None, description="Name of the DynamicPartitionsDefinition; defaults to the pipeline name."
    )


class DailyPartitioning(dg.Resolvable, dg.Model):
    """One partition per day (`YYYY-MM-DD` in the input uri), with a nightly schedule."""

    type: Literal["daily"]
    start_date: str = Field(description="First day, YYYY-MM-DD.")
    timezone: str = Field("UTC", description="Timezone of the day boundaries.")
    schedule_hour: Annotated[int, Field(ge=0, le=23)] | None = Field(
        1, description="Hour (0-23) the nightly schedule runs; null for no schedule."
    )
    schedule_running: bool = Field(False, description="Start the schedule running.")


class ArrivalSensorSettings(dg.Resolvable, dg.Model):
    """Watch the input prefix and register each new file as a partition."""

    glob: str = Field("*", description="fnmatch pattern on file names under the prefix.")
    launch: Literal["backfill", "runs"] = Field(
        "backfill", description="backfill: runs of max_partitions_per_run; runs: one per file."
    )
    max_new_files_per_tick: int = Field(
        10_000, ge=1, description="New files registered per tick; more wait for the next."
    )
    minimum_interval_seconds: int = Field(30, ge=1, description="Seconds between ticks.")
    running: bool = Field(False, description="Start the sensor running.")
    split_min_bytes: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Split files at least this large into row or byte ranges."
    )
    jsonl_bytes_per_partition: int = Field(
        128 * 1024 * 1024, ge=1, description="Bytes per partition of a split JSONL file."
    )
    parquet_rows_per_partition: int = Field(
        200_000, ge=1, description="Rows per partition of a split Parquet file (whole groups)."
    )


# The YAML attribute is `model`, vLLM's own name for it. As a pydantic field (declared on
# `_PipelineAttributes`, so pydantic raises no shadowing warning) it shadows the classmethod
# `Resolvable.model()` on instances only; Dagster calls that classmethod on the class, where
# it stays intact (the component tests load YAML through it).


class _PipelineAttributes(dg.Model):
    """The component's own attributes; the spec's pipeline settings follow them."""

    name: str = Field(description="Output asset name (and its folder under output_root).")
    model: str = Field(description="Model directory (or hub id) vLLM loads.")
    task: Task = Field(description=InferenceSpec.model_fields["task"].description)
    input: dict[str, Any] = Field(
        description="InputSpec fields: uri (template with {partition_key}), format, id_column, "
        "text_column, text_pair_column, messages_column, params_column."
    )
    output_root: str = Field(description="Local directory or s3://bucket/prefix for outputs.")
    output_format: Literal["parquet", "openai_batch"] = "parquet"
    partitioning: StaticPartitioning | DynamicPartitioning | DailyPartitioning = Field(
        description="static (keys), dynamic (name) or daily (start_date) partitions."
    )
    engine: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments by vLLM name (EngineArgs)."
    )
    sampling: dict[str, Any] | None = Field(
        None, description="vLLM sampling parameters by vLLM name (generate, chat)."
    )
    max_error_rate: float = Field(
        0.10, ge=0, le=1, description="Error-rate check threshold, 0 to 1."
    )
    max_invalid_output_rate: float = Field(
        0.0, ge=0, le=1, description="generate/chat: structured-output check threshold, 0 to 1."
    )
    max_partitions_per_run: int = Field(
        4, ge=1, description="Backfill policy: partitions (shards) per run; one model load each."
    )
    pool: str | None = Field(None, description="Dagster concurrency pool capping GPU runs.")
    launch: Literal["run", "pool"] = Field(
        "run",
        description="run: each run starts its own worker and engine (backfills of many "
        "partitions per run). pool: runs send their partitions to the model's engine pool, "
        "whose warm workers serve every run (arrival sensors, schedules, small runs). A run "
        "may override it in its config (`launch`).",
    )
    observe_cron: str | None = Field(
        None,
        description="Observe the input shards' versions on this cron (the automation daemon); "
        "a partition whose shard changed then shows as stale.",
    )
    recompute_stale: bool = Field(
        False,
        description="Materialize exactly the stale partitions (a shard with a new version, "
        "or every partition after a spec change) with the automation daemon.",
    )
    group_name: str | None = None
    input_asset_key: str | None = Field(None, description="Defaults to <name>_input.")
    arrival_sensor: ArrivalSensorSettings | None = Field(
        None, description="Register new input files as partitions (dynamic partitioning only)."
    )
    resource_key: str = Field("gpu", description="Key of the GpuInferenceResource to use.")
    sink: dict[str, Any] | None = Field(
        None,
        description="Also replace each committed partition in a sink (PgVectorSink fields: "
        "url_env, the name of the variable holding the database URL; table; index; "
        "distance).",
    )
    resource: dict[str, Any] | None = Field(
        None,
        description="GpuInferenceResource fields (launcher, engine_overrides, env, s3_...) for "
        "this pipeline alone; it is bound under `gpuinfer_<name>`.",
    )


def settings_model(
    base: type[dg.Model], spec_model: type[InferenceSpec] = InferenceSpec
) -> type[dg.Model]:
    """`base` plus one attribute per pipeline setting of `spec_model` (`pipeline_fields`:
    tensor_parallel_size, replicas, chunk_size, max_requests_in_flight, group_prefixes, ...),
    with the spec's own type, default, bounds and description."""
    fields = {name: (info.annotation, info) for name, info in pipeline_fields(spec_model).items()}
    return create_model(f"{base.__name__}WithSettings", __base__=base, **fields)


class InferencePipelineComponent(dg.Component, dg.Resolvable, settings_model(_PipelineAttributes)):
    """A batch inference pipeline with vLLM: an input shard asset, an inference output asset
    with row-balance and error-rate checks, and optionally an arrival sensor or a schedule.

    Its attributes are its own (name, partitioning, sensor, resource, ...) plus every
    pipeline setting of the job spec, derived from `InferenceSpec` (`settings_model`)."""

    # ------------------------------------------------------------------ python API

    def partitions_def(self) -> dg.PartitionsDefinition:
        part = self.partitioning
        if isinstance(part, StaticPartitioning):
            return dg.StaticPartitionsDefinition(part.keys)
        if isinstance(part, DynamicPartitioning):
            return dg.DynamicPartitionsDefinition(name=part.name or self.name)
        return dg.DailyPartitionsDefinition(start_date=part.start_date, timezone=part.timezone)

    def effective_resource_key(self) -> str:
        return f"gpuinfer_{self.name}" if self.resource is not None else self.resource_key

    def build_pipeline(self) -> InferencePipeline:
        return inference_assets(
            name=self.name,
            model=self.model,
            task=self.task,
            input=self.input,
            output_root=self.output_root,
            partitions_def=self.partitions_def(),
            input_asset_key=self.input_asset_key,
            output_format=self.output_format,
            engine=self.engine,
            sampling=self.sampling,
            max_error_rate=self.max_error_rate,
            max_invalid_output_rate=self.max_invalid_output_rate,
            backfill_policy=dg.BackfillPolicy.multi_run(
                max_partitions_per_run=self.max_partitions_per_run
            ),
            pool=self.pool,
            observe_cron=self.observe_cron,
            automation_condition=recompute_stale() if self.recompute_stale else None,
            group_name=self.group_name,
            resource_key=self.effective_resource_key(),
            sink=self.sink,
            launch=self.launch,
            **{name: getattr(self, name) for name in pipeline_fields()},
        )

    # ------------------------------------------------------------------ dg

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        where = f"InferencePipelineComponent {self.name!r} ({context.path})"
        try:
            pipeline = self.build_pipeline()
        except InvalidInferenceSpec as exc:
            raise dg.DagsterInvalidDefinitionError(f"{where}: {exc}") from None
        sensors: list[dg.SensorDefinition] = []
        schedules: list[Any] = []
        jobs: list[Any] = []
        resources: dict[str, Any] = {}
        if self.resource is not None:
            try:
                resources[self.effective_resource_key()] = GpuInferenceResource(**self.resource)
            except (ValidationError, TypeError) as exc:
                raise dg.DagsterInvalidDefinitionError(
                    f"{where}: `resource` is not a valid GpuInferenceResource: {exc}"
                ) from None
        if self.arrival_sensor is not None:
            if not isinstance(self.partitioning, DynamicPartitioning):
                raise dg.DagsterInvalidDefinitionError(
                    f"{where}: arrival_sensor registers partitions, so it needs "
                    f"`partitioning: {{type: dynamic}}`, not {self.partitioning.type!r}"
                )
            settings = self.arrival_sensor
            sensors.append(
                arrival_sensor(
                    pipeline,
                    glob=settings.glob,
                    launch=settings.launch,
                    max_new_files_per_tick=settings.max_new_files_per_tick,
                    minimum_interval_seconds=settings.minimum_interval_seconds,
                    default_status=dg.DefaultSensorStatus.RUNNING
                    if settings.running
                    else dg.DefaultSensorStatus.STOPPED,
                    split=SplitLargeFiles(
                        min_bytes=settings.split_min_bytes,
                        jsonl_bytes_per_partition=settings.jsonl_bytes_per_partition,
                        parquet_rows_per_partition=settings.parquet_rows_per_partition,
                    )
                    if settings.split_min_bytes
                    else None,
                    resource_key=self.effective_resource_key(),
                )
            )
        if (
            isinstance(self.partitioning, DailyPartitioning)
            and self.partitioning.schedule_hour is not None
        ):
            job = dg.define_asset_job(
                f"{self.name}_daily",
                selection=[pipeline.output_asset.key],
                partitions_def=pipeline.output_asset.partitions_def,
            )
            jobs.append(job)
            schedules.append(
                dg.build_schedule_from_partitioned_job(
                    job,
                    hour_of_day=self.partitioning.schedule_hour,
                    minute_of_hour=0,
                    default_status=dg.DefaultScheduleStatus.RUNNING
                    if self.partitioning.schedule_running
                    else dg.DefaultScheduleStatus.STOPPED,
                )
            )
        return dg.Definitions(
            assets=pipeline.assets,
            sensors=sensors,
            schedules=schedules,
            jobs=jobs,
            resources=resources,
        )
