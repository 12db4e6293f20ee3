"""A fake Kubernetes cluster for the launcher tests (a fixture module, not a test file).

As dagster-k8s tests its own client, the cluster is replaced at the API boundary: a fake
`CoreV1Api` (pods, logs, events) driven by a fake clock, injected through
`GpuInferenceResource.kubernetes_client`. Everything above it is real: the asset factory,
the resource, `PipesK8sClient`'s log streaming and Pipes message extraction, dagster-k8s's
`wait_for_pod`, Dagster's retry policy, and output partitions committed on disk by a fake
worker that speaks the worker's Pipes protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import kubernetes
import pyarrow as pa
import pyarrow.parquet as pq
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster_k8s.client import DagsterKubernetesClient
from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, decode_env_var
from kubernetes.client import (
    ApiClient,
    CoreV1Event,
    CoreV1EventList,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSchedulingGate,
    V1PodStatus,
)

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.k8s.config import K8sLauncherConfig, ModelCache, WorkerPlacement
from dagster_gpuinfer.messages import PartitionCommitted, RunFinished, to_payload
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    Manifest,
    commit_partition,
    filesystem_for,
    partition_dir,
    source_version,
    table_to_parquet_bytes,
    write_file_entry,
)

POD_IP = "10.42.0.7"
IMAGE = "registry.example.com/gpuinfer-worker:0.1.0"
NAMESPACE = "team-a"
POLL = 10.0
PENDING_TIMEOUT = 300.0
SCHEDULER_MESSAGE = (
    "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are "
    "available: 4 No preemption victims found for incoming pod."
)
EPOCH = datetime(2026, 11, 30, tzinfo=UTC)
_API = ApiClient()


def to_model(data: Any, klass: str) -> Any:
    """Deserialise a manifest dict the way the client deserialises API responses."""

    class _Response:
        pass

    response = _Response()
    response.data = json.dumps(data)  # type: ignore[attr-defined]
    return _API.deserialize(response, klass)


# --------------------------------------------------------------------------- the fake cluster


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def stamp(self) -> str:
        return (EPOCH + timedelta(seconds=self.now)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


Worker = Callable[[dict[str, str]], list[str]]


@dataclass
class PodScript:
    """What the fake cluster does with one pod, in fake seconds since its creation."""

    queued_for: float = 0.0
    unschedulable_for: float = 0.0
    pulling_for: float = 0.0
    waiting_reason: str | None = None
    waiting_message: str = ""
    worker: Worker | None = None
    exit_code: int = 0
    terminated_reason: str | None = None
    pod_reason: str | None = None
    pod_message: str | None = None
    disruption: str | None = None
    vanish_after_logs: bool = False
    interrupt_after_logs: bool = False


@dataclass
class FakePod:
    manifest: dict[str, Any]
    script: PodScript
    created_at: float
    logs: list[str] | None = None
    finished: bool = False

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    def env(self, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
        """The container environment as the kubelet would resolve it (secrets included)."""
        env: dict[str, str] = {}
        container = self.manifest["spec"]["containers"][0]
        for source in container.get("envFrom", []):
            env.update(secrets.get(source["secretRef"]["name"], {}))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in item.get("valueFrom", {}):  # the downward API: pod IP
                env[item["name"]] = POD_IP
            elif "valueFrom" in item:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = secrets[ref["name"]][ref["key"]]
        return env


class FakeLogResponse:
    """What `read_namespaced_pod_log(..., _preload_content=False)` returns: iterable bytes
    chunks (streaming) and `.data` (the whole text)."""

    def __init__(self, chunks: Any, data: bytes = b"") -> None:
        self._chunks = chunks
        self.data = data

    def __iter__(self) -> Any:
        return iter(self._chunks)

    def stream(self) -> Any:
        return iter(self._chunks)


class FakeKubernetes:
    """A fake `CoreV1Api`: pods created by the launcher go through the scripts in order."""

    def __init__(
        self, *scripts: PodScript, secrets: dict[str, dict[str, str]] | None = None
    ) -> None:
        self.clock = FakeClock()
        self.scripts = list(scripts)
        self.secrets = secrets or {}
        self.pods: dict[str, FakePod] = {}
        self.created: list[FakePod] = []
        self.deleted: list[str] = []
        self.vanished_at: float | None = None
        self.polls_after_vanish = 0
        self.create_error: kubernetes.client.ApiException | None = None
        self.services: dict[str, dict[str, Any]] = {}

    def client(self) -> DagsterKubernetesClient:
        return DagsterKubernetesClient(
            batch_api=None,
            core_api=self,
            logger=lambda *args, **kwargs: None,
            sleeper=self.clock.sleep,
            timer=self.clock.time,
        )

    # ------------------------------------------------------------------ CoreV1Api

    def create_namespaced_pod(self, namespace: str, body: V1Pod, **kwargs: Any) -> V1Pod:
        if self.create_error is not None:
            raise self.create_error
        manifest = _API.sanitize_for_serialization(body)
        assert manifest["metadata"]["namespace"] == namespace
        assert manifest["metadata"]["name"] not in self.pods, "pod names must be unique"
        script = self.scripts.pop(0) if self.scripts else PodScript(worker=committing_worker())
        pod = FakePod(manifest=manifest, script=script, created_at=self.clock.now)
        self.pods[pod.name] = pod
        self.created.append(pod)
        return body

    def create_namespaced_service(self, namespace: str, body: Any, **kwargs: Any) -> Any:
        manifest = _API.sanitize_for_serialization(body)
        self.services[manifest["metadata"]["name"]] = manifest
        return body

    def delete_namespaced_service(self, name: str, namespace: str, **kwargs: Any) -> None:
        if self.services.pop(name, None) is None:
            raise kubernetes.client.ApiException(status=404, reason="Not Found")

    def list_namespaced_pod(
        self, namespace: str, field_selector: str = "", **kwargs: Any
    ) -> V1PodList:
        name = field_selector.removeprefix("metadata.name=")
        if self.vanished_at is not None:
            self.polls_after_vanish += 1
        pod = self.pods.get(name)
        return V1PodList(items=[self._render(pod)] if pod else [])

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> V1Pod:
        if name not in self.pods:
            raise kubernetes.client.ApiException(status=404, reason="Not Found")
        return self._render(self.pods[name])

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> None:
        if name not in self.pods:
            raise kubernetes.client.ApiException(status=404, reason="Not Found")
        del self.pods[name]
        self.deleted.append(name)

    def list_namespaced_event(
        self, namespace: str, field_selector: str = "", **kwargs: Any
    ) -> CoreV1EventList:
        name = field_selector.removeprefix("involvedObject.name=")
        pod = self.pods.get(name)
        items = []
        if pod is not None and pod.script.unschedulable_for > 0:
            items.append(
                CoreV1Event(
                    metadata=V1ObjectMeta(name=f"{name}.1"),
                    involved_object=V1ObjectReference(kind="Pod", name=name, namespace=namespace),
                    type="Warning",
                    reason="FailedScheduling",
                    message=SCHEDULER_MESSAGE,
                    count=3,
                )
            )
        return CoreV1EventList(items=items)

    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        container: str | None = None,
        follow: bool = False,
        timestamps: bool = False,
        tail_lines: int | None = None,
        **kwargs: Any,
    ) -> FakeLogResponse:
        pod = self.pods.get(name)
        if pod is None:
            raise kubernetes.client.ApiException(status=404, reason="Not Found")
        if pod.logs is None:
            raise kubernetes.client.ApiException(status=400, reason="container is waiting to start")
        lines = list(pod.logs)
        if not follow:
            tail = lines[-tail_lines:] if tail_lines else lines
            return FakeLogResponse([], "".join(line + "\n" for line in tail).encode())
        return FakeLogResponse(self._follow(pod, lines, timestamps))

    def _follow(self, pod: FakePod, lines: list[str], timestamps: bool) -> Any:
        for line in lines:
            self.clock.now += 0.001
            yield (
                ((self.clock.stamp() + " ") if timestamps else "").encode() + line.encode() + b"\n"
            )
        if pod.script.interrupt_after_logs:
            raise DagsterExecutionInterruptedError()
        pod.finished = True
        if pod.script.vanish_after_logs:
            del self.pods[pod.name]
            self.vanished_at = self.clock.now

    # ------------------------------------------------------------------ status

    def _render(self, pod: FakePod) -> V1Pod:
        model = to_model(pod.manifest, "V1Pod")
        script = pod.script
        age = self.clock.now - pod.created_at
        container = pod.manifest["spec"]["containers"][0]

        def status(state: V1ContainerState, ready: bool = False) -> V1ContainerStatus:
            return V1ContainerStatus(
                name=container["name"],
                image=container["image"],
                image_id="",
                ready=ready,
                restart_count=0,
                state=state,
            )

        conditions: list[V1PodCondition] = []
        statuses: list[V1ContainerStatus] = []
        phase, reason, message = "Pending", None, None
        if age < script.queued_for:
            model.spec.scheduling_gates = [V1PodSchedulingGate(name="kueue.x-k8s.io/admission")]
            conditions.append(
                V1PodCondition(type="PodScheduled", status="False", reason="SchedulingGated")
            )
        elif age < script.queued_for + script.unschedulable_for:
            conditions.append(
                V1PodCondition(
                    type="PodScheduled",
                    status="False",
                    reason="Unschedulable",
                    message=SCHEDULER_MESSAGE,
                )
            )
        else:
            model.spec.node_name = "gpu-node-1"
            conditions.append(V1PodCondition(type="PodScheduled", status="True"))
            started_at = script.queued_for + script.unschedulable_for + script.pulling_for
            if age < started_at:
                statuses.append(
                    status(
                        V1ContainerState(
                            waiting=V1ContainerStateWaiting(reason="ContainerCreating")
                        )
                    )
                )
            elif script.waiting_reason:
                statuses.append(
                    status(
                        V1ContainerState(
                            waiting=V1ContainerStateWaiting(
                                reason=script.waiting_reason, message=script.waiting_message
                            )
                        )
                    )
                )
            else:
                if pod.logs is None:
                    pod.logs = script.worker(pod.env(self.secrets)) if script.worker else []
                if not pod.finished:
                    phase = "Running"
                    statuses.append(
                        status(V1ContainerState(running=V1ContainerStateRunning()), ready=True)
                    )
                    if script.disruption and script.vanish_after_logs:
                        # Chosen for disruption, running out its grace period, then gone.
                        conditions.append(
                            V1PodCondition(
                                type="DisruptionTarget",
                                status="True",
                                reason=script.disruption,
                                message=f"{script.disruption}: the pod was chosen for disruption",
                            )
                        )
                else:
                    code = script.exit_code
                    terminated_reason = script.terminated_reason or (
                        "Completed" if code == 0 else "Error"
                    )
                    statuses.append(
                        status(
                            V1ContainerState(
                                terminated=V1ContainerStateTerminated(
                                    exit_code=code, reason=terminated_reason
                                )
                            )
                        )
                    )
                    phase = "Succeeded" if code == 0 and not script.pod_reason else "Failed"
                    reason, message = script.pod_reason, script.pod_message
                    if script.disruption:
                        conditions.append(
                            V1PodCondition(
                                type="DisruptionTarget",
                                status="True",
                                reason=script.disruption,
                                message=f"{script.disruption}: the pod was chosen for disruption",
                            )
                        )
        model.status = V1PodStatus(
            phase=phase,
            reason=reason,
            message=message,
            conditions=conditions,
            container_statuses=statuses or None,
        )
        return model


# --------------------------------------------------------------------------- fake workers


def pipes_line(method: str, params: dict[str, Any] | None) -> str:
    return json.dumps({"__dagster_pipes_version": "0.1", "method": method, "params": params})


def spec_from_env(env: dict[str, str]) -> InferenceSpec:
    context = decode_env_var(env[DAGSTER_PIPES_CONTEXT_ENV_VAR])["data"]
    return InferenceSpec.model_validate(context["extras"]["spec"])


def commit_fake_partition(spec: InferenceSpec, key: str, rows: int = 3) -> Manifest:
    """Commit a real output partition the way the worker does (files, then the manifest
    naming the shard version it read; the pods' model folder is not there to version)."""
    fs, path = filesystem_for(partition_dir(spec.output, key), spec.storage)
    table = pa.table({"id": [f"{key}:{i}" for i in range(rows)], "embedding": [[0.1, 0.2]] * rows})
    part = write_file_entry(
        fs, path, f"part-{spec.spec_hash()}-00000.parquet", table_to_parquet_bytes(table), rows
    )
    manifest = Manifest(
        partition_key=key,
        spec_hash=spec.spec_hash(),
        source=source_version(spec, key, model=None),
        model=spec.model,
        task=spec.task,
        output_format=spec.output.format,
        rows_in=rows,
        rows_out=rows,
        rows_errored=0,
        parts=[part],
        errors=part,
        wall_seconds=1.0,
    )
    return commit_partition(fs, path, manifest, [])


def committing_worker(*, commit: int | None = None, tail: list[str] | None = None) -> Worker:
    """A worker that commits the first `commit` partitions of its spec (all by default),
    speaking the worker's Pipes protocol on its log, then prints `tail`."""

    def run(env: dict[str, str]) -> list[str]:
        spec = spec_from_env(env)
        lines = [pipes_line("opened", {"extras": {}}), "INFO engine ready in 1.0s"]
        keys = spec.partition_keys if commit is None else spec.partition_keys[:commit]
        for key in keys:
            manifest = commit_fake_partition(spec, key)
            payload = to_payload(PartitionCommitted(computed=True, manifest=manifest))
            lines.append(pipes_line("report_custom_message", {"payload": payload}))
        if commit is None:
            summary = RunFinished(
                partitions=len(keys),
                partitions_computed=len(keys),
                replicas=spec.replicas,
                model_loads=1,
                wall_seconds=1.0,
            )
            lines.append(pipes_line("report_custom_message", {"payload": to_payload(summary)}))
            lines.append(pipes_line("closed", {}))
        return lines + list(tail or [])

    return run


def crashing_worker(*tail: str) -> Worker:
    def run(env: dict[str, str]) -> list[str]:
        spec_from_env(env)
        return [pipes_line("opened", {"extras": {}}), "INFO loading model /models/minilm", *tail]

    return run


CUDA_OOM = [
    "Traceback (most recent call last):",
    '  File "/app/dagster_gpuinfer/worker/loop/engine.py", line 70, in __init__',
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.02 GiB is free."
    ),
]


# --------------------------------------------------------------------------- harness


def launcher_config(**overrides: Any) -> K8sLauncherConfig:
    values: dict[str, Any] = {
        "image": IMAGE,
        "namespace": NAMESPACE,
        "cache": ModelCache(host_path="/var/lib/gpuinfer/models"),
        "placement": WorkerPlacement(kueue_queue="gpu-inference"),
        "pod_pending_timeout": PENDING_TIMEOUT,
        "poll_interval": POLL,
    }
    values.update(overrides)
    return K8sLauncherConfig(**values)


def fake_cluster_resource(cluster: FakeKubernetes, **resource_fields: Any) -> GpuInferenceResource:
    class FakeClusterResource(GpuInferenceResource):
        def kubernetes_client(self) -> DagsterKubernetesClient:
            return cluster.client()

    resource_fields.setdefault("k8s", launcher_config())
    return FakeClusterResource(launcher="k8s", **resource_fields)


PARTITIONS = dg.StaticPartitionsDefinition(["shard-0", "shard-1", "shard-2"])


def pipeline(tmp_path: Any, **kwargs: Any) -> Any:
    """The reference pipeline over `tmp_path`, its shards written as upstream would."""
    for key in PARTITIONS.get_partition_keys():
        shard = Path(tmp_path) / "in" / f"{key}.parquet"
        if not shard.exists():
            shard.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"doc_id": ["a"], "text": ["x"]}), shard)
    kwargs.setdefault("retry_policy", dg.RetryPolicy(max_retries=1))
    return inference_assets(
        name="doc_embeddings",
        model="/models/minilm",
        task="embed",
        input=InputSpec(uri=f"{tmp_path}/in/{{partition_key}}.parquet", id_column="doc_id"),
        output_root=str(tmp_path / "out"),
        partitions_def=PARTITIONS,
        **kwargs,
    )


def materialize(
    tmp_path: Any,
    cluster: FakeKubernetes,
    *,
    partitions: tuple[str, ...] = ("shard-0",),
    resource: Any = None,
    run_tags: dict[str, str] | None = None,
    **kwargs: Any,
) -> dg.ExecuteInProcessResult:
    pipe = pipeline(tmp_path, **kwargs)
    tags = dict(run_tags or {})
    if len(partitions) > 1:
        tags |= {
            "dagster/asset_partition_range_start": partitions[0],
            "dagster/asset_partition_range_end": partitions[-1],
        }
    return dg.materialize(
        [pipe.output_asset],
        partition_key=partitions[0] if len(partitions) == 1 else None,
        tags=tags,
        resources={"gpu": resource or fake_cluster_resource(cluster)},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def failures(result: dg.ExecuteInProcessResult) -> list[Any]:
    """Every failed attempt of the step: retried ones (STEP_UP_FOR_RETRY) and the last."""
    found = []
    for event in result.all_events:
        if event.is_step_failure:
            found.append(event.step_failure_data)
        elif event.event_type_value == "STEP_UP_FOR_RETRY":
            found.append(event.step_retry_data)
    return found


def _error_text(error: Any) -> str:
    """An error's message with its causes (Dagster wraps the last retry's Failure)."""
    texts = []
    while error is not None:
        texts.append(error.message)
        error = error.cause
    return "\n".join(texts)


def step_failure_message(result: dg.ExecuteInProcessResult) -> str:
    found = failures(result)
    assert found, "the step did not fail"
    return _error_text(found[-1].error)


def failure_metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    data = next(
        (
            f.user_failure_data
            for f in reversed(failures(result))
            if getattr(f, "user_failure_data", None)
        ),
        None,
    )
    assert data is not None, "the failure is not a dagster Failure with metadata"
    return {key: value.value for key, value in data.metadata.items()}


def pod_spec_of(pod: FakePod) -> InferenceSpec:
    return spec_from_env(
        {e["name"]: e.get("value", "") for e in pod.manifest["spec"]["containers"][0]["env"]}
    )
