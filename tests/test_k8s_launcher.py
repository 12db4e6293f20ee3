"""The Kubernetes launcher against an injected fake Kubernetes API.

As dagster-k8s tests its own client, the cluster is replaced at the API boundary: a fake
`CoreV1Api` (pods, logs, events) driven by a fake clock, injected through
`GpuInferenceResource.kubernetes_client`. Everything above it is real: the asset factory,
the resource, `PipesK8sClient`'s log streaming and Pipes message extraction, dagster-k8s's
`wait_for_pod`, Dagster's retry policy, and output partitions committed on disk by a fake
worker that speaks the worker's Pipes protocol.

Each test drives one row of the failure table in `dagster_gpuinfer/pod_failures.py`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
import kubernetes
import pyarrow as pa
import pytest
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._serdes import serialize_value
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
from dagster_gpuinfer.pod_builder import K8sLauncherConfig, SecretEnvRef
from dagster_gpuinfer.pod_failures import (
    classify_pod_failure,
    last_error_lines,
    step_down_memory,
)
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    Manifest,
    commit_partition,
    filesystem_for,
    partition_dir,
    table_to_parquet_bytes,
    write_file_entry,
)

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
    """Commit a real output partition the way the worker does (files, then the manifest)."""
    fs, path = filesystem_for(partition_dir(spec.output, key), spec.storage)
    table = pa.table({"id": [f"{key}:{i}" for i in range(rows)], "embedding": [[0.1, 0.2]] * rows})
    part = write_file_entry(
        fs, path, f"part-{spec.spec_hash()}-00000.parquet", table_to_parquet_bytes(table), rows
    )
    manifest = Manifest(
        partition_key=key,
        spec_hash=spec.spec_hash(),
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
            payload = {
                "type": "partition",
                "computed": True,
                "manifest": manifest.model_dump(mode="json"),
            }
            lines.append(pipes_line("report_custom_message", {"payload": payload}))
        if commit is None:
            summary = {
                "type": "run",
                "partitions": len(keys),
                "partitions_computed": len(keys),
                "replicas": spec.replicas,
                "model_loads": 1,
                "wall_seconds": 1.0,
            }
            lines.append(pipes_line("report_custom_message", {"payload": summary}))
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
    '  File "/app/dagster_gpuinfer/worker/engine.py", line 70, in __init__',
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
        "model_cache_host_path": "/var/lib/gpuinfer/models",
        "kueue_queue": "gpu-inference",
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
    **kwargs: Any,
) -> dg.ExecuteInProcessResult:
    pipe = pipeline(tmp_path, **kwargs)
    tags = {}
    if len(partitions) > 1:
        tags = {
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


# --------------------------------------------------------------------------- success path


def test_partition_materializes_through_pipes_k8s_client_and_pod_is_deleted(tmp_path):
    cluster = FakeKubernetes(PodScript(pulling_for=30, worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert result.success
    assert [pod.name for pod in cluster.created] == cluster.deleted, "every pod is deleted"
    pod = cluster.created[0]
    labels = pod.manifest["metadata"]["labels"]
    assert labels["dagster/run-id"] == result.run_id
    assert labels["gpuinfer.dagster.io/partition"] == "shard-0"
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-inference"
    env_names = [e["name"] for e in pod.manifest["spec"]["containers"][0]["env"]]
    assert DAGSTER_PIPES_CONTEXT_ENV_VAR in env_names, "Pipes context injected by PipesK8sClient"
    assert pod_spec_of(pod).partition_keys == ["shard-0"]
    materializations = result.asset_materializations_for_node("doc_embeddings")
    assert [m.partition for m in materializations] == ["shard-0"]
    assert materializations[0].metadata["rows_out"].value == 3
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    assert checks == {"rows_balanced": True, "error_rate": True}


def test_fatal_worker_message_fails_without_retry(tmp_path):
    def fatal_worker(env: dict[str, str]) -> list[str]:
        payload = {
            "type": "fatal",
            "error_type": "bad_shard",
            "partition_key": "shard-0",
            "message": "shard in/shard-0.parquet does not exist",
        }
        return [
            pipes_line("opened", {"extras": {}}),
            pipes_line("report_custom_message", {"payload": payload}),
            pipes_line("closed", {}),
        ]

    cluster = FakeKubernetes(PodScript(worker=fatal_worker), PodScript(worker=fatal_worker))

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 1, "a bad shard is not retried"
    assert "shard in/shard-0.parquet does not exist" in step_failure_message(result)


# --------------------------------------------------------------------------- pending and queueing


def test_pending_pod_past_timeout_fails_retryable_and_is_deleted(tmp_path):
    cluster = FakeKubernetes(
        PodScript(unschedulable_for=math.inf), PodScript(unschedulable_for=math.inf)
    )

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 2, "retryable: the retry policy launched a second pod"
    assert cluster.deleted == [pod.name for pod in cluster.created]
    message = step_failure_message(result)
    assert "Insufficient nvidia.com/gpu" in message, "the scheduler's reason is in the failure"
    assert "pod_pending_timeout" in message
    assert failure_metadata(result)["pod_failure"] == "unschedulable"
    per_pod = cluster.clock.now / 2
    assert PENDING_TIMEOUT < per_pod <= PENDING_TIMEOUT + 3 * POLL, (
        "failed at the timeout, not later"
    )


def test_pod_waiting_for_kueue_admission_is_not_failed_by_pending_timeout(tmp_path):
    cluster = FakeKubernetes(
        PodScript(queued_for=10 * PENDING_TIMEOUT, unschedulable_for=60, worker=committing_worker())
    )

    result = materialize(tmp_path, cluster)

    assert result.success
    assert len(cluster.created) == 1
    assert cluster.clock.now > 10 * PENDING_TIMEOUT


def test_kueue_queue_timeout_fails_retryable(tmp_path):
    cluster = FakeKubernetes(PodScript(queued_for=math.inf), PodScript(queued_for=math.inf))
    resource = fake_cluster_resource(cluster, k8s=launcher_config(queue_timeout=600.0))

    result = materialize(tmp_path, cluster, resource=resource)

    assert len(cluster.created) == 2
    assert failure_metadata(result)["pod_failure"] == "queue_timeout"
    assert "gpu-inference" in step_failure_message(result)
    assert cluster.deleted == [pod.name for pod in cluster.created]


def test_slow_image_pull_within_timeout_is_not_a_failure(tmp_path):
    cluster = FakeKubernetes(
        PodScript(unschedulable_for=100, pulling_for=150, worker=committing_worker())
    )

    assert materialize(tmp_path, cluster).success


# --------------------------------------------------------------------------- image and config errors


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_image_pull_failure_fails_fast_without_retry_and_names_the_image(tmp_path, reason):
    script = PodScript(pulling_for=20, waiting_reason=reason, waiting_message="manifest unknown")
    cluster = FakeKubernetes(script, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 1, "not retried"
    assert cluster.deleted == [cluster.created[0].name]
    message = step_failure_message(result)
    assert IMAGE in message and reason in message
    assert failure_metadata(result)["pod_failure"] == "image_pull"
    assert cluster.clock.now <= 20 + 2 * POLL, "fails at the first sight of the pull error"


def test_missing_secret_fails_not_retried_naming_the_secret(tmp_path):
    script = PodScript(
        waiting_reason="CreateContainerConfigError", waiting_message='secret "hf-token" not found'
    )
    cluster = FakeKubernetes(script, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert len(cluster.created) == 1
    assert 'secret "hf-token" not found' in step_failure_message(result)
    assert failure_metadata(result)["pod_failure"] == "config_error"


def test_api_forbidden_is_not_retried_and_points_at_rbac(tmp_path):
    cluster = FakeKubernetes()
    cluster.create_error = kubernetes.client.ApiException(status=403, reason="Forbidden")
    cluster.create_error.body = json.dumps(
        {
            "message": 'pods is forbidden: User "system:serviceaccount:dagster:default" cannot create resource "pods"'
        }
    )

    result = materialize(tmp_path, cluster)

    message = step_failure_message(result)
    assert "deploy/rbac.yaml" in message and "cannot create resource" in message
    assert failure_metadata(result)["retryable"] is False


# --------------------------------------------------------------------------- out of memory


def test_oom_killed_worker_is_relaunched_once_with_smaller_batches_recorded_in_metadata(tmp_path):
    cluster = FakeKubernetes(
        PodScript(
            worker=crashing_worker("INFO loading weights"),
            exit_code=137,
            terminated_reason="OOMKilled",
        ),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert result.success
    first, second = (pod_spec_of(pod) for pod in cluster.created)
    assert (first.engine.max_num_seqs, second.engine.max_num_seqs) == (None, 128)
    assert (first.engine.gpu_memory_utilization, second.engine.gpu_memory_utilization) == (0.9, 0.8)
    assert first.spec_hash() == second.spec_hash(), "committed chunks stay valid"
    assert cluster.created[1].manifest["metadata"]["labels"]["gpuinfer.dagster.io/launch"] == "1"
    assert cluster.deleted == [pod.name for pod in cluster.created]
    metadata = result.asset_materializations_for_node("doc_embeddings")[0].metadata
    step_down = metadata["memory_step_down"].value
    assert step_down["max_num_seqs"] == {"from": None, "to": 128}
    assert step_down["gpu_memory_utilization"] == {"from": 0.9, "to": 0.8}
    assert "OOMKilled" in step_down["first_failure"]
    assert metadata["engine_args"].value["max_num_seqs"] == 128, "metadata shows what ran"


def test_cuda_out_of_memory_at_engine_start_is_stepped_down(tmp_path):
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker(*CUDA_OOM), exit_code=1),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert result.success
    assert len(cluster.created) == 2


def test_out_of_memory_twice_fails_with_a_hint_and_is_not_retried(tmp_path):
    oom = PodScript(worker=crashing_worker(), exit_code=137, terminated_reason="OOMKilled")
    cluster = FakeKubernetes(
        oom,
        PodScript(worker=crashing_worker(*CUDA_OOM), exit_code=1),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=dg.RetryPolicy(max_retries=2))

    assert not result.success
    assert len(cluster.created) == 2, "one step-down, then no more launches"
    message = step_failure_message(result)
    for hint in (
        "max_num_seqs",
        "gpu_memory_utilization",
        "k8s.memory_limit",
        "tensor_parallel_size",
    ):
        assert hint in message


def test_kv_cache_too_small_is_not_stepped_down(tmp_path):
    too_small = (
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (20000). Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine."
    )
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker(too_small), exit_code=1),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster)

    assert len(cluster.created) == 1
    assert "max_model_len" in step_failure_message(result)
    assert failure_metadata(result)["pod_failure"] == "kv_cache_too_small"


# --------------------------------------------------------------------------- disruptions


def test_evicted_pod_is_retried_and_the_retry_resumes_from_committed_work(tmp_path):
    evicted = PodScript(
        worker=committing_worker(commit=1),
        exit_code=137,
        pod_reason="Evicted",
        pod_message="The node was low on resource: memory. Threshold quantity: 100Mi.",
    )
    cluster = FakeKubernetes(evicted, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster, partitions=("shard-0", "shard-1"))

    assert result.success
    first_failure = _error_text(failures(result)[0].error)
    assert "Evicted" in first_failure and "resumes from the committed chunks" in first_failure
    assert pod_spec_of(cluster.created[0]).partition_keys == ["shard-0", "shard-1"]
    assert pod_spec_of(cluster.created[1]).partition_keys == ["shard-1"], "shard-0 was committed"
    assert sorted(
        m.partition for m in result.asset_materializations_for_node("doc_embeddings")
    ) == ["shard-0", "shard-1"]


@pytest.mark.parametrize(
    ("script", "words"),
    [
        (PodScript(exit_code=143, disruption="PreemptionByScheduler"), "PreemptionByScheduler"),
        (PodScript(exit_code=137, disruption="DeletionByTaintManager"), "DeletionByTaintManager"),
        (
            PodScript(exit_code=137, pod_reason="NodeLost", pod_message="node gpu-node-1 is lost"),
            "NodeLost",
        ),
        (PodScript(exit_code=137, pod_reason="DeadlineExceeded"), "activeDeadlineSeconds"),
    ],
    ids=["preempted", "node-not-ready", "node-lost", "deadline"],
)
def test_preempted_or_lost_pod_fails_retryable(tmp_path, script, words):
    script.worker = crashing_worker()
    cluster = FakeKubernetes(script, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert result.success, "the retry policy ran the step again"
    assert len(cluster.created) == 2
    assert words in _error_text(failures(result)[0].error)


def test_pod_deleted_from_outside_while_running_fails_promptly(tmp_path):
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker("INFO chunk 3 of 40"), vanish_after_logs=True)
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert not result.success
    assert "deleted from outside" in step_failure_message(result)
    assert failure_metadata(result)["retryable"] is True
    assert cluster.polls_after_vanish <= 4, "noticed within two polls, not after a timeout"
    assert cluster.clock.now - cluster.vanished_at <= 2 * POLL


def test_worker_nonzero_exit_puts_its_last_error_lines_in_the_failure(tmp_path):
    traceback = [
        "Traceback (most recent call last):",
        '  File "/app/dagster_gpuinfer/worker/shard.py", line 88, in process_shard',
        "RuntimeError: replica 1 failed: NCCL error in: ../csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970",
    ]
    cluster = FakeKubernetes(PodScript(worker=crashing_worker(*traceback), exit_code=1))

    result = materialize(tmp_path, cluster, retry_policy=None)

    message = step_failure_message(result)
    assert "exited with code 1" in message
    assert "RuntimeError: replica 1 failed: NCCL error" in message
    assert "__dagster_pipes_version" not in message, "protocol lines are not error lines"
    assert failure_metadata(result)["pod_failure"] == "worker_crash"


def test_run_cancellation_deletes_the_pod(tmp_path):
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker("INFO chunk 1 of 40"), interrupt_after_logs=True),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert not result.success
    assert len(cluster.created) == 1
    assert cluster.deleted == [cluster.created[0].name]
    assert cluster.pods == {}


# --------------------------------------------------------------------------- secrets and pools


PLANTED = "planted-s3cr3t-value-7f3a9c"


def test_planted_secret_is_never_in_pod_bodies_dagster_logs_or_metadata(tmp_path, monkeypatch):
    # The control plane's own environment holds the secret too: nothing may forward it.
    monkeypatch.setenv("HF_TOKEN", PLANTED)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED)
    secrets = {"hf-token": {"token": PLANTED}, "s3-creds": {"AWS_SECRET_ACCESS_KEY": PLANTED}}
    seen_by_worker: list[str] = []

    def worker(env: dict[str, str]) -> list[str]:
        seen_by_worker.extend([env["HF_TOKEN"], env["AWS_SECRET_ACCESS_KEY"]])
        return committing_worker()(env)

    config = launcher_config(
        secret_env=[SecretEnvRef(env_name="HF_TOKEN", secret_name="hf-token", key="token")],
        secret_env_from=["s3-creds"],
    )
    cluster = FakeKubernetes(
        PodScript(worker=worker),
        PodScript(worker=crashing_worker("RuntimeError: boom"), exit_code=1),
        secrets=secrets,
    )
    instance = dg.DagsterInstance.ephemeral()
    pipe = pipeline(tmp_path, retry_policy=None)
    runs = [
        dg.materialize(
            [pipe.output_asset],
            partition_key=key,
            instance=instance,
            raise_on_error=False,
            resources={"gpu": fake_cluster_resource(cluster, k8s=config)},
        )
        for key in ("shard-0", "shard-1")
    ]

    assert runs[0].success and not runs[1].success
    assert seen_by_worker == [PLANTED, PLANTED], "the worker does get the secret, from the cluster"
    pod_env = cluster.created[0].manifest["spec"]["containers"][0]["env"]
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}},
    } in pod_env
    for pod in cluster.created:
        assert PLANTED not in json.dumps(pod.manifest)
    for run in runs:
        for record in instance.all_logs(run.run_id):
            assert PLANTED not in serialize_value(record)
    for materialization in runs[0].asset_materializations_for_node("doc_embeddings"):
        assert PLANTED not in serialize_value(materialization)


def test_plain_env_with_a_credential_name_is_refused_before_any_pod(tmp_path):
    cluster = FakeKubernetes()
    resource = fake_cluster_resource(cluster, k8s=launcher_config(env={"HF_TOKEN": "hf_abc"}))

    result = materialize(tmp_path, cluster, resource=resource)

    assert cluster.created == []
    message = step_failure_message(result)
    assert "HF_TOKEN" in message and "secret_env" in message


def test_step_outside_the_gpu_pool_is_logged_as_uncapped(tmp_path):
    def log_messages(pool: str | None) -> list[str]:
        cluster = FakeKubernetes(PodScript(worker=committing_worker()))
        instance = dg.DagsterInstance.ephemeral()
        pipe = pipeline(tmp_path / str(pool), pool=pool)
        result = dg.materialize(
            [pipe.output_asset],
            partition_key="shard-0",
            instance=instance,
            resources={"gpu": fake_cluster_resource(cluster, k8s=launcher_config(pool="gpu-h100"))},
        )
        assert result.success
        assert (
            cluster.created[0].manifest["metadata"]["labels"]["gpuinfer.dagster.io/pool"]
            == "gpu-h100"
        )
        return [entry.user_message for entry in instance.all_logs(result.run_id)]

    assert any("not capped" in message for message in log_messages(None))
    assert not any("not capped" in message for message in log_messages("gpu-h100"))


def test_launcher_k8s_without_pod_configuration_fails_with_what_to_set(tmp_path):
    cluster = FakeKubernetes()
    resource = fake_cluster_resource(cluster, k8s=None)

    result = materialize(tmp_path, cluster, resource=resource)

    assert "K8sLauncherConfig(image=" in step_failure_message(result)
    assert cluster.created == []


# --------------------------------------------------------------------------- pure helpers


def test_classification_without_a_pod_is_deletion():
    failure = classify_pod_failure(pod=None, pod_name="p", image=IMAGE)
    assert (failure.kind, failure.retryable) == ("deleted", True)


def test_last_error_lines_keeps_the_last_traceback_and_drops_pipes_messages():
    log = "\n".join(
        [
            pipes_line("opened", {}),
            "Traceback (most recent call last):",
            "ValueError: old",
            "INFO retrying",
            "Traceback (most recent call last):",
            '  File "x.py", line 1',
            "KeyError: 'text'",
            pipes_line("closed", {}),
        ]
    )
    assert (
        last_error_lines(log)
        == "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'text'"
    )


def test_step_down_halves_batches_and_keeps_the_spec_hash():
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "embed",
            "input": {"uri": "in/{partition_key}.parquet"},
            "output": {"root": "out", "asset_name": "a"},
            "engine": {"max_num_seqs": 64, "gpu_memory_utilization": 0.3},
        }
    )
    stepped, change = step_down_memory(spec)
    assert (stepped.engine.max_num_seqs, stepped.engine.gpu_memory_utilization) == (32, 0.24)
    assert change == {
        "max_num_seqs": {"from": 64, "to": 32},
        "gpu_memory_utilization": {"from": 0.3, "to": 0.24},
    }
    assert stepped.spec_hash() == spec.spec_hash()


def test_control_plane_imports_neither_torch_nor_vllm_and_kubernetes_only_for_k8s():
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import dagster_gpuinfer.resource, dagster_gpuinfer.pod_builder, dagster_gpuinfer.pod_failures\n"
        "light = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm', 'kubernetes', 'dagster_k8s'})\n"
        "import dagster_gpuinfer.launchers.k8s, resources.k8s\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm'})\n"
        "print(light, heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent),
    )
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
