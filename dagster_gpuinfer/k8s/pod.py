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
`.secrets` (references to Kubernetes Secrets); the models live in `k8s.config`, their checks
in `k8s.validation`, names and label values in `k8s.names`; this module is the pod body.

This module imports only the standard library, pydantic and dagster (for `dg.Config`), so the
control plane can build and test pods without the `kubernetes` client installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dagster_gpuinfer.k8s.config import (
    HF_HUB_CACHE,
    KUEUE_QUEUE_LABEL,
    LABEL_PREFIX,
    MODEL_CACHE_MOUNT,
    WORKER_CONTAINER,
    K8sLauncherConfig,
    Toleration,
    WorkerPlacement,
)
from dagster_gpuinfer.k8s.names import RunIdentity, label_value, partition_label, worker_pod_name
from dagster_gpuinfer.k8s.validation import check_model_location, validate_launcher_config
from dagster_gpuinfer.spec import InferenceSpec

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
    check_model_location(spec, config.cache)
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
