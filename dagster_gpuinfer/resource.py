"""`GpuInferenceResource`: where and how the worker runs (local subprocess or Kubernetes pod).

The resource turns a job spec into a Pipes session with one worker, then turns the worker's
messages into per-partition results. It never imports torch or vllm.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import dagster as dg
from pydantic import Field, ValidationError

from dagster_gpuinfer.spec import InferenceSpec, StorageOptions
from dagster_gpuinfer.storage import Manifest, committed_manifest




class InvalidInferenceSpec(ValueError):
    """A spec that cannot run; the message names the field and what is wrong with it."""


def validate_spec(raw: Mapping[str, Any], *, where: str) -> InferenceSpec:
    """Validate a spec in the control plane, before any worker starts.

    Raises:
        InvalidInferenceSpec: naming each bad field, e.g. `task: Input should be 'embed',
            'generate' or 'chat' (got 'summarize')`.
    """
    try:
        return InferenceSpec.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            location = ".".join(str(part) for part in error["loc"]) or "spec"
            problem = f"{location}: {error['msg']}"
            if error.get("type") not in ("missing",) and "input" in error:
                problem += f" (got {error['input']!r})"
            problems.append(problem)
        raise InvalidInferenceSpec(f"invalid inference spec for {where}: " + "; ".join(problems)) from None


@dataclass
class InferenceRunResult:
    """What one worker run produced, partition by partition."""

    manifests: dict[str, Manifest] = field(default_factory=dict)
    computed: set[str] = field(default_factory=set)
    summary: dict[str, Any] = field(default_factory=dict)
    spec: InferenceSpec | None = None


class GpuInferenceResource(dg.ConfigurableResource):
    """Runs dagster-gpuinfer workers: a local subprocess (laptops, CI) or a Kubernetes pod.

    Examples:
        >>> GpuInferenceResource(launcher="local", engine_overrides={"gpu_memory_utilization": 0.2})
    """

    launcher: Literal["local", "k8s"] = Field(
        "local",
        description="local: the worker runs as a subprocess of the step (dagster "
        "PipesSubprocessClient). k8s: the worker runs in a GPU pod (PipesK8sClient).",
    )
    python_executable: str | None = Field(
        None,
        description="Python that runs the local worker; defaults to the code location's own. "
        "Point it at a venv with the worker extra (vllm) to keep vllm out of the code location.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables for the worker (never secrets for k8s: use "
        "secret references there).",
    )
    engine_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine arguments this environment imposes on every pipeline, e.g. "
        "gpu_memory_utilization=0.2 on a CPU laptop. Applied on top of the pipeline's.",
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint for inputs and outputs (MinIO, moto, R2)."
    )
    s3_region: str | None = Field(None, description="S3 region.")
    s3_allow_http: bool = Field(False, description="Allow a plain-http S3 endpoint.")

    # ------------------------------------------------------------------ spec

    def storage_options(self) -> StorageOptions:
        return StorageOptions(
            endpoint_url=self.s3_endpoint_url, region=self.s3_region, allow_http=self.s3_allow_http
        )

    def prepare_spec(self, spec: InferenceSpec) -> InferenceSpec:
        """The spec as this environment runs it: engine overrides and storage applied."""
        raw = spec.model_dump(mode="json")
        raw["engine"].update(self.engine_overrides)
        if self.s3_endpoint_url or self.s3_region:
            raw["storage"] = self.storage_options().model_dump(mode="json")
        return validate_spec(raw, where=f"outputs {spec.output.asset_name!r}")

    # ------------------------------------------------------------------ run

    def run_inference(
        self, *, context: dg.AssetExecutionContext, spec: InferenceSpec
    ) -> InferenceRunResult:
        """Commit every partition of `spec.partition_keys`, launching a worker only for the
        ones not yet committed for this spec.

        Raises:
            dagster.Failure: non-retryable when the spec or a shard cannot run (the message
                says what to fix); any other error (a crashed worker) is retryable.
        """
        try:
            spec = self.prepare_spec(spec)
        except InvalidInferenceSpec as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        result = InferenceRunResult(spec=spec)
        todo = []
        for key in spec.partition_keys:
            manifest = committed_manifest(spec, key)
            if manifest is None:
                todo.append(key)
            else:
                result.manifests[key] = manifest
        if result.manifests:
            context.log.info(
                f"{len(result.manifests)} partition(s) already committed for spec "
                f"{spec.spec_hash()}, reused: {sorted(result.manifests)}"
            )
        if not todo:
            result.summary = {"model_loads": 0, "partitions_computed": 0}
            return result
        worker_spec = spec.model_copy(update={"partition_keys": todo})
        messages = self._launch(context=context, spec=worker_spec)
        self._collect(messages, result)
        missing = [key for key in spec.partition_keys if key not in result.manifests]
        if missing:
            raise dg.Failure(
                description=f"the worker ended without committing partitions {missing}; "
                "the run can be retried and will resume from committed chunks",
                allow_retries=True,
            )
        return result

    def _launch(self, *, context: dg.AssetExecutionContext, spec: InferenceSpec) -> list[Any]:
        extras = {"spec": spec.model_dump(mode="json")}
        if self.launcher == "local":
            from dagster_gpuinfer.launchers.local import run_local_worker

            return run_local_worker(
                context=context,
                extras=extras,
                python_executable=self.python_executable or sys.executable,
                env=self.env,
            )
        raise dg.Failure(
            description="launcher 'k8s' is not configured in this resource; use launcher='local'",
            allow_retries=False,
        )

    @staticmethod
    def _collect(messages: list[Any], result: InferenceRunResult) -> None:
        for message in messages:
            if not isinstance(message, dict):
                continue
            kind = message.get("type")
            if kind == "partition":
                manifest = Manifest.model_validate(message["manifest"])
                result.manifests[manifest.partition_key] = manifest
                if message.get("computed"):
                    result.computed.add(manifest.partition_key)
            elif kind == "run":
                result.summary = {k: v for k, v in message.items() if k != "type"}
            elif kind == "fatal":
                where = message.get("partition_key")
                raise dg.Failure(
                    description=(
                        f"{message.get('error_type')}: {message.get('message')}"
                        + (f" (partition {where!r})" if where else "")
                        + ". Not retried: fix the input or the spec, then re-run."
                    ),
                    metadata={"error_type": message.get("error_type") or ""},
                    allow_retries=False,
                )
