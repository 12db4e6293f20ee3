"""Checks of a launcher configuration and a spec against Kubernetes' rules (label and DNS
names, quantities, env names, secrets by reference only, where the model is), before a pod is
built: a bad value fails the launch with a `PodSpecError` that names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dagster_gpuinfer.k8s.config import (
    MODEL_CACHE_MOUNT,
    K8sLauncherConfig,
    ModelCache,
    PodSpecError,
    Toleration,
    WorkerPlacement,
)
from dagster_gpuinfer.k8s.names import LABEL_NAME, label_value
from dagster_gpuinfer.secrets import is_secret_env_name, url_with_credentials
from dagster_gpuinfer.spec import InferenceSpec

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# Kubernetes resource.Quantity: a signed decimal with an optional binary or decimal suffix.
_QUANTITY = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)


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
        name and len(name) <= 63 and LABEL_NAME.match(name)
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
    names = [*secrets.image_pull, *secrets.env_from, *(r.secret_name for r in secrets.env)]
    for name in [*names, config.pools.queue_secret]:
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


def check_model_location(spec: InferenceSpec, cache: ModelCache) -> None:
    """The model, and each LoRA adapter given as a folder, where a pod sees it: in the
    model cache (`s3://` adapters are fetched by the worker)."""
    _check_in_cache(f"model {spec.model!r}", "model", spec.model, cache)
    for name, path in spec.lora_adapters.items():
        if not path.startswith("s3://"):
            _check_in_cache(
                f"LoRA adapter {name!r} ({path})", f"lora_adapters[{name!r}]", path, cache
            )


def _check_in_cache(what: str, setting: str, path: str, cache: ModelCache) -> None:
    local = path.removeprefix("file://")
    if local.startswith(("./", "../", "~")):
        raise PodSpecError(
            f"{what} is a path relative to the code location; a pod cannot see it. Copy it "
            f"into the model cache and set {setting}='{MODEL_CACHE_MOUNT}/<name>'"
        )
    if (
        cache.configured
        and local.startswith("/")
        and not (local == MODEL_CACHE_MOUNT or local.startswith(MODEL_CACHE_MOUNT + "/"))
    ):
        raise PodSpecError(
            f"{what} is outside the model cache, which pods mount read-only at "
            f"{MODEL_CACHE_MOUNT}. Warm the cache (deploy/model-cache/) and set "
            f"{setting}='{MODEL_CACHE_MOUNT}/<name>'"
        )
