"""`build_worker_pod`: the Kubernetes pod of one worker, as a pure function.

The pod is built from the job spec, the Kubernetes launcher configuration and the identity of
the run, with no I/O and no cluster: the same inputs always give the same manifest (a plain
`dict` in the Kubernetes API's camelCase, ready for `kubectl apply` or the Python client).

What every worker pod gets:

- `nvidia.com/gpu` (or the configured resource) = `tensor_parallel_size x replicas`; the
  worker slices `CUDA_VISIBLE_DEVICES` per replica itself.
- `/dev/shm` as a memory-backed `emptyDir` with a size limit (NCCL and vLLM's tensor-parallel
  workers need more than the container runtime's 64 MiB default).
- The model cache (a PVC or a hostPath) mounted read-only at `/models`, and the Hugging Face
  hub pointed at it in offline mode, so no job downloads weights at start.
- Secrets only by reference (`valueFrom.secretKeyRef`, `envFrom.secretRef`); plain `env`
  refuses names that look like credentials.
- Non-root, no privilege escalation, all capabilities dropped, read-only root filesystem
  with a scratch `emptyDir` at `/tmp`, no service account token unless asked for.
- Labels with the run id, asset, partition keys (hashed or truncated to valid label values),
  spec hash and the Kueue `kueue.x-k8s.io/queue-name`; the full partition keys go to an
  annotation, where no length or character rule applies.

The configuration groups what belongs together: `K8sLauncherConfig.placement` (GPUs, nodes,
Kueue), `.cache` (the model cache volume), `.security` (identity and hardening) and
`.secrets` (references to Kubernetes Secrets).

This module imports only the standard library, pydantic and dagster (for `dg.Config`), so the
control plane can build and test pods without the `kubernetes` client installed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from dagster_gpuinfer.secrets import is_secret_env_name, url_with_credentials
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.worker import WORKER_MODULE

MODEL_CACHE_MOUNT = "/models"
"""Where the model cache is mounted, read-only, in every worker pod."""

HF_HUB_CACHE = f"{MODEL_CACHE_MOUNT}/hub"
"""Hugging Face hub cache inside the model cache, for specs that name a hub id."""

WORKER_CONTAINER = "worker"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The pod label that hands a pod to a Kueue LocalQueue."""
LABEL_PREFIX = "gpuinfer.dagster.io"

_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# Kubernetes resource.Quantity: a signed decimal with an optional binary or decimal suffix.
_QUANTITY = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)


class PodSpecError(ValueError):
    """The launcher configuration or the spec cannot make a valid pod; the message says
    which field and what to change. Raised before anything reaches the cluster."""


# --------------------------------------------------------------------------- configuration


class SecretEnvRef(dg.Config):
    """One environment variable of the worker, taken from a key of a Kubernetes Secret."""

    env_name: str = Field(description="Environment variable the worker sees, e.g. HF_TOKEN.")
    secret_name: str = Field(description="Name of the Secret in the worker's namespace.")
    key: str = Field(description="Key inside the Secret.")


class Toleration(dg.Config):
    """A Kubernetes toleration, e.g. for the `nvidia.com/gpu:NoSchedule` taint of GPU nodes."""

    key: str | None = Field(None, description="Taint key; None with operator Exists tolerates all.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value, for operator Equal.")
    effect: str | None = Field(
        None,
        description="Taint effect to tolerate: NoSchedule, PreferNoSchedule or NoExecute; None "
        "tolerates every effect.",
    )
    toleration_seconds: int | None = Field(
        None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class WorkerPlacement(dg.Config):
    """Where worker pods run: which GPUs, which nodes, which Kueue queue and priority."""

    gpu_resource_name: str | None = Field(
        "nvidia.com/gpu",
        description="Extended resource that counts GPUs. None runs CPU-only workers (a test "
        "cluster with the vllm-cpu image).",
    )
    gpu_type_label: str = Field(
        "nvidia.com/gpu.product",
        description="Node label that names the GPU model (NVIDIA GPU feature discovery's).",
    )
    gpu_type: str | None = Field(
        None,
        description="Required value of gpu_type_label, e.g. NVIDIA-H100-80GB-HBM3; None accepts "
        "any GPU node. Kueue ResourceFlavors use the same label.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra nodeSelector entries for the worker pods."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Tolerations, e.g. [Toleration(key='nvidia.com/gpu', effect='NoSchedule')].",
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Kubernetes affinity of the worker pod, as in a pod manifest (camelCase)."
    )
    priority_class: str | None = Field(
        None, description="PriorityClass of the worker pods (deploy/kueue/priority-classes.yaml)."
    )
    kueue_queue: str | None = Field(
        None,
        description="Kueue LocalQueue in the namespace; sets the kueue.x-k8s.io/queue-name label "
        "so Kueue admits the pod against its ClusterQueue's GPU quota.",
    )


class ModelCache(dg.Config):
    """The volume holding model weights, mounted read-only at `/models`: a PVC or a hostPath."""

    pvc: str | None = Field(
        None,
        description="PersistentVolumeClaim holding the model cache, mounted read-only at "
        f"{MODEL_CACHE_MOUNT}. Exclusive with host_path.",
    )
    host_path: str | None = Field(
        None,
        description="Node directory holding the model cache (filled by the cache warmer "
        f"DaemonSet), mounted read-only at {MODEL_CACHE_MOUNT}.",
    )

    @property
    def configured(self) -> bool:
        return bool(self.pvc or self.host_path)


class PodSecurity(dg.Config):
    """Who the worker runs as and what it may do."""

    service_account: str | None = Field(
        None,
        description="ServiceAccount of the worker pods (deploy/rbac.yaml: gpuinfer-worker, with "
        "no permissions). Not the launcher's account: the worker never calls the API.",
    )
    automount_service_account_token: bool = Field(
        False,
        description="Mount the service account token in the worker. Off: the worker does not "
        "talk to the Kubernetes API. Turn on only for IRSA/workload identity setups that need it.",
    )
    run_as_user: int = Field(1000, ge=1, description="UID of the worker (non-root).")
    run_as_group: int = Field(1000, ge=1, description="GID of the worker.")
    read_only_root_filesystem: bool = Field(
        True,
        description="Read-only root filesystem; the worker writes only to /tmp (scratch) and "
        "its output storage.",
    )


class SecretRefs(dg.Config):
    """Kubernetes Secrets the worker pod uses, by name only: values stay in the cluster."""

    env: list[SecretEnvRef] = Field(
        default_factory=list,
        description="Environment variables taken from Secret keys (valueFrom.secretKeyRef).",
    )
    env_from: list[str] = Field(
        default_factory=list,
        description="Secrets whose every key becomes an environment variable (envFrom), e.g. "
        "an S3 credentials Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.",
    )
    image_pull: list[str] = Field(
        default_factory=list, description="Names of docker-registry Secrets for a private registry."
    )


class K8sLauncherConfig(dg.Config):
    """How worker pods look on the cluster: image, resources, placement, cache, security, secrets.

    Examples:
        >>> K8sLauncherConfig(
        ...     image="registry.example.com/gpuinfer-worker:0.1.0",
        ...     namespace="team-a",
        ...     placement=WorkerPlacement(
        ...         gpu_type="NVIDIA-H100-80GB-HBM3", kueue_queue="gpu-inference"
        ...     ),
        ...     cache=ModelCache(pvc="model-cache"),
        ...     secrets=SecretRefs(
        ...         env=[SecretEnvRef(env_name="HF_TOKEN", secret_name="hf", key="token")]
        ...     ),
        ... )
    """

    image: str = Field(
        description="Worker image (deploy/worker/Dockerfile): the project's worker extra on a "
        "pinned vLLM base. One image serves every model in the model cache."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Kubernetes imagePullPolicy of the worker container."
    )
    command: list[str] = Field(
        default_factory=lambda: ["python3", "-m", WORKER_MODULE],
        description="Command of the worker container; the image's Python running the worker.",
    )
    namespace: str = Field("default", description="Namespace the worker pods run in.")
    placement: WorkerPlacement = Field(
        default_factory=WorkerPlacement,
        description="GPU resource and model, node selector, tolerations, affinity, priority "
        "class and Kueue queue of the worker pods.",
    )
    cache: ModelCache = Field(
        default_factory=ModelCache,
        description=f"The model cache volume (a PVC or a hostPath) mounted at {MODEL_CACHE_MOUNT}.",
    )
    security: PodSecurity = Field(
        default_factory=PodSecurity,
        description="ServiceAccount, token mount, UID/GID and root filesystem of the worker.",
    )
    secrets: SecretRefs = Field(
        default_factory=SecretRefs,
        description="Secret references: environment variables, envFrom Secrets, image pull "
        "Secrets. Only names travel; the values stay in the cluster.",
    )
    shm_size: str = Field("16Gi", description="Size limit of the memory-backed /dev/shm.")
    scratch_size: str = Field("20Gi", description="Size limit of the writable /tmp emptyDir.")
    cpu_request: str = Field("4", description="CPU request of the worker container.")
    cpu_limit: str | None = Field(None, description="CPU limit; None leaves CPU unthrottled.")
    memory_request: str = Field("32Gi", description="Memory request of the worker container.")
    memory_limit: str | None = Field(
        None,
        description="Memory limit; above it the container is OOMKilled (retried once with "
        "smaller vLLM batches). None: bounded by the node.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain environment variables of the worker. Names that look like "
        "credentials (TOKEN, SECRET, PASSWORD, ACCESS_KEY, ...) are refused: use secrets.env.",
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    pod_pending_timeout: float = Field(
        1800.0,
        gt=0,
        description="Seconds a pod may take to start once Kueue admitted it (scheduling, image "
        "pull, volume mounts). Past it the step fails, retryable, with the scheduler's reason, "
        "and the pod is deleted.",
    )
    queue_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds a pod may wait for Kueue admission (scheduling gate). None: wait "
        "as long as the queue needs; Kueue's quota is the intended back-pressure.",
    )
    active_deadline_seconds: int = Field(
        86400,
        gt=0,
        description="activeDeadlineSeconds of the pod: the kubelet kills a worker running longer. "
        "A retry resumes from committed chunks.",
    )
    poll_interval: float = Field(5.0, gt=0, description="Seconds between pod status polls.")
    pool: str | None = Field(
        None,
        description="Dagster concurrency pool of the inference assets (one slot per pod). "
        "Pods are labelled with it, and a step outside this pool is logged as uncapped.",
    )
    kubeconfig_file: str | None = Field(
        None, description="Kubeconfig for the launcher; None: in-cluster config, else ~/.kube."
    )
    kube_context: str | None = Field(None, description="Context inside kubeconfig_file.")
    load_incluster_config: bool | None = Field(
        None, description="Force in-cluster config (True) or kubeconfig (False); None: detect."
    )


@dataclass(frozen=True)
class RunIdentity:
    """Which Dagster run, step attempt and launch a pod belongs to.

    Attributes:
        run_id: The Dagster run id.
        asset_key: The output asset, as a user string (`prefix/name`).
        job_name: The Dagster job.
        retry_number: Dagster's step retry number (0 on the first attempt).
        launch_attempt: Launches within one step attempt (1 after an out-of-memory step-down).
    """

    run_id: str
    asset_key: str
    job_name: str | None = None
    retry_number: int = 0
    launch_attempt: int = 0


# --------------------------------------------------------------------------- names and labels


def _short_hash(text: str, length: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _hashed_label(readable: str, original: str) -> str:
    """`readable` cleaned to label characters and cut to fit a hash of `original` after it."""
    digest = _short_hash(original)
    head = re.sub(r"[^A-Za-z0-9._-]+", "-", readable)[: 63 - len(digest) - 1]
    head = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", head)
    return f"{head}-{digest}" if head else digest


def label_value(text: str) -> str:
    """`text` as a valid label value: at most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends.

    A value that had to change (invalid characters, too long) gets a hash of the original
    appended, so two different inputs never share a label value.
    """
    if _LABEL_NAME.match(text) and len(text) <= 63:
        return text
    return _hashed_label(text, text)


def dns_label(text: str, max_length: int = 63) -> str:
    """`text` as a DNS-1123 label (lowercase alphanumerics and `-`), at most `max_length`."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    cleaned = re.sub(r"-{2,}", "-", cleaned)[:max_length].strip("-")
    return cleaned or _short_hash(text, 8)


def worker_pod_name(identity: RunIdentity) -> str:
    """`gpuinfer-<asset>-<run id>-r<retry>-a<launch>`: unique per launch, stable per input."""
    asset = dns_label(identity.asset_key.replace("/", "-"), 24)
    run = dns_label(identity.run_id.replace("-", ""), 12)
    return f"gpuinfer-{asset}-{run}-r{identity.retry_number}-a{identity.launch_attempt}"


def partition_label(partition_keys: list[str]) -> str:
    """One label value for the run's partitions: the key itself when there is one valid
    key, else a readable `first..last` with a hash of the full list."""
    if not partition_keys:
        return "none"
    if len(partition_keys) == 1:
        return label_value(partition_keys[0])
    readable = f"{partition_keys[0]}..{partition_keys[-1]}"
    return _hashed_label(readable, json.dumps(partition_keys))


# --------------------------------------------------------------------------- validation


def _check_quantity(field: str, value: str | None) -> None:
    if value is not None and not _QUANTITY.match(str(value)):
        raise PodSpecError(
            f"k8s.{field}={value!r} is not a Kubernetes quantity; write e.g. '4', '500m', "
            "'32Gi' or '1.5'"
        )


def _check_label_key(where: str, key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or not (
        name and len(name) <= 63 and _LABEL_NAME.match(name)
    ):
        raise PodSpecError(
            f"{where} key {key!r} is not a valid Kubernetes label key: an optional DNS prefix "
            "and '/', then at most 63 of [A-Za-z0-9._-], alphanumeric at both ends"
        )


def _check_env_names(where: str, names: list[str], *, allow_secret_like: bool) -> None:
    for name in names:
        if not _ENV_NAME.match(name):
            raise PodSpecError(f"{where}: {name!r} is not a valid environment variable name")
        if not allow_secret_like and is_secret_env_name(name):
            raise PodSpecError(
                f"{where}: {name!r} looks like a credential, and plain env values end up in the "
                "pod manifest for anyone who can read pods. Put the value in a Kubernetes "
                f"Secret and pass k8s.secrets.env=[SecretEnvRef(env_name={name!r}, "
                "secret_name=..., key=...)] instead"
            )


def _check_placement(placement: WorkerPlacement) -> None:
    if placement.gpu_resource_name is not None:
        _check_label_key("k8s.placement.gpu_resource_name", placement.gpu_resource_name)
    _check_label_key("k8s.placement.gpu_type_label", placement.gpu_type_label)
    if placement.gpu_type is not None and label_value(placement.gpu_type) != placement.gpu_type:
        raise PodSpecError(
            f"k8s.placement.gpu_type={placement.gpu_type!r} is not a valid label value"
        )
    if placement.kueue_queue is not None and not _DNS_SUBDOMAIN.match(placement.kueue_queue):
        raise PodSpecError(
            f"k8s.placement.kueue_queue={placement.kueue_queue!r} is not a LocalQueue name "
            "(lowercase letters, digits, '-' and '.')"
        )
    for toleration in placement.tolerations:
        _check_toleration(toleration)


def _check_toleration(toleration: Toleration) -> None:
    if toleration.operator == "Exists" and toleration.value is not None:
        raise PodSpecError(
            f"toleration {toleration.key!r} has operator Exists and a value; use operator "
            "'Equal' to match a value, or drop the value"
        )
    if toleration.effect not in (None, "NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise PodSpecError(
            f"toleration {toleration.key!r} has effect {toleration.effect!r}; use NoSchedule, "
            "PreferNoSchedule, NoExecute, or None for all"
        )


def _check_cache(cache: ModelCache) -> None:
    if cache.pvc and cache.host_path:
        raise PodSpecError(
            "k8s.cache.pvc and k8s.cache.host_path are both set; the model cache is one "
            "volume: keep the PVC (shared storage) or the hostPath (node-local cache)"
        )
    if cache.host_path is not None and not cache.host_path.startswith("/"):
        raise PodSpecError(
            f"k8s.cache.host_path={cache.host_path!r} must be an absolute path on the node, "
            "e.g. /var/lib/gpuinfer/models"
        )


def _check_labels(config: K8sLauncherConfig) -> None:
    for where, mapping in (
        ("k8s.labels", config.labels),
        ("k8s.placement.node_selector", config.placement.node_selector),
    ):
        for key, value in mapping.items():
            _check_label_key(where, key)
            if label_value(value) != value:
                raise PodSpecError(
                    f"{where}[{key!r}]={value!r} is not a valid label value: at most 63 of "
                    "[A-Za-z0-9._-], alphanumeric at both ends"
                )
    for key in config.annotations:
        _check_label_key("k8s.annotations", key)


def _check_env_and_secrets(config: K8sLauncherConfig, extra_env: Mapping[str, str]) -> None:
    secrets = config.secrets
    _check_env_names("k8s.env", list(config.env), allow_secret_like=False)
    _check_env_names("GpuInferenceResource.env", list(extra_env), allow_secret_like=False)
    _check_env_values("k8s.env", config.env)
    _check_env_values("GpuInferenceResource.env", extra_env)
    _check_env_names(
        "k8s.secrets.env", [ref.env_name for ref in secrets.env], allow_secret_like=True
    )
    for name in [*secrets.image_pull, *secrets.env_from, *(r.secret_name for r in secrets.env)]:
        if not _DNS_SUBDOMAIN.match(name):
            raise PodSpecError(f"Secret name {name!r} is not a valid Kubernetes object name")


def _check_env_values(where: str, env: Mapping[str, str]) -> None:
    """Plain env values are in the pod manifest: a URL with a password is refused."""
    for name, value in env.items():
        if url_with_credentials(str(value)):
            raise PodSpecError(
                f"{where}[{name!r}] is a URL with credentials in it, and plain env values end "
                "up in the pod manifest for anyone who can read pods. Put the URL in a "
                f"Kubernetes Secret and pass k8s.secrets.env=[SecretEnvRef(env_name={name!r}, "
                "secret_name=..., key=...)] instead"
            )


def validate_launcher_config(config: K8sLauncherConfig, extra_env: Mapping[str, str]) -> None:
    """Every rule the pod builder relies on, checked before anything is built.

    Raises:
        PodSpecError: naming the field and what to write instead.
    """
    if not config.image.strip():
        raise PodSpecError(
            "k8s.image is empty; set the worker image, e.g. 'repo/gpuinfer-worker:0.1.0'"
        )
    if not config.command:
        raise PodSpecError(
            "k8s.command is empty; the default runs python3 -m dagster_gpuinfer.worker"
        )
    if not _DNS_LABEL.match(config.namespace):
        raise PodSpecError(f"k8s.namespace={config.namespace!r} is not a valid namespace name")
    for field in (
        "shm_size",
        "scratch_size",
        "cpu_request",
        "cpu_limit",
        "memory_request",
        "memory_limit",
    ):
        _check_quantity(field, getattr(config, field))
    _check_cache(config.cache)
    _check_placement(config.placement)
    _check_labels(config)
    _check_env_and_secrets(config, extra_env)


def _check_model_location(spec: InferenceSpec, cache: ModelCache) -> None:
    model = spec.model.removeprefix("file://")
    if model.startswith(("./", "../", "~")):
        raise PodSpecError(
            f"model {spec.model!r} is a path relative to the code location; a pod cannot see "
            f"it. Copy the model into the model cache and set model='{MODEL_CACHE_MOUNT}/<name>'"
        )
    if (
        cache.configured
        and model.startswith("/")
        and not (model == MODEL_CACHE_MOUNT or model.startswith(MODEL_CACHE_MOUNT + "/"))
    ):
        raise PodSpecError(
            f"model {spec.model!r} is outside the model cache, which pods mount read-only at "
            f"{MODEL_CACHE_MOUNT}. Warm the cache (deploy/model-cache/) and set "
            f"model='{MODEL_CACHE_MOUNT}/<name>'"
        )


# --------------------------------------------------------------------------- the pod


def gpus_per_pod(spec: InferenceSpec) -> int:
    """GPUs one worker pod requests: one engine of `tensor_parallel_size x
    pipeline_parallel_size` GPUs per replica (a group's pods: `spec.ranks_per_node()`)."""
    return spec.tensor_parallel_size * spec.pipeline_parallel_size * spec.replicas


def build_worker_pod(
    spec: InferenceSpec,
    config: K8sLauncherConfig,
    identity: RunIdentity,
    *,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pod manifest of the worker that runs `spec`, for the run `identity`.

    A pure function: no I/O, no cluster, no clock, no randomness. Dagster Pipes adds its
    bootstrap environment (context and message channel) to the first container at launch.

    Args:
        spec: The job spec the worker runs (its partition keys label the pod).
        config: The launcher configuration (image, placement, resources, volumes, secrets).
        identity: Run id, asset and attempt numbers; they name and label the pod.
        extra_env: Plain environment of the resource (`GpuInferenceResource.env`).

    Returns:
        A `v1/Pod` manifest as a dict in the Kubernetes API's camelCase.

    Raises:
        PodSpecError: the configuration or spec cannot make a valid pod (names the field).
    """
    extra_env = dict(extra_env or {})
    validate_launcher_config(config, extra_env)
    _check_model_location(spec, config.cache)
    gpus = gpus_per_pod(spec)
    volumes, mounts = _volumes(config)
    container = _worker_container(config, _container_env(config, extra_env, gpus), gpus, mounts)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": worker_pod_name(identity),
            "namespace": config.namespace,
            "labels": pod_labels(spec, config, identity, gpus),
            "annotations": pod_annotations(spec, config, identity),
        },
        "spec": _pod_spec(config, container, volumes),
    }


def pod_labels(
    spec: InferenceSpec, config: K8sLauncherConfig, identity: RunIdentity, gpus: int
) -> dict[str, str]:
    """Labels that find a pod by run, asset, partitions, spec, attempt, pool and queue."""
    labels: dict[str, str] = {
        "app.kubernetes.io/name": "dagster-gpuinfer",
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/managed-by": "dagster-gpuinfer",
        "dagster/run-id": label_value(identity.run_id),
        f"{LABEL_PREFIX}/asset": label_value(identity.asset_key.replace("/", ".")),
        f"{LABEL_PREFIX}/partition": partition_label(spec.partition_keys),
        f"{LABEL_PREFIX}/partition-count": str(len(spec.partition_keys)),
        f"{LABEL_PREFIX}/spec-hash": spec.spec_hash(),
        f"{LABEL_PREFIX}/retry": str(identity.retry_number),
        f"{LABEL_PREFIX}/launch": str(identity.launch_attempt),
        f"{LABEL_PREFIX}/gpus": str(gpus),
    }
    if identity.job_name:
        labels["dagster/job"] = label_value(identity.job_name)
    if config.pool:
        labels[f"{LABEL_PREFIX}/pool"] = label_value(config.pool)
    if config.placement.kueue_queue:
        labels[KUEUE_QUEUE_LABEL] = config.placement.kueue_queue
    labels.update(config.labels)
    return labels


def pod_annotations(
    spec: InferenceSpec, config: K8sLauncherConfig, identity: RunIdentity
) -> dict[str, str]:
    """What labels cannot hold: the full asset key, partition keys, model and task."""
    return {
        f"{LABEL_PREFIX}/asset-key": identity.asset_key,
        f"{LABEL_PREFIX}/partition-keys": json.dumps(spec.partition_keys),
        f"{LABEL_PREFIX}/model": spec.model,
        f"{LABEL_PREFIX}/task": spec.task,
        **config.annotations,
    }


def _container_env(
    config: K8sLauncherConfig, extra_env: Mapping[str, str], gpus: int
) -> list[dict[str, Any]]:
    """Offline hub at the cache, writable home in /tmp, the user's plain env (which wins over
    the defaults), then the Secret references."""
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
        {"name": "HF_HUB_CACHE", "value": HF_HUB_CACHE},
        {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if gpus and config.placement.gpu_resource_name:
        env.append({"name": "GPUINFER_DEVICE", "value": "cuda"})
    plain = {**extra_env, **config.env}
    env = [item for item in env if item["name"] not in plain]
    env.extend({"name": name, "value": value} for name, value in sorted(plain.items()))
    env.extend(
        {
            "name": ref.env_name,
            "valueFrom": {
                "secretKeyRef": {"name": ref.secret_name, "key": ref.key, "optional": False}
            },
        }
        for ref in config.secrets.env
    )
    return env


def _container_resources(config: K8sLauncherConfig, gpus: int) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": config.cpu_request, "memory": config.memory_request}
    limits: dict[str, str] = {}
    if config.cpu_limit:
        limits["cpu"] = config.cpu_limit
    if config.memory_limit:
        limits["memory"] = config.memory_limit
    gpu_resource = config.placement.gpu_resource_name
    if gpu_resource:
        requests[gpu_resource] = str(gpus)
        limits[gpu_resource] = str(gpus)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _volumes(config: K8sLauncherConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the worker's mounts: /dev/shm, scratch /tmp, the model cache."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
        {"name": "scratch", "emptyDir": {"sizeLimit": config.scratch_size}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": "/tmp"},
    ]
    cache = config.cache
    if cache.pvc:
        source = {"persistentVolumeClaim": {"claimName": cache.pvc, "readOnly": True}}
    elif cache.host_path:
        source = {"hostPath": {"path": cache.host_path, "type": "Directory"}}
    else:
        return volumes, mounts
    volumes.append({"name": "model-cache", **source})
    mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True})
    return volumes, mounts


def _worker_container(
    config: K8sLauncherConfig,
    env: list[dict[str, Any]],
    gpus: int,
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    security = config.security
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": list(config.command),
        "env": env,
        "resources": _container_resources(config, gpus),
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": security.run_as_user,
            "runAsGroup": security.run_as_group,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": security.read_only_root_filesystem,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if config.secrets.env_from:
        container["envFrom"] = [
            {"secretRef": {"name": name, "optional": False}} for name in config.secrets.env_from
        ]
    return container


def _pod_spec(
    config: K8sLauncherConfig, container: dict[str, Any], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    """Restart policy, deadline, hardening, then the placement of the pod."""
    security = config.security
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": config.active_deadline_seconds,
        # SIGTERM drains the worker for up to 60 s (GPUINFER_DRAIN_GRACE_SECONDS,
        # worker/lifecycle.py); 30 s more for the engine's shutdown and the last Pipes messages.
        "terminationGracePeriodSeconds": 90,
        "automountServiceAccountToken": security.automount_service_account_token,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": security.run_as_user,
            "runAsGroup": security.run_as_group,
            "fsGroup": security.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if security.service_account:
        pod_spec["serviceAccountName"] = security.service_account
    if config.secrets.image_pull:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in config.secrets.image_pull]
    pod_spec.update(_placement(config.placement))
    return pod_spec


def _placement(placement: WorkerPlacement) -> dict[str, Any]:
    """The pod spec fields that choose its node: priority, node selector, tolerations,
    affinity (each only when set)."""
    fields: dict[str, Any] = {}
    if placement.priority_class:
        fields["priorityClassName"] = placement.priority_class
    node_selector = dict(placement.node_selector)
    if placement.gpu_type:
        node_selector[placement.gpu_type_label] = placement.gpu_type
    if node_selector:
        fields["nodeSelector"] = node_selector
    if placement.tolerations:
        fields["tolerations"] = [_toleration(t) for t in placement.tolerations]
    if placement.affinity:
        fields["affinity"] = json.loads(json.dumps(placement.affinity))
    return fields


def _toleration(toleration: Toleration) -> dict[str, Any]:
    out: dict[str, Any] = {"operator": toleration.operator}
    if toleration.key is not None:
        out["key"] = toleration.key
    if toleration.value is not None:
        out["value"] = toleration.value
    if toleration.effect is not None:
        out["effect"] = toleration.effect
    if toleration.toleration_seconds is not None:
        out["tolerationSeconds"] = toleration.toleration_seconds
    return out
