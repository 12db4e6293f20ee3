"""The Kubernetes environment: every worker runs in a GPU pod (`GPUINFER_ENV=k8s`).

The code location reads its settings from environment variables, which the Helm values
(deploy/helm/values.yaml) set on the user deployment; the defaults match the names of the
deployment kit (deploy/rbac.yaml, deploy/kueue/, deploy/model-cache/):

| variable                        | default              | meaning                           |
|---------------------------------|----------------------|-----------------------------------|
| GPUINFER_WORKER_IMAGE           | (required)           | worker image                      |
| GPUINFER_NAMESPACE              | gpuinfer             | namespace of worker pods          |
| GPUINFER_WORKER_SERVICE_ACCOUNT | gpuinfer-worker      | ServiceAccount of worker pods     |
| GPUINFER_GPU_TYPE               | (any GPU)            | nvidia.com/gpu.product value      |
| GPUINFER_KUEUE_QUEUE            | gpu-inference        | Kueue LocalQueue ('' for none)    |
| GPUINFER_PRIORITY_CLASS         | gpuinfer-batch       | PriorityClass ('' for none)       |
| GPUINFER_MODEL_CACHE_PVC        | gpuinfer-model-cache | model cache PVC (the default)...  |
| GPUINFER_MODEL_CACHE_HOST_PATH  |                      | ... or node directory (opt-in)    |
| GPUINFER_S3_SECRET              | gpuinfer-s3          | Secret with AWS_* keys (envFrom)  |
| GPUINFER_HF_TOKEN_SECRET        |                      | Secret with key `token`, HF_TOKEN |
| GPUINFER_S3_ENDPOINT, _REGION   |                      | S3-compatible endpoint, region    |
| GPUINFER_GPU_POOL               | gpu                  | Dagster pool of inference assets  |
| GPUINFER_WORKER_CPU, _MEMORY    | 8, 64Gi              | requests (memory also the limit)  |
| GPUINFER_SHM_SIZE               | 16Gi                 | /dev/shm size                     |
| GPUINFER_POD_PENDING_TIMEOUT    | 1800                 | seconds to start after admission  |
| GPUINFER_WORKER_METRICS_PORT    | 9400                 | worker Prometheus port ('' none)  |
| GPUINFER_PUSHGATEWAY            |                      | Pushgateway URL for metrics       |
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dagster_gpuinfer import GpuInferenceResource
from dagster_gpuinfer.k8s.config import (
    K8sLauncherConfig,
    ModelCache,
    PodSecurity,
    SecretEnvRef,
    SecretRefs,
    Toleration,
    WorkerPlacement,
)

DEFAULT_NAMESPACE = "gpuinfer"
DEFAULT_WORKER_SERVICE_ACCOUNT = "gpuinfer-worker"
DEFAULT_KUEUE_QUEUE = "gpu-inference"
DEFAULT_PRIORITY_CLASS = "gpuinfer-batch"
DEFAULT_MODEL_CACHE_PVC = "gpuinfer-model-cache"
DEFAULT_MODEL_CACHE_HOST_PATH = "/var/lib/gpuinfer/models"
DEFAULT_S3_SECRET = "gpuinfer-s3"
DEFAULT_GPU_POOL = "gpu"


def k8s_launcher_config(environ: Mapping[str, str] | None = None) -> K8sLauncherConfig:
    """The worker pod configuration from `environ` (default: the process environment).

    Raises:
        ValueError: GPUINFER_WORKER_IMAGE is not set.
    """
    env = os.environ if environ is None else environ
    image = env.get("GPUINFER_WORKER_IMAGE", "").strip()
    if not image:
        raise ValueError(
            "GPUINFER_ENV=k8s but GPUINFER_WORKER_IMAGE is not set: set it to the worker image "
            "built from deploy/worker/Dockerfile (the Helm values set it on the user deployment)"
        )
    # The PVC cache passes Pod Security `restricted`; the node-local hostPath cache is
    # opt-in (GPUINFER_MODEL_CACHE_HOST_PATH) and needs deploy/admission/ (deploy/README.md).
    host_path = env.get("GPUINFER_MODEL_CACHE_HOST_PATH") or None
    pvc = (
        None
        if host_path
        else (env.get("GPUINFER_MODEL_CACHE_PVC", DEFAULT_MODEL_CACHE_PVC) or None)
    )
    memory = env.get("GPUINFER_WORKER_MEMORY", "64Gi")
    secret_env = []
    if env.get("GPUINFER_HF_TOKEN_SECRET"):
        secret_env.append(
            SecretEnvRef(
                env_name="HF_TOKEN", secret_name=env["GPUINFER_HF_TOKEN_SECRET"], key="token"
            )
        )
    s3_secret = env.get("GPUINFER_S3_SECRET", DEFAULT_S3_SECRET)
    return K8sLauncherConfig(
        image=image,
        namespace=env.get("GPUINFER_NAMESPACE", DEFAULT_NAMESPACE),
        security=PodSecurity(
            service_account=env.get(
                "GPUINFER_WORKER_SERVICE_ACCOUNT", DEFAULT_WORKER_SERVICE_ACCOUNT
            )
            or None,
        ),
        placement=WorkerPlacement(
            gpu_type=env.get("GPUINFER_GPU_TYPE") or None,
            tolerations=[Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
            kueue_queue=env.get("GPUINFER_KUEUE_QUEUE", DEFAULT_KUEUE_QUEUE) or None,
            priority_class=env.get("GPUINFER_PRIORITY_CLASS", DEFAULT_PRIORITY_CLASS) or None,
        ),
        cache=ModelCache(pvc=pvc, host_path=host_path),
        secrets=SecretRefs(env=secret_env, env_from=[s3_secret] if s3_secret else []),
        shm_size=env.get("GPUINFER_SHM_SIZE", "16Gi"),
        cpu_request=env.get("GPUINFER_WORKER_CPU", "8"),
        memory_request=memory,
        memory_limit=memory,
        pod_pending_timeout=float(env.get("GPUINFER_POD_PENDING_TIMEOUT", "1800")),
        pool=env.get("GPUINFER_GPU_POOL", DEFAULT_GPU_POOL) or None,
    )


def k8s_resources(environ: Mapping[str, str] | None = None) -> dict[str, GpuInferenceResource]:
    env = os.environ if environ is None else environ
    return {
        "gpu": GpuInferenceResource(
            launcher="k8s",
            k8s=k8s_launcher_config(env),
            s3_endpoint_url=env.get("GPUINFER_S3_ENDPOINT") or None,
            s3_region=env.get("GPUINFER_S3_REGION") or None,
            s3_allow_http=(env.get("GPUINFER_S3_ENDPOINT") or "").startswith("http://"),
            metrics_port=int(env.get("GPUINFER_WORKER_METRICS_PORT", "9400") or 0) or None,
            pushgateway_url=env.get("GPUINFER_PUSHGATEWAY") or None,
        )
    }
