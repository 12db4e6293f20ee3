"""`GpuInferenceResource`: where and how the worker runs (local subprocess or Kubernetes pod).

The resource turns a job spec into a Pipes session with one worker, then turns the worker's
messages into per-partition results. It never imports torch or vllm.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import dagster as dg
from pydantic import Field, ValidationError

from dagster_gpuinfer.k8s.config import K8sLauncherConfig
from dagster_gpuinfer.k8s.group import GroupConfig
from dagster_gpuinfer.launchers.base import Launcher
from dagster_gpuinfer.messages import (
    Fatal,
    PartitionCommitted,
    PartitionFailed,
    PodStart,
    PoolLease,
    RunFinished,
    parse_message,
)
from dagster_gpuinfer.pools import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_LEASE_TTL_S,
    default_pools_home,
    default_queue_location,
)
from dagster_gpuinfer.run_metrics import metrics_env, push_run_metrics
from dagster_gpuinfer.secrets import ENV_REFERENCES_VARIABLE, validation_problems
from dagster_gpuinfer.spec import InferenceSpec, StorageOptions
from dagster_gpuinfer.storage import Manifest, committed_manifests


def env_references_variable(references: Mapping[str, str]) -> dict[str, str]:
    """The one variable that carries `env_references` (names only) to a local worker."""
    if not references:
        return {}
    return {ENV_REFERENCES_VARIABLE: json.dumps(dict(references), sort_keys=True)}


Launch = Literal["run", "pool"]


# A run tag setting the lease priority of the run's pool job (`PoolSettings.lease_priority`).
RUN_PRIORITY_TAG = "gpuinfer/priority"
# The kit's PriorityClasses (deploy/kueue/priority-classes.yaml) by name; a test keeps them equal.
KIT_PRIORITY_CLASSES = {"gpuinfer-batch": 1000}


class PoolSettings(dg.Config):
    """Engine pools (`launch="pool"`): where their lease queue is, how big and how long.

    Examples:
        >>> PoolSettings(max_workers=2, idle_ttl_s=600)
    """

    queue: str | None = Field(
        None,
        description="The lease queue: a postgresql:// URL (production: every step and pool "
        "worker must reach it) or a SQLite file path. Default: $DAGSTER_HOME/gpuinfer/pools.db, "
        "or .data/pools.db without DAGSTER_HOME.",
    )
    max_workers: int = Field(
        1,
        ge=0,
        description="Workers (engines) per pool at most; the reconciler starts one "
        "per queued or leased partition up to this.",
    )
    idle_ttl_s: float = Field(
        DEFAULT_IDLE_TTL_S,
        gt=0,
        description="A pool worker exits after this many seconds without a lease.",
    )
    lease_ttl_s: float = Field(
        DEFAULT_LEASE_TTL_S,
        gt=0,
        description="A lease lapses this long after its last heartbeat (a killed "
        "worker's partition is leased again after it).",
    )
    start_ttl_s: float = Field(
        120.0,
        gt=0,
        description="How long a started worker counts as `starting` before it "
        "reports itself (process start and imports).",
    )
    poll_s: float = Field(
        0.5,
        gt=0,
        description="How often a waiting step reads its job when nothing wakes it (the "
        "queue rings the step at each event of its job: this is the fallback).",
    )
    priority_classes: dict[str, int] = Field(
        default_factory=lambda: dict(KIT_PRIORITY_CLASSES),
        description="PriorityClass name -> value, for lease priority: a run tagged "
        "`gpuinfer/priority` with a name, or pods placed with k8s.placement.priority_class, "
        "lease with that class's value (higher first). Default: the kit's classes "
        "(deploy/kueue/priority-classes.yaml).",
    )

    def lease_priority(self, tags: Mapping[str, str], priority_class: str | None) -> int:
        """The lease priority of a run's pool job: its `gpuinfer/priority` tag (an integer,
        or a PriorityClass name of `priority_classes`), else the value of the pods'
        `priority_class`, else 0. Within one priority, jobs take turns (fair share).

        Raises:
            dagster.Failure: non-retryable, naming the tag, when it is neither.
        """
        tagged = tags.get(RUN_PRIORITY_TAG)
        if tagged is None:
            return self.priority_classes.get(priority_class or "", 0)
        if tagged.strip().lstrip("-").isdigit():
            return int(tagged)
        if tagged in self.priority_classes:
            return self.priority_classes[tagged]
        raise dg.Failure(
            description=f"run tag {RUN_PRIORITY_TAG}={tagged!r} is neither an integer nor a "
            f"PriorityClass of GpuInferenceResource.pool.priority_classes "
            f"({sorted(self.priority_classes)}): tag the run with one of those, or a number",
            allow_retries=False,
        )

    def location(self) -> str:
        """The queue's location, a default SQLite file made absolute (workers run elsewhere)."""
        if self.queue:
            return self.queue
        os.makedirs(default_pools_home(), exist_ok=True)
        return default_queue_location()

    def log_dir(self) -> str:
        """Where local pool workers write their logs: beside a SQLite queue, else under
        $DAGSTER_HOME/gpuinfer (or .data)."""
        location = self.location()
        if location.startswith(("postgresql://", "postgres://")):
            base = default_pools_home()
        else:
            base = os.path.dirname(os.path.abspath(location.removeprefix("sqlite:///")))
        return os.path.join(base, "pool-workers")


class InvalidInferenceSpec(ValueError):
    """A spec that cannot run; the message names the field and what is wrong with it."""


# A run tag naming the Kueue LocalQueue of this run's worker pods (the batch API tags a
# tenant's runs with the tenant's queue); it overrides k8s.placement.kueue_queue.
RUN_QUEUE_TAG = "gpuinfer/kueue_queue"


def config_for_run_queue(config: K8sLauncherConfig, tags: Mapping[str, str]) -> K8sLauncherConfig:
    """`config` with the run's Kueue queue (tag `gpuinfer/kueue_queue`) when the run has one."""
    queue = tags.get(RUN_QUEUE_TAG)
    if not queue:
        return config
    placement = config.placement.model_copy(update={"kueue_queue": queue})
    return config.model_copy(update={"placement": placement})


def validate_spec(raw: Mapping[str, Any], *, where: str) -> InferenceSpec:
    """Validate a spec in the control plane, before any worker starts.

    Raises:
        InvalidInferenceSpec: naming each bad field, e.g. `task: Input should be 'embed',
            'generate', 'chat', 'score', 'classify', 'image_embed', 'vision_generate' or
            'vision_chat' (got 'summarize')`.
    """
    try:
        return InferenceSpec.model_validate(raw)
    except ValidationError as exc:
        problems = validation_problems(exc)  # a refused credential is never echoed
        raise InvalidInferenceSpec(
            f"invalid inference spec for {where}: " + "; ".join(problems)
        ) from None


@dataclass
class InferenceRunResult:
    """What one worker run produced, partition by partition."""

    manifests: dict[str, Manifest] = field(default_factory=dict)
    computed: set[str] = field(default_factory=set)
    # Partitions whose shard cannot be processed: {key: {"error_type", "message"}}. The
    # other partitions were committed; the caller fails the step naming these.
    failed: dict[str, dict[str, str]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    spec: InferenceSpec | None = None
    # k8s launcher: set when the worker ran out of memory and was relaunched with smaller
    # vLLM batches ({field: {"from": old, "to": new}, "first_failure": ...}).
    memory_step_down: dict[str, Any] | None = None
    # k8s launcher: where the pod's start went (k8s/timing.py): queued, scheduling, start.
    pod_start: dict[str, Any] | None = None
    # pool launcher: per partition, how it ran on the pool ({key: PoolLease.facts()}).
    pool: dict[str, dict[str, Any]] = field(default_factory=dict)


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
        description="Extra environment variables for the worker. Never credentials: names "
        "that look like one (TOKEN, SECRET, *_PASS*, *_KEY, ...) are refused for pods; use "
        "env_references (local) or k8s.secrets.env (pods).",
    )
    env_references: dict[str, str] = Field(
        default_factory=dict,
        description="Worker environment variables taken by reference, local launcher: {name "
        "the worker gets: name of the variable in the worker's inherited environment}, e.g. "
        "{'AWS_SECRET_ACCESS_KEY': 'MINIO_SECRET'} (gpu_settings_from_s3_resource fills it "
        "from dg.EnvVar credentials). Only names travel; the worker reads the value at start. "
        "Pods take credentials from Secrets instead (k8s.secrets.env, k8s.secrets.env_from).",
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
    metrics_port: int | None = Field(
        None,
        description="Port the worker serves Prometheus metrics on (GPUINFER_METRICS_PORT); "
        "worker pods declare it as their `metrics` port for the PodMonitor. None serves none.",
    )
    pushgateway_url: str | None = Field(
        None,
        description="Prometheus Pushgateway the worker pushes its metrics to after every chunk "
        "commit and at exit (and the launcher its queue and start times), e.g. "
        "http://pushgateway.monitoring:9091. None pushes nothing.",
    )
    k8s: K8sLauncherConfig | None = Field(
        None,
        description="Worker pods for launcher='k8s': image, namespace, GPU type, Kueue queue, "
        "model cache volume, resources, secret references, timeouts (K8sLauncherConfig).",
    )
    k8s_group: GroupConfig = Field(
        default_factory=GroupConfig,
        description="For specs with nodes > 1 (one engine across pods, k8s.group): topology "
        "key, master port, gloo/NCCL interface and per-rank env of the pod group.",
    )
    pool: PoolSettings = Field(
        default_factory=PoolSettings,
        description="Engine pools, for pipelines or runs with launch='pool': the lease queue, "
        "workers per pool, idle and lease TTLs. Pool workers start as local subprocesses "
        "(launcher='local') or pool pods (launcher='k8s').",
    )

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
        self, *, context: dg.AssetExecutionContext, spec: InferenceSpec, launch: Launch = "run"
    ) -> InferenceRunResult:
        """Commit every partition of `spec.partition_keys`, launching a worker only for the
        ones not yet committed for this spec from their shards (and a local model folder's
        files) as they are now: a rewritten shard is computed again, never served stale.

        A shard that cannot be processed lands in `result.failed` while the others are
        committed: the caller materializes those and fails the step (as `inference_assets`
        does), so one bad shard costs its own partition only.

        `launch="run"` starts a worker for this run; `launch="pool"` submits the partitions
        to the engine pool of the spec's model and waits (`launchers.pool`).

        Raises:
            dagster.Failure: non-retryable when the spec cannot run (the message says what to
                fix); any other error (a crashed worker) is retryable.
        """
        try:
            spec = self.prepare_spec(spec)
        except InvalidInferenceSpec as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        result = InferenceRunResult(spec=spec)
        result.manifests.update(committed_manifests(spec, spec.partition_keys))
        todo = [key for key in spec.partition_keys if key not in result.manifests]
        if result.manifests:
            context.log.info(
                f"{len(result.manifests)} partition(s) already committed for spec "
                f"{spec.spec_hash()} from their shards and model files as they are now, "
                f"reused: {sorted(result.manifests)}"
            )
        if not todo:
            result.summary = {"model_loads": 0, "partitions_computed": 0}
            return result
        worker_spec = spec.model_copy(update={"partition_keys": todo})
        if launch == "pool":
            messages = self._launch(context=context, spec=worker_spec, launch="pool")
        else:
            messages = self._launch_stepping_down_memory(
                context=context, spec=worker_spec, result=result
            )
        self._collect(messages, result)
        push_run_metrics(
            self.pushgateway_url, asset=spec.output.asset_name, run_id=context.run_id, result=result
        )
        if result.memory_step_down is not None:
            for key in todo:
                context.add_asset_metadata(
                    {"memory_step_down": dg.MetadataValue.json(result.memory_step_down)},
                    partition_key=key,
                )
        missing = [
            key
            for key in spec.partition_keys
            if key not in result.manifests and key not in result.failed
        ]
        if missing:
            raise dg.Failure(
                description=f"the worker ended without committing partitions {missing}; "
                "the run can be retried and will resume from committed chunks",
                allow_retries=True,
            )
        return result

    def worker_env(self) -> dict[str, str]:
        """`env` plus the metrics settings the worker reads (worker/metrics.py)."""
        return {**self.env, **metrics_env(self.metrics_port, self.pushgateway_url)}

    def _launch(
        self,
        *,
        context: dg.AssetExecutionContext,
        spec: InferenceSpec,
        launch_attempt: int = 0,
        launch: Launch = "run",
    ) -> list[Any]:
        extras = {"spec": spec.model_dump(mode="json")}
        return self.launcher_for(context, launch, spec=spec).launch(
            context=context, spec=spec, extras=extras, launch_attempt=launch_attempt
        )

    def launcher_for(
        self,
        context: dg.AssetExecutionContext,
        launch: Launch = "run",
        *,
        spec: InferenceSpec | None = None,
    ) -> Launcher:
        """The launcher of this run: a pool's (`launch="pool"`), else a local subprocess or
        a pod (group) per run, as `launcher` says."""
        if launch == "pool":
            from dagster_gpuinfer.launchers.pool import PoolLauncher

            return PoolLauncher(
                queue_location=self.pool.location(),
                settings=self.pool,
                backend=self.pool_backend(spec),
                env=self.pool_worker_env(),
                poll_s=self.pool.poll_s,
                priority=self.pool.lease_priority(
                    context.run.tags, self.k8s.placement.priority_class if self.k8s else None
                ),
            )
        if self.launcher == "local":
            from dagster_gpuinfer.launchers.local import LocalLauncher

            return LocalLauncher(
                python_executable=self.python_executable or sys.executable,
                env={**self.worker_env(), **env_references_variable(self.env_references)},
            )
        from dagster_gpuinfer.launchers.k8s import K8sLauncher

        # Per-run settings are resolved here, once, so the one-pod and the pod-group
        # launchers get the same pod configuration (the run's Kueue queue included).
        return K8sLauncher(
            config=self._pod_config_for_run(context),
            group_config=self.k8s_group,
            env=self.worker_env(),
            kubernetes_client=self.kubernetes_client,
        )

    # ------------------------------------------------------------------ pools

    def pool_worker_env(self) -> dict[str, str]:
        """A pool worker's environment: the worker env, and locally the references."""
        if self.launcher == "local":
            return {**self.worker_env(), **env_references_variable(self.env_references)}
        return self.worker_env()

    def pool_backend(self, spec: InferenceSpec | None = None) -> Any:
        """What starts pool workers: `LocalPoolBackend` (detached subprocesses, their logs
        beside the queue) for launcher='local', `K8sPoolBackend` (pool pods) for 'k8s',
        whose pods get `spec`'s GPUs (tensor x pipeline parallel; without a spec, as
        many as the pool's other pods have).
        Pool pods serve many runs: no run's Kueue queue tag applies to them.

        Raises:
            dagster.Failure: non-retryable, when pool pods cannot be configured.
        """
        if self.launcher == "local":
            from dagster_gpuinfer.pools.reconciler import LocalPoolBackend
            from dagster_gpuinfer.worker import WORKER_MODULE

            python = self.python_executable or sys.executable
            return LocalPoolBackend(
                self.pool.location(), self.pool.log_dir(), command=[python, "-m", WORKER_MODULE]
            )
        try:
            from dagster_gpuinfer.k8s.pool_backend import K8sPoolBackend  # type: ignore
        except ImportError:
            raise dg.Failure(
                description="launch='pool' with launcher='k8s' needs K8sPoolBackend "
                "(dagster_gpuinfer.k8s.pool_backend), which this install lacks",
                allow_retries=False,
            ) from None
        if self.k8s is None:
            raise dg.Failure(
                description="launch='pool' with launcher='k8s' needs the pod configuration: "
                "set k8s=K8sLauncherConfig(...) on GpuInferenceResource",
                allow_retries=False,
            )
        # Without a spec (the sensor): as many GPUs as the pool's other pods have.
        gpus = spec.tensor_parallel_size * spec.pipeline_parallel_size if spec else None
        return K8sPoolBackend(self.k8s, self.kubernetes_client, gpus=gpus)

    # ------------------------------------------------------------------ k8s launcher

    def _pod_config_for_run(self, context: dg.AssetExecutionContext) -> K8sLauncherConfig:
        """The worker pods' configuration for the run of `context`: `k8s` with the run's Kueue
        queue (tag `gpuinfer/kueue_queue`) applied. Every pod of the run, one or a group,
        uses it. The refusals come first: they need no run.

        Raises:
            dagster.Failure: non-retryable when pods cannot be configured: `k8s` is not set,
                or `env_references` names variables a pod cannot see.
        """
        if self.env_references:
            raise dg.Failure(
                description="GpuInferenceResource.env_references names variables of the "
                f"control plane's environment ({sorted(self.env_references.values())}), which "
                "a pod cannot see. Put the credentials in a Kubernetes Secret and reference it: "
                "k8s.secrets.env_from=['<secret>'] (keys become variables) or k8s.secrets.env="
                "[SecretEnvRef(...)]",
                allow_retries=False,
            )
        if self.k8s is None:
            raise dg.Failure(
                description="launcher='k8s' needs the pod configuration: set "
                "k8s=K8sLauncherConfig(image=..., namespace=...) on GpuInferenceResource "
                "(see resources/k8s.py), or use launcher='local'",
                allow_retries=False,
            )
        return config_for_run_queue(self.k8s, context.run.tags)

    def kubernetes_client(self) -> Any:
        """The `dagster_k8s.client.DagsterKubernetesClient` worker pods are launched with.

        Loads the in-cluster config or the kubeconfig of `k8s`. Override it in a subclass to
        inject a client (tests use a fake Kubernetes API, as dagster-k8s's own tests do).
        """
        from dagster_gpuinfer.k8s.client import production_kubernetes_client

        assert self.k8s is not None
        return production_kubernetes_client(self.k8s)

    def _launch_stepping_down_memory(
        self, *, context: dg.AssetExecutionContext, spec: InferenceSpec, result: InferenceRunResult
    ) -> list[Any]:
        """`_launch`, relaunched once with smaller vLLM batches when the worker runs out of
        memory (`max_num_seqs` and `gpu_memory_utilization`, left out of the spec hash, so
        committed chunks stay valid). A second out-of-memory is a non-retryable Failure."""
        from dagster_gpuinfer.k8s.failures import WorkerOutOfMemory
        from dagster_gpuinfer.k8s.memory import out_of_memory_hint, step_down_memory

        try:
            return self._launch(context=context, spec=spec)
        except WorkerOutOfMemory as exc:
            first = exc.failure
        stepped, change = step_down_memory(spec)
        context.log.warning(
            f"{first.message.splitlines()[0]} Relaunching once with "
            f"max_num_seqs={change['max_num_seqs']['to']} and gpu_memory_utilization="
            f"{change['gpu_memory_utilization']['to']} (spec hash unchanged, committed "
            "chunks are kept)."
        )
        try:
            messages = self._launch(context=context, spec=stepped, launch_attempt=1)
        except WorkerOutOfMemory as second:
            raise dg.Failure(
                description=out_of_memory_hint(first, second.failure, change),
                allow_retries=False,
                metadata={"memory_step_down": dg.MetadataValue.json(change)},
            ) from None
        if result.spec is not None:
            result.spec = result.spec.model_copy(update={"engine": stepped.engine})
        result.memory_step_down = {
            **change,
            "first_failure": first.message.splitlines()[0],
            "first_pod": first.pod_name,
        }
        return messages

    @staticmethod
    def _collect(messages: list[Any], result: InferenceRunResult) -> None:
        for message in map(parse_message, messages):
            if isinstance(message, PartitionCommitted):
                key = message.manifest.partition_key
                result.manifests[key] = message.manifest
                if message.computed:
                    result.computed.add(key)
            elif isinstance(message, PartitionFailed):
                result.failed[str(message.partition_key)] = {
                    "error_type": message.error_type,
                    "message": message.message,
                }
            elif isinstance(message, RunFinished):
                result.summary = message.summary()
            elif isinstance(message, PodStart):  # the k8s launcher's own (k8s/timing.py)
                result.pod_start = message.timing()
            elif isinstance(message, PoolLease):  # the pool launcher's own (launchers/pool.py)
                result.pool[message.partition_key] = message.facts()
            elif isinstance(message, Fatal):
                where = message.partition_key
                raise dg.Failure(
                    description=(
                        f"{message.error_type}: {message.message}"
                        + (f" (partition {where!r})" if where else "")
                        + ". Not retried: fix the input or the spec, then re-run."
                    ),
                    metadata={"error_type": message.error_type},
                    allow_retries=False,
                )
