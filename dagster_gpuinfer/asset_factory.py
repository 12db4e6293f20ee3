"""`inference_assets`: declare an input shard asset and its inference output asset.

The two share one partitions definition (one partition per shard). The output asset's run
launches one worker for all partitions of the run, so a multi-run backfill policy of K
partitions per run loads the model once per K shards.
"""

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, NoReturn

import dagster as dg
from pydantic import Field, create_model

from dagster_gpuinfer.checks import ERROR_RATE, ROWS_BALANCED, VALID_OUTPUT, check_results
from dagster_gpuinfer.metadata import (
    PARTITION_FIGURES,
    partition_metadata,
    pool_metadata,
    run_metadata,
)
from dagster_gpuinfer.resource import (
    GpuInferenceResource,
    InferenceRunResult,
    InvalidInferenceSpec,
    Launch,
    validate_spec,
)
from dagster_gpuinfer.sinks import sink_settings
from dagster_gpuinfer.sinks.delta import DeltaSink
from dagster_gpuinfer.sinks.materialize import sink_partitions
from dagster_gpuinfer.sinks.pgvector import PgVectorSink, sink_layout
from dagster_gpuinfer.spec import (
    EngineArgs,
    InferenceSpec,
    InputSpec,
    SamplingParams,
    Task,
    pipeline_fields,
    run_config_fields,
)
from dagster_gpuinfer.storage import input_version, model_version
from dagster_gpuinfer.task_table import task_facts

DEFAULT_PARTITIONS_PER_RUN = 4


def fail_partitions(
    context: dg.AssetExecutionContext,
    result: InferenceRunResult,
    spec: InferenceSpec,
    sunk: Mapping[str, Mapping[str, Any]],
) -> NoReturn:
    """Materialize the committed partitions of a run in which some shards failed, then fail
    the step naming the failed ones (not retried: the input must be fixed).

    A ranged run can materialize some partitions and fail the others: the backfill counts
    each partition by its own materialization, so a re-run of the failed partitions redoes
    only those, and the committed ones stay done.
    """
    for key, manifest in result.manifests.items():
        context.log_event(
            dg.AssetMaterialization(
                asset_key=context.asset_key,
                partition=key,
                metadata={
                    **partition_metadata(
                        result.spec or spec, manifest, computed=key in result.computed
                    ),
                    **pool_metadata(result, key),
                    **sunk.get(key, {}),
                },
            )
        )
    failures = "; ".join(
        f"partition {key!r}: {info['error_type']}: {info['message']}"
        for key, info in sorted(result.failed.items())
    )
    raise dg.Failure(
        description=(
            f"{len(result.failed)} of {len(result.failed) + len(result.manifests)} partitions "
            f"could not be processed ({failures}). The other {len(result.manifests)} were "
            "committed and materialized. Not retried: fix the input or the spec, then re-run "
            "the failed partitions."
        ),
        metadata={
            "failed_partitions": dg.MetadataValue.json(result.failed),
            "committed_partitions": sorted(result.manifests),
        },
        allow_retries=False,
    )


def asset_code_version(spec: InferenceSpec) -> str:
    """The inference asset's `code_version`: the spec's (`InferenceSpec.code_version`), and
    where the code location can see a local model folder, its files' version too (weights,
    tokenizer and chat template: `storage.model_version`), read when the definitions load.
    A folder seen only by the pods (their model cache) leaves it out: a change there is
    still recomputed by the next run (the worker checks it), but not shown as stale."""
    version = spec.code_version()
    try:
        files = model_version(spec)
    except FileNotFoundError:
        return version
    return version if files is None else f"{version}-{files.rsplit(':', 1)[-1]}"


def recompute_stale() -> dg.AutomationCondition:
    """An output asset's automation condition that materializes exactly its stale
    partitions: those whose shard got a new version in an observation of the input asset
    (`observe_cron`), and every partition once the asset's code version (the spec) changes.
    Never while the partition or its shard is in progress, never a partition whose shard is
    missing; each change is acted on once.

    Examples:
        >>> inference_assets(..., observe_cron="*/15 * * * *",
        ...                  automation_condition=recompute_stale())
    """
    return (
        (
            dg.AutomationCondition.any_deps_updated()
            | dg.AutomationCondition.code_version_changed()
        ).since_last_handled()
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    ).with_label("recompute stale partitions")


def default_backfill_policy() -> dg.BackfillPolicy:
    """Several shards per run: the model loads once for them (and once per run)."""
    return dg.BackfillPolicy.multi_run(max_partitions_per_run=DEFAULT_PARTITIONS_PER_RUN)


class LaunchMode(StrEnum):
    """`launch` in a run's config (Dagster config takes enums, not literals)."""

    run = "run"
    pool = "pool"


class _RunOverrides(dg.Config):
    """Per-run overrides, editable in the launchpad; unset fields keep the pipeline's.

    The fields are derived from the spec models (`spec.run_config_fields`): every pipeline
    setting, engine and sampling field but those a run may not change (`NOT_PER_RUN`),
    plus `launch`, which is how the run reaches a worker, not part of the spec (it leaves
    the spec hash, and so the committed chunks, as they are).
    """

    SPEC_MODEL: ClassVar[type[InferenceSpec]] = InferenceSpec

    launch: LaunchMode | None = Field(
        None,
        description="run: this run starts its own worker (engine build included). pool: its "
        "partitions go to the model's engine pool, served by warm workers shared across "
        "runs. Unset: the pipeline's `launch`.",
    )

    def apply(self, raw_spec: dict[str, Any]) -> dict[str, Any]:
        """The spec with the fields this run sets replaced."""
        spec = dict(raw_spec)
        spec["engine"] = dict(raw_spec["engine"])
        spec["sampling"] = dict(raw_spec["sampling"])
        for run_name, (section, name, _) in run_config_fields(self.SPEC_MODEL).items():
            value = getattr(self, run_name, None)
            if value is not None:
                (spec[section] if section else spec)[name] = value
        return spec


def run_config_model(spec_model: type[InferenceSpec] = InferenceSpec) -> type[_RunOverrides]:
    """The launchpad config class of `spec_model`: one optional field per run setting."""
    fields: dict[str, Any] = {}
    for run_name, (section, name, info) in run_config_fields(spec_model).items():
        where = f"{section}.{name}" if section else name
        about = f"{where}: {info.description}" if info.description else where
        fields[run_name] = (info.annotation | None, Field(None, description=about))
    model = create_model(
        "InferenceRunConfig", __base__=_RunOverrides, __module__=__name__, **fields
    )
    model.SPEC_MODEL = spec_model
    return model


InferenceRunConfig = run_config_model()


@dataclass(frozen=True)
class InferencePipeline:
    """The definitions of one pipeline: pass `assets` to `dagster.Definitions`.

    `input_asset` is an observable source asset: observing it records each shard's version
    as the partition's data version (`observe_shard_versions`); the output asset carries
    the spec's `code_version`, so Dagster marks a partition stale when its shard or the
    output-shaping spec changed since it was materialized.
    """

    input_asset: dg.SourceAsset
    output_asset: dg.AssetsDefinition
    spec: dict[str, Any]

    @property
    def assets(self) -> list[dg.SourceAsset | dg.AssetsDefinition]:
        return [self.input_asset, self.output_asset]


# Settings the raw spec always names (the asset's `gpuinfer/spec` metadata shows them); the
# other pipeline settings appear only when they differ from the spec's default.
ALWAYS_NAMED = ("tensor_parallel_size", "replicas", "chunk_size")


def pipeline_spec(
    *,
    name: str,
    model: str,
    task: str,
    input: Any,
    output: dict[str, Any],
    engine: Any,
    sampling: Any,
    settings: Mapping[str, Any],
    limits: Any = None,
) -> dict[str, Any]:
    """The raw spec of a pipeline (before a run adds its partitions), as JSON-ready dicts.

    Raises:
        TypeError: a setting that is not a pipeline setting of `InferenceSpec`.
    """
    known = pipeline_fields()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise TypeError(
            f"inference_assets() got unknown settings {unknown} for asset {name!r}; the "
            f"pipeline settings of InferenceSpec are {sorted(known)}"
        )

    def as_dict(value: Any) -> Any:
        return value.model_dump(mode="json") if hasattr(value, "model_dump") else dict(value or {})

    raw_spec: dict[str, Any] = {
        "model": model,
        "task": task,
        "engine": as_dict(engine),
        "sampling": as_dict(sampling),
        "input": as_dict(input),
        "output": output,
    }
    for setting, value in settings.items():
        if setting in ALWAYS_NAMED or value != known[setting].default:
            raw_spec[setting] = value
    if limits is not None:  # a nested model, like engine and sampling
        raw_spec["limits"] = as_dict(limits)
    return raw_spec


def check_specs(
    output_key: dg.AssetKey, *, max_error_rate: float, max_invalid_output_rate: float | None
) -> list[dg.AssetCheckSpec]:
    """The output asset's checks: rows balanced, error rate, and (generation tasks, where
    `max_invalid_output_rate` is set) valid structured output."""
    specs = [
        dg.AssetCheckSpec(
            ROWS_BALANCED,
            asset=output_key,
            description="rows_in == rows_out + rows_errored, from the files",
        ),
        dg.AssetCheckSpec(
            ERROR_RATE,
            asset=output_key,
            description=f"quarantined rows at most {max_error_rate:.0%}",
        ),
    ]
    if max_invalid_output_rate is not None:
        specs.append(
            dg.AssetCheckSpec(
                VALID_OUTPUT,
                asset=output_key,
                description="outputs failing their structured-output constraint (JSON "
                f"schema, regex, choice) at most {max_invalid_output_rate:.0%}",
            )
        )
    return specs


def materialize_run(
    context: dg.AssetExecutionContext,
    raw_spec: dict[str, Any],
    *,
    name: str,
    resource_key: str,
    max_error_rate: float,
    max_invalid_output_rate: float | None,
    sink: PgVectorSink | DeltaSink | None = None,
    launch: Launch = "run",
) -> dg.MaterializeResult:
    """The output asset's body: run the worker over the run's partitions (`launch`: a
    worker of this run, or the engine pool), send the committed ones to the sink (if any),
    then give each partition its own figures first and the run's (`run_*`) after them."""
    gpu: GpuInferenceResource = getattr(context.resources, resource_key)
    run_spec = dict(raw_spec, partition_keys=list(context.partition_keys))
    try:
        spec = validate_spec(run_spec, where=f"asset {name!r}")
    except ValueError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    result = gpu.run_inference(context=context, spec=spec, launch=launch)
    sunk = sink_partitions(sink, result.spec or spec, result.manifests)
    if result.failed:
        fail_partitions(context, result, spec, sunk)
    shared = run_metadata(result)
    for key, manifest in result.manifests.items():
        # Metadata given to MaterializeResult would be listed above every partition's own.
        own = partition_metadata(result.spec or spec, manifest, computed=key in result.computed)
        own.update(pool_metadata(result, key))
        context.add_asset_metadata({**own, **sunk.get(key, {}), **shared}, partition_key=key)
    return dg.MaterializeResult(
        check_results=check_results(
            result, max_error_rate=max_error_rate, max_invalid_output_rate=max_invalid_output_rate
        ),
    )


def inference_assets(
    *,
    name: str,
    model: str,
    task: Task,
    input: InputSpec | Mapping[str, Any],
    output_root: str,
    partitions_def: dg.PartitionsDefinition,
    input_asset_key: str | Sequence[str] | dg.AssetKey | None = None,
    output_format: str = "parquet",
    engine: EngineArgs | Mapping[str, Any] | None = None,
    sampling: SamplingParams | Mapping[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    replicas: int = 1,
    pipeline_parallel_size: int = 1,
    nodes: int = 1,
    chunk_size: int = 512,
    max_requests_in_flight: int | None = None,
    group_prefixes: bool = True,
    limits: Mapping[str, Any] | Any | None = None,
    max_error_rate: float = 0.10,
    max_invalid_output_rate: float = 0.0,
    backfill_policy: dg.BackfillPolicy | None = None,
    retry_policy: dg.RetryPolicy | None = None,
    pool: str | None = None,
    op_tags: Mapping[str, Any] | None = None,
    automation_condition: dg.AutomationCondition | None = None,
    observe_cron: str | None = None,
    group_name: str | None = None,
    key_prefix: Sequence[str] | str | None = None,
    resource_key: str = "gpu",
    description: str | None = None,
    sink: PgVectorSink | DeltaSink | Mapping[str, Any] | None = None,
    launch: Launch = "run",
    **spec_fields: Any,
) -> InferencePipeline:
    """Declare a batch inference pipeline as two partitioned assets.

    Args:
        name: The output asset's name (also its folder under `output_root`).
        model: A model directory (or hub id) vLLM can load.
        task: `embed`, `generate`, `chat`, `score`, `classify`, `image_embed`,
            `vision_generate` or `vision_chat`.
        input: Where shards are: `InputSpec(uri="data/{partition_key}.parquet", ...)`.
        output_root: Local directory or `s3://bucket/prefix` for outputs.
        partitions_def: One partition per shard; shared by input and output assets.
        input_asset_key: Key of the input shard asset; defaults to `<name>_input`.
        output_format: `parquet` or `openai_batch`.
        engine: vLLM engine arguments, by vLLM name.
        sampling: vLLM sampling parameters (generate, chat).
        tensor_parallel_size: GPUs per engine.
        replicas: Data-parallel engines per worker.
        pipeline_parallel_size: Pipeline stages per engine (vLLM's name).
        nodes: Pods one engine spans (vLLM's `nnodes`); above 1 the k8s launcher runs a
            gang of pods (`k8s.group`): a leader worker and vLLM-headless followers.
        chunk_size: Rows per chunk (the unit of writing, commit and resume).
        max_requests_in_flight: Requests each engine keeps in flight across chunks and
            shards; default 2 x the engine's `max_num_seqs` (for experts).
        group_prefixes: Submit generation rows grouped by shared prompt prefix where that
            brings whole KV blocks of shared prefix together (else in input order).
        limits: Bounds on one row (`RowLimits`: line bytes, prompt characters, JSON depth,
            `n`, `n` x `top_logprobs`); a row past one is quarantined. Default: RowLimits().
        max_error_rate: Quarantined share of rows above which the error-rate check fails.
        max_invalid_output_rate: generate/chat: share of outputs failing their structured-output
            constraint above which the `valid_structured_output` check fails.
        backfill_policy: Dagster's; defaults to multi-run with 4 partitions per run.
        automation_condition: The output asset's, as Dagster's; `recompute_stale()`
            materializes exactly the partitions whose shard or spec changed.
        observe_cron: The automation daemon observes the input shards on this cron (their
            versions become the input partitions' data versions); None: observed on demand
            (the UI's "Observe", or a job that selects the input asset).
        retry_policy, pool, op_tags, group_name, key_prefix: passed to `@dg.asset` as is.
        resource_key: Resource key of the `GpuInferenceResource`.
        description: Asset description; a note on what the partition figures mean is added
            below it (`metadata.PARTITION_FIGURES`), so each partition lists numbers only.
        sink: Where each committed partition also goes, replaced whole in one transaction
            (`PgVectorSink(url_env=..., table=...)`) or one Delta commit
            (`DeltaSink(uri=...)`); the files stay the record of commits.
        launch: `run` (default): each run starts its own worker and builds its engine, the
            right shape for backfills of many partitions per run. `pool`: the run's
            partitions go to the engine pool of its model (`GpuInferenceResource.pool`),
            whose warm workers serve every run on that model: the shape for arrival
            sensors' and schedules' small runs. A run may override it (run config
            `launch`); it is not part of the spec, so switching keeps committed chunks.
        **spec_fields: Any other pipeline setting of `InferenceSpec` by its name
            (`spec.pipeline_fields`), so a setting added to the spec is settable here too.

    Returns:
        The input asset spec and the output assets definition.

    Raises:
        InvalidInferenceSpec: the spec does not validate (names the field).

    Examples:
        >>> pipeline = inference_assets(
        ...     name="doc_embeddings", model="/models/minilm", task="embed",
        ...     input=InputSpec(uri="data/docs/{partition_key}.parquet"),
        ...     output_root="out", partitions_def=dg.StaticPartitionsDefinition(["a", "b"]),
        ... )
        >>> defs = dg.Definitions(assets=pipeline.assets, resources={"gpu": GpuInferenceResource()})
    """
    # The pipeline settings named as parameters above, then any other by its name.
    named = {key: value for key, value in locals().items() if key in pipeline_fields()}
    raw_spec = pipeline_spec(
        name=name,
        model=model,
        task=task,
        input=input,
        output={"root": output_root, "asset_name": name, "format": output_format},
        engine=engine,
        sampling=sampling,
        limits=limits,
        settings={**named, **spec_fields},
    )
    spec = validate_spec(raw_spec, where=f"asset {name!r}")
    sink = validate_sink(sink, spec, where=f"asset {name!r}")
    prefix = [key_prefix] if isinstance(key_prefix, str) else list(key_prefix or [])
    shared = dict(partitions_def=partitions_def, group_name=group_name, resource_key=resource_key)
    input_spec = _input_asset(
        raw_spec,
        name=name,
        prefix=prefix,
        input_asset_key=input_asset_key,
        observe_cron=observe_cron,
        **shared,
    )
    output_asset = _output_asset(
        raw_spec,
        code_version=asset_code_version(spec),
        output_key=dg.AssetKey([*prefix, name]),
        input_spec=input_spec,
        backfill_policy=backfill_policy,
        retry_policy=retry_policy,
        pool=pool,
        op_tags=op_tags,
        automation_condition=automation_condition,
        description=description,
        max_error_rate=max_error_rate,
        max_invalid_output_rate=max_invalid_output_rate,
        sink=sink,
        launch=launch,
        **shared,
    )
    return InferencePipeline(input_asset=input_spec, output_asset=output_asset, spec=raw_spec)


def validate_sink(
    sink: PgVectorSink | DeltaSink | Mapping[str, Any] | None, spec: InferenceSpec, *, where: str
) -> PgVectorSink | DeltaSink | None:
    """The pipeline's sink, checked against its task and output format.

    Raises:
        InvalidInferenceSpec: the sink's settings are wrong, or it cannot take these outputs.
    """
    if sink is None:
        return None
    try:
        checked = sink_settings(sink)
        sink_layout(spec.task)
    except ValueError as exc:
        raise InvalidInferenceSpec(f"{where}: sink: {exc}") from None
    if spec.output.format != "parquet":
        raise InvalidInferenceSpec(
            f"{where}: sink: the {checked.describe()} sink reads Parquet outputs; set "
            f"output_format='parquet' (not {spec.output.format!r})"
        )
    return checked


def asset_description(text: str) -> str:
    """The output asset's description: `text`, then what its partition figures mean."""
    return f"{text}\n\n{PARTITION_FIGURES}"


# Shard versions read at once when the input asset is observed (one HEAD each on S3).
OBSERVE_THREADS = 16


def observe_shard_versions(
    spec: InferenceSpec, partition_keys: Sequence[str]
) -> dg.DataVersionsByPartition:
    """Each partition's shard version (`storage.input_version`: the S3 ETag, or size, mtime
    and inode on disk) as its Dagster data version; a partition whose shard is not there
    (yet) gets none."""

    def version(key: str) -> str | None:
        try:
            return input_version(spec, key)
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(max_workers=OBSERVE_THREADS) as pool:
        found = dict(zip(partition_keys, pool.map(version, partition_keys), strict=True))
    return dg.DataVersionsByPartition(
        {key: dg.DataVersion(value) for key, value in found.items() if value is not None}
    )


def _input_asset(
    raw_spec: dict[str, Any],
    *,
    name: str,
    prefix: list[str],
    input_asset_key: str | Sequence[str] | dg.AssetKey | None,
    partitions_def: dg.PartitionsDefinition,
    group_name: str | None,
    resource_key: str,
    observe_cron: str | None,
) -> dg.SourceAsset:
    """The input shards of pipeline `name`, one file per partition, as an observable source
    asset: an observation records every shard's version (`observe_shard_versions`)."""
    input_uri = raw_spec["input"]["uri"]
    input_key = (
        dg.AssetKey.from_coercible(input_asset_key)
        if input_asset_key is not None
        else dg.AssetKey([*prefix, f"{name}_input"])
    )
    kind = "parquet" if input_uri.endswith(".parquet") else "json"

    @dg.observable_source_asset(
        key=input_key,
        partitions_def=partitions_def,
        group_name=group_name,
        description=f"Input shards of {name}: one file per partition at {input_uri}. "
        "Observe it to record each shard's version (S3 ETag, or size and mtime on disk): a "
        "partition of the output whose shard changed since it was materialized shows as stale.",
        metadata={"uri_template": input_uri},
        tags={f"dagster/kind/{kind}": ""},
        required_resource_keys={resource_key},
        automation_condition=(
            dg.AutomationCondition.cron_tick_passed(observe_cron) if observe_cron else None
        ),
    )
    def _shards(context) -> dg.DataVersionsByPartition:
        gpu: GpuInferenceResource = getattr(context.resources, resource_key)
        spec = gpu.prepare_spec(InferenceSpec.model_validate(raw_spec))
        keys = partitions_def.get_partition_keys(dynamic_partitions_store=context.instance)
        return observe_shard_versions(spec, keys)

    return _shards


def _output_asset(
    raw_spec: dict[str, Any],
    *,
    code_version: str,
    output_key: dg.AssetKey,
    input_spec: dg.SourceAsset,
    partitions_def: dg.PartitionsDefinition,
    backfill_policy: dg.BackfillPolicy | None,
    retry_policy: dg.RetryPolicy | None,
    pool: str | None,
    op_tags: Mapping[str, Any] | None,
    automation_condition: dg.AutomationCondition | None,
    group_name: str | None,
    resource_key: str,
    description: str | None,
    max_error_rate: float,
    max_invalid_output_rate: float,
    sink: PgVectorSink | DeltaSink | None = None,
    launch: Launch = "run",
) -> dg.AssetsDefinition:
    """The inference output asset of a pipeline whose raw spec is `raw_spec`."""
    name, model, task = output_key.path[-1], raw_spec["model"], raw_spec["task"]
    generates = task_facts(task).samples
    invalid_rate = max_invalid_output_rate if generates else None
    output_format = raw_spec["output"]["format"]

    @dg.asset(
        key=output_key,
        deps=[input_spec],
        partitions_def=partitions_def,
        code_version=code_version,
        backfill_policy=backfill_policy or default_backfill_policy(),
        retry_policy=retry_policy,
        pool=pool,
        op_tags=op_tags,
        automation_condition=automation_condition,
        group_name=group_name,
        required_resource_keys={resource_key},
        check_specs=check_specs(
            output_key, max_error_rate=max_error_rate, max_invalid_output_rate=invalid_rate
        ),
        kinds={"vllm", output_format if output_format == "parquet" else "json"},
        description=asset_description(
            description or f"{task} with {model} over {input_spec.key.to_user_string()}"
        ),
        metadata={
            "model": model,
            "task": task,
            "output_root": raw_spec["output"]["root"],
            # read by dagster_gpuinfer.estimate (CLI and backfill_estimate_sensor)
            "gpuinfer/spec": dg.MetadataValue.json(raw_spec),
            "gpuinfer/launch": launch,  # read by the estimate too; not in the spec
            # the sink's table and the name of its URL's variable, never the URL
            **({"gpuinfer/sink": dg.MetadataValue.json(sink.model_dump())} if sink else {}),
        },
    )
    def _inference_asset(context: dg.AssetExecutionContext, config: InferenceRunConfig):
        return materialize_run(
            context,
            config.apply(raw_spec),
            name=name,
            resource_key=resource_key,
            max_error_rate=max_error_rate,
            max_invalid_output_rate=invalid_rate,
            sink=sink,
            launch=config.launch.value if config.launch else launch,
        )

    return _inference_asset
