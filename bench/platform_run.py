"""The platform contestant: real Dagster runs of an `inference_assets` pipeline.

Each call materializes partitions the way `make demo` does: `execute_in_process` of the
pipeline's asset job on a Dagster instance (SQLite in a temporary DAGSTER_HOME), with the
run's partition range in the tags, the local launcher starting `python -m
dagster_gpuinfer.worker` over Pipes, the worker streaming Parquet in and out. Timings come
from the committed manifests (per partition) and the worker's run summary.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from dagster_gpuinfer import (
    EngineArgs,
    GpuInferenceResource,
    InputSpec,
    SamplingParams,
    inference_assets,
)
from dagster_gpuinfer.spec import InferenceSpec, OutputSpec
from dagster_gpuinfer.storage import filesystem_for, partition_dir, read_manifest
from dagster_gpuinfer.task_table import task_facts

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def raw_engine_kwargs(spec: InferenceSpec) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments raw vLLM (and the other peers) get: the worker's
    `engine_kwargs(spec)` with the dtype the worker resolves on a CPU without native
    bfloat16 (`worker/loop/cpu_dtype.py`), so every contestant loads the model in one dtype, and
    chunked prefill off where the worker turns it off (`worker/loop/cpu_seeds.py`)."""
    from dagster_gpuinfer.task_table import task_facts
    from dagster_gpuinfer.worker.loop.cpu_dtype import resolve_cpu_dtype
    from dagster_gpuinfer.worker.loop.cpu_seeds import resolve_cpu_chunked_prefill
    from dagster_gpuinfer.worker.loop.engine import engine_kwargs

    kwargs = resolve_cpu_chunked_prefill(engine_kwargs(spec), samples=task_facts(spec.task).samples)
    return resolve_cpu_dtype(kwargs, spec.model)


def local_resource(
    *,
    env: dict[str, str] | None = None,
    engine_overrides: dict[str, Any] | None = None,
    **fields: Any,
) -> GpuInferenceResource:
    """The reference local resource (`resources.local`), plus bench environment and knobs;
    `fields` are further resource fields as they are (e.g. `pool`, the engine pool settings)."""
    from resources.local import local_resources

    base = local_resources()["gpu"]
    return GpuInferenceResource(
        launcher="local",
        python_executable=base.python_executable,
        env={**base.env, **(env or {})},
        engine_overrides={**base.engine_overrides, **(engine_overrides or {})},
        **fields,
    )


@dataclass
class RunTiming:
    """One Dagster run: its wall time, the worker's model load, and each partition's time."""

    keys: list[str]
    run_seconds: float
    model_load_seconds: float
    model_loads: int
    worker_seconds: float
    partition_seconds: dict[str, float] = field(default_factory=dict)
    inference_seconds: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # The worker's own split (start, load, inference, shutdown seconds), from run metadata.
    worker_split: dict[str, float] = field(default_factory=dict)
    run_id: str = ""


class PlatformPipeline:
    """One `inference_assets` pipeline over bench shards, materialized run by run.

    Args:
        name: Asset name (its folder under `root/outputs`).
        model, task, engine, sampling, chunk_size: as in `inference_assets`.
        input_uri: Shard template with `{partition_key}`.
        params_column: The shards' column of per-row parameters (`InputSpec.params_column`).
        root: Folder for outputs and the Dagster instance.
        keys: The partition keys.
        resource: The `GpuInferenceResource` the runs use.
        launch: `inference_assets(launch=...)`: "run" (a worker per run) or "pool" (warm
            pool workers); None leaves the pipeline's default.
    """

    def __init__(
        self,
        *,
        name: str,
        model: str,
        task: str,
        input_uri: str,
        root: Path,
        keys: list[str],
        resource: GpuInferenceResource,
        engine: EngineArgs,
        sampling: SamplingParams | None = None,
        chunk_size: int = 512,
        partitions_per_run: int | None = None,
        replicas: int = 1,
        params_column: str | None = None,
        launch: str | None = None,
    ) -> None:
        self.name = name
        self.keys = keys
        self.output_root = str(root / "outputs")
        self.resource = resource
        partitions_def = dg.StaticPartitionsDefinition(keys)
        self.pipeline = inference_assets(
            name=name,
            model=model,
            task=task,
            input=InputSpec(
                uri=input_uri, id_column="id", text_column="text", params_column=params_column
            ),
            output_root=self.output_root,
            partitions_def=partitions_def,
            engine=engine,
            sampling=sampling if task_facts(task).samples else None,
            chunk_size=chunk_size,
            replicas=replicas,
            backfill_policy=dg.BackfillPolicy.multi_run(partitions_per_run or len(keys)),
            **({"launch": launch} if launch is not None else {}),
        )
        self.job_name = f"bench_{name}"
        self.defs = dg.Definitions(
            assets=self.pipeline.assets,
            jobs=[
                dg.define_asset_job(
                    self.job_name,
                    selection=[self.pipeline.output_asset.key],
                    partitions_def=partitions_def,
                )
            ],
            resources={"gpu": resource},
        )
        home = root / "dagster_home"
        home.mkdir(parents=True, exist_ok=True)
        self.instance = dg.DagsterInstance.local_temp(
            str(home), overrides={"telemetry": {"enabled": False}}
        )

    def worker_spec(self) -> InferenceSpec:
        """The spec the worker gets (resource overrides applied): raw contestants copy its
        engine arguments, so both sides build the very same engine."""
        raw = dict(self.pipeline.spec, partition_keys=self.keys[:1])
        return self.resource.prepare_spec(InferenceSpec.model_validate(raw))

    def output(self) -> OutputSpec:
        return OutputSpec(root=self.output_root, asset_name=self.name)

    def clear_outputs(self) -> None:
        """Forget committed partitions, so the next run computes them again."""
        shutil.rmtree(Path(self.output_root) / self.name, ignore_errors=True)

    def run(
        self,
        keys: list[str],
        *,
        run_id: str | None = None,
        instance: dg.DagsterInstance | None = None,
    ) -> RunTiming:
        """Materialize `keys` (a contiguous range) in one Dagster run, with this `run_id`
        if given, on `instance` (default: the pipeline's; runs at once in threads each take
        their own)."""
        job = self.defs.resolve_job_def(self.job_name)
        instance = instance or self.instance
        started = time.perf_counter()
        result = job.execute_in_process(
            instance=instance,
            tags={RANGE_START: keys[0], RANGE_END: keys[-1]},
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
            raise_on_error=True,
            run_id=run_id,
        )
        run_seconds = time.perf_counter() - started
        if not result.success:
            raise RuntimeError(f"bench run of {self.name} {keys[0]}...{keys[-1]} failed")
        run_md = _run_metadata(instance, result.run_id)
        timing = RunTiming(
            run_id=result.run_id,
            keys=list(keys),
            run_seconds=run_seconds,
            model_load_seconds=0.0,
            model_loads=int(run_md.get("run_model_loads", 0)),
            worker_seconds=float(run_md.get("run_wall_seconds", 0.0)),
            # A pool run has no worker start or shutdown of its own: those read "n/a".
            worker_split={
                name: float(run_md[f"run_{name}_seconds"])
                for name in ("start", "load", "inference", "shutdown")
                if isinstance(run_md.get(f"run_{name}_seconds"), int | float)
            },
        )
        for key in keys:
            fs, path = filesystem_for(partition_dir(self.output(), key))
            manifest = read_manifest(fs, path)
            if manifest is None:
                raise RuntimeError(f"partition {key} has no manifest after its run")
            timing.partition_seconds[key] = manifest.wall_seconds
            timing.inference_seconds[key] = manifest.inference_seconds
            timing.model_load_seconds = max(timing.model_load_seconds, manifest.model_load_seconds)
            timing.rows += manifest.rows_out
            timing.prompt_tokens += manifest.prompt_tokens
            timing.generated_tokens += manifest.generated_tokens
        return timing


def _run_metadata(instance: dg.DagsterInstance, run_id: str) -> dict[str, Any]:
    """The run-level metadata the asset reported (model loads, worker wall time)."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION
    ).records
    for record in records:
        event = record.event_log_entry.dagster_event
        if event is None:
            continue
        metadata = event.event_specific_data.materialization.metadata
        if "run_model_loads" in metadata:
            return {k: v.value for k, v in metadata.items()}
    return {}
