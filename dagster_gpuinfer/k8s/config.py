"""The Kubernetes launcher's configuration: what a user sets (`K8sLauncherConfig` and its
groups `placement`, `cache`, `security`, `secrets`), as Dagster config models.

Checked by `k8s.validation` before any pod is built; turned into a pod by `k8s.pod`.
"""

from __future__ import annotations

from typing import Any, Literal

import dagster as dg
from pydantic import Field

from dagster_gpuinfer.worker import WORKER_MODULE

MODEL_CACHE_MOUNT = "/models"
"""Where the model cache is mounted, read-only, in every worker pod."""

HF_HUB_CACHE = f"{MODEL_CACHE_MOUNT}/hub"
"""Hugging Face hub cache inside the model cache, for specs that name a hub id."""

QUEUE_MOUNT = "/var/lib/gpuinfer/queue"
"""Where a pool pod mounts `PoolPods.queue_pvc` (a SQLite lease queue), read-write."""

WORKER_CONTAINER = "worker"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The pod label that hands a pod to a Kueue LocalQueue."""
LABEL_PREFIX = "gpuinfer.dagster.io"


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


class PoolPods(dg.Config):
    """What engine pool worker pods (`k8s.pool_pod.build_pool_pod`) add to a worker pod: the
    lease queue's location, by reference."""

    queue_secret: str = Field(
        "gpuinfer-lease-queue",
        description="Secret holding the lease queue's location (a postgresql:// URL with its "
        "password, or a SQLite path on queue_pvc); pool pods read it as GPUINFER_LEASE_QUEUE "
        "through secretKeyRef, so it never appears in the pod manifest or the command line.",
    )
    queue_secret_key: str = Field("url", description="Key of queue_secret holding the location.")
    queue_pvc: str | None = Field(
        None,
        description=f"PersistentVolumeClaim mounted read-write at {QUEUE_MOUNT} for a SQLite "
        "lease queue (one-node clusters only: SQLite locks need every process on one host). "
        "None with a PostgreSQL queue, the production setup.",
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
    pools: PoolPods = Field(
        default_factory=PoolPods,
        description="Engine pool worker pods: the Secret with the lease queue's location "
        "(and, for a SQLite queue on one node, its volume).",
    )
    kubeconfig_file: str | None = Field(
        None, description="Kubeconfig for the launcher; None: in-cluster config, else ~/.kube."
    )
    kube_context: str | None = Field(None, description="Context inside kubeconfig_file.")
    load_incluster_config: bool | None = Field(
        None, description="Force in-cluster config (True) or kubeconfig (False); None: detect."
    )
