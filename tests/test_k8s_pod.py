"""`build_worker_pod`: every generated pod is a valid Kubernetes pod, placed and secured.

Each pod is checked three ways: against the API schema of Kubernetes 1.37 in strict mode
(`kubernetes-validate` rejects unknown or misspelled fields), by a round trip through the
`kubernetes` client's `V1Pod` model (a field the model does not know would be dropped, so the
round trip would differ), and by the rules the schema does not encode: label values, names,
quantities.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient
from kubernetes.utils import parse_quantity

from dagster_gpuinfer.k8s.config import (
    MODEL_CACHE_MOUNT,
    K8sLauncherConfig,
    ModelCache,
    PodSecurity,
    PodSpecError,
    SecretEnvRef,
    SecretRefs,
    Toleration,
    WorkerPlacement,
)
from dagster_gpuinfer.k8s.names import RunIdentity, label_value, partition_label, worker_pod_name
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.spec import InferenceSpec

K8S_VERSION = "1.37.0"
RUN_ID = "6633a66a-ab2b-4333-bb5f-adbdffff1812"
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_API = ApiClient()


def make_spec(**overrides: Any) -> InferenceSpec:
    raw: dict[str, Any] = {
        "model": f"{MODEL_CACHE_MOUNT}/Llama-3.1-8B-Instruct",
        "task": "generate",
        "input": {"uri": "s3://corpus/prompts/{partition_key}.jsonl", "id_column": "id"},
        "output": {"root": "s3://corpus/out", "asset_name": "completions"},
        "partition_keys": ["prompts-000"],
    }
    raw.update(overrides)
    return InferenceSpec.model_validate(raw)


def make_config(**overrides: Any) -> K8sLauncherConfig:
    values: dict[str, Any] = {
        "image": "registry.example.com/gpuinfer-worker:0.1.0",
        "namespace": "team-a",
    }
    values.update(overrides)
    return K8sLauncherConfig(**values)


IDENTITY = RunIdentity(run_id=RUN_ID, asset_key="llm/completions", job_name="complete_prompts")


def round_trip(manifest: dict[str, Any]) -> dict[str, Any]:
    class _Response:
        data = json.dumps(manifest)

    return _API.sanitize_for_serialization(_API.deserialize(_Response(), "V1Pod"))


def assert_valid_pod(manifest: dict[str, Any]) -> None:
    """The checks every generated pod must pass."""
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert round_trip(manifest) == manifest, "a field the V1Pod model does not know was dropped"
    name = manifest["metadata"]["name"]
    assert len(name) <= 63 and DNS_LABEL.match(name), name
    for key, value in manifest["metadata"]["labels"].items():
        assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)
    container = manifest["spec"]["containers"][0]
    for section in ("requests", "limits"):
        for quantity in container["resources"].get(section, {}).values():
            parse_quantity(quantity)  # raises on an invalid quantity
    for volume in manifest["spec"]["volumes"]:
        if "emptyDir" in volume:
            parse_quantity(volume["emptyDir"]["sizeLimit"])


CASES = list(
    itertools.product(
        [1, 2, 4, 8],  # tensor_parallel_size
        [1, 2],  # replicas
        [None, "gpu-inference"],  # Kueue LocalQueue
        ["pvc", "hostPath"],  # model cache
    )
)


@pytest.mark.parametrize(("tp", "replicas", "queue", "cache"), CASES)
def test_every_pod_validates_and_requests_tp_times_replicas_gpus(tp, replicas, queue, cache):
    placement = WorkerPlacement(
        kueue_queue=queue,
        gpu_type="NVIDIA-H100-80GB-HBM3",
        tolerations=[Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
        priority_class="gpuinfer-batch",
        affinity={
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "preference": {
                            "matchExpressions": [
                                {
                                    "key": "topology.kubernetes.io/zone",
                                    "operator": "In",
                                    "values": ["us-east-1a"],
                                }
                            ]
                        },
                    }
                ]
            }
        },
    )
    config = make_config(
        placement=placement,
        cache=ModelCache(
            pvc="model-cache" if cache == "pvc" else None,
            host_path="/var/lib/gpuinfer/models" if cache == "hostPath" else None,
        ),
        secrets=SecretRefs(
            env=[SecretEnvRef(env_name="HF_TOKEN", secret_name="hf-token", key="token")],
            env_from=["s3-credentials"],
        ),
    )
    pod = build_worker_pod(make_spec(tensor_parallel_size=tp, replicas=replicas), config, IDENTITY)

    assert_valid_pod(pod)
    container = pod["spec"]["containers"][0]
    gpus = str(tp * replicas)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert pod["metadata"]["labels"]["gpuinfer.dagster.io/gpus"] == gpus
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["spec"]["tolerations"] == [
        {"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"}
    ]
    if queue:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == queue
    else:
        assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]
    cache_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-cache")
    if cache == "pvc":
        assert cache_volume["persistentVolumeClaim"] == {
            "claimName": "model-cache",
            "readOnly": True,
        }
    else:
        assert cache_volume["hostPath"] == {"path": "/var/lib/gpuinfer/models", "type": "Directory"}
    assert {"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True} in container[
        "volumeMounts"
    ]


def test_dev_shm_is_a_sized_memory_volume():
    pod = build_worker_pod(
        make_spec(tensor_parallel_size=4), make_config(shm_size="32Gi"), IDENTITY
    )

    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["spec"][
        "volumes"
    ]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_security_defaults_non_root_no_escalation_no_capabilities_no_token():
    pod = build_worker_pod(make_spec(), make_config(), IDENTITY)

    spec = pod["spec"]
    container = spec["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    assert {"name": "scratch", "mountPath": "/tmp"} in container["volumeMounts"], "a writable /tmp"


def test_service_account_token_is_mounted_only_when_asked():
    pod = build_worker_pod(
        make_spec(),
        make_config(
            security=PodSecurity(
                service_account="gpuinfer-worker", automount_service_account_token=True
            )
        ),
        IDENTITY,
    )
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert pod["spec"]["serviceAccountName"] == "gpuinfer-worker"


def test_secrets_travel_by_reference_only():
    config = make_config(
        secrets=SecretRefs(
            env=[SecretEnvRef(env_name="HF_TOKEN", secret_name="hf-token", key="token")],
            env_from=["s3-credentials"],
        ),
        env={"VLLM_LOGGING_LEVEL": "INFO"},
    )
    container = build_worker_pod(make_spec(), config, IDENTITY)["spec"]["containers"][0]

    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}},
    } in container["env"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials", "optional": False}}]
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"} in container["env"]


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "DB_PASSWORD", "OPENAI_API_KEY"],
)
def test_plain_env_refuses_credential_names(name):
    with pytest.raises(PodSpecError, match="secrets.env") as raised:
        build_worker_pod(make_spec(), make_config(env={name: "value"}), IDENTITY)
    assert name in str(raised.value)


def test_resource_env_is_checked_like_launcher_env():
    with pytest.raises(PodSpecError, match="GpuInferenceResource.env"):
        build_worker_pod(make_spec(), make_config(), IDENTITY, extra_env={"HF_TOKEN": "x"})


def test_active_deadline_priority_and_pull_settings_are_applied():
    pod = build_worker_pod(
        make_spec(),
        make_config(
            active_deadline_seconds=7200,
            placement=WorkerPlacement(priority_class="gpuinfer-batch"),
            secrets=SecretRefs(image_pull=["regcred"]),
            image_pull_policy="Always",
        ),
        IDENTITY,
    )
    assert pod["spec"]["activeDeadlineSeconds"] == 7200
    assert pod["spec"]["priorityClassName"] == "gpuinfer-batch"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "Always"


def test_cpu_only_pods_request_no_gpu_and_do_not_force_cuda():
    pod = build_worker_pod(
        make_spec(replicas=2),
        make_config(placement=WorkerPlacement(gpu_resource_name=None), cpu_request="2"),
        IDENTITY,
    )

    assert_valid_pod(pod)
    container = pod["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert "limits" not in container["resources"]
    assert "GPUINFER_DEVICE" not in {e["name"] for e in container["env"]}


def test_model_cache_points_the_hub_offline_at_the_cache():
    env = {
        e["name"]: e.get("value")
        for e in build_worker_pod(make_spec(), make_config(), IDENTITY)["spec"]["containers"][0][
            "env"
        ]
    }
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_HUB_CACHE"].startswith(MODEL_CACHE_MOUNT)


# --------------------------------------------------------------------------- labels and names


def test_labels_carry_run_asset_partitions_and_spec_hash():
    spec = make_spec(partition_keys=["prompts-000", "prompts-001", "prompts-002"])
    pod = build_worker_pod(spec, make_config(pool="gpu-h100", labels={"team": "search"}), IDENTITY)

    labels = pod["metadata"]["labels"]
    assert labels["dagster/run-id"] == RUN_ID
    assert labels["gpuinfer.dagster.io/asset"] == "llm.completions"
    assert labels["gpuinfer.dagster.io/partition-count"] == "3"
    assert labels["gpuinfer.dagster.io/partition"].startswith("prompts-000..prompts-002-")
    assert labels["gpuinfer.dagster.io/spec-hash"] == spec.spec_hash()
    assert labels["gpuinfer.dagster.io/pool"] == "gpu-h100"
    assert labels["team"] == "search"
    annotations = pod["metadata"]["annotations"]
    assert json.loads(annotations["gpuinfer.dagster.io/partition-keys"]) == spec.partition_keys


@pytest.mark.parametrize(
    "key",
    [
        "2026-11-30",
        "s3://bucket/shards/part-00007.parquet",
        "ünïcode/ключ",
        "x" * 200,
        "-leading-and-trailing-",
        "a|b",
    ],
)
def test_awkward_partition_keys_become_valid_distinct_label_values(key):
    spec = make_spec(partition_keys=[key])
    pod = build_worker_pod(spec, make_config(), IDENTITY)

    assert_valid_pod(pod)
    value = pod["metadata"]["labels"]["gpuinfer.dagster.io/partition"]
    assert value != partition_label([key + "x"]), "different keys, different label values"


def test_label_value_keeps_valid_values_and_hashes_changed_ones():
    assert label_value("shard-000") == "shard-000"
    assert label_value("a/b") != label_value("a-b")
    assert label_value("a/b").startswith("a-b-")
    assert len(label_value("k" * 500)) <= 63
    assert LABEL_VALUE.match(label_value("///"))


def test_pod_names_are_unique_per_retry_and_launch_and_stable_per_input():
    names = {
        worker_pod_name(
            RunIdentity(
                run_id=RUN_ID, asset_key="llm/completions", retry_number=r, launch_attempt=a
            )
        )
        for r in range(3)
        for a in range(2)
    }
    assert len(names) == 6
    assert worker_pod_name(IDENTITY) == worker_pod_name(IDENTITY)
    long_asset = RunIdentity(run_id=RUN_ID, asset_key="A_Very/Long_Asset_Key/" * 10)
    assert DNS_LABEL.match(worker_pod_name(long_asset)) and len(worker_pod_name(long_asset)) <= 63


def test_builder_is_pure_same_inputs_same_manifest():
    spec = make_spec(tensor_parallel_size=2)
    config = make_config(cache=ModelCache(pvc="model-cache"))
    assert build_worker_pod(spec, config, IDENTITY) == build_worker_pod(spec, config, IDENTITY)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"shm_size": "16 gigabytes"}, "shm_size"),
        ({"memory_limit": "64GB"}, "memory_limit"),
        ({"cache": ModelCache(pvc="cache", host_path="/cache")}, "both set"),
        ({"cache": ModelCache(host_path="relative/dir")}, "k8s.cache.host_path.*absolute"),
        ({"labels": {"team": "search/ranking"}}, "label value"),
        ({"labels": {"bad key!": "x"}}, "label key"),
        ({"placement": WorkerPlacement(kueue_queue="GPU Queue")}, "k8s.placement.kueue_queue"),
        ({"namespace": "Team_A"}, "namespace"),
        (
            {"placement": WorkerPlacement(tolerations=[Toleration(key="gpu", value="x")])},
            "Equal",
        ),
        (
            {
                "placement": WorkerPlacement(
                    tolerations=[Toleration(key="gpu", effect="NoScheduel")]
                )
            },
            "NoSchedule",
        ),
        ({"secrets": SecretRefs(env_from=["Not_A_Name"])}, "Secret name"),
    ],
)
def test_invalid_configuration_is_refused_naming_the_field(overrides, expected):
    with pytest.raises(PodSpecError, match=expected):
        build_worker_pod(make_spec(), make_config(**overrides), IDENTITY)


def test_model_outside_the_cache_is_refused_with_the_fix():
    with pytest.raises(PodSpecError, match=f"model='{MODEL_CACHE_MOUNT}/<name>'"):
        build_worker_pod(
            make_spec(model="/home/alice/models/llama"),
            make_config(cache=ModelCache(pvc="model-cache")),
            IDENTITY,
        )
    with pytest.raises(PodSpecError, match="relative"):
        build_worker_pod(make_spec(model="./models/llama"), make_config(), IDENTITY)


def test_hub_model_ids_are_allowed_and_resolved_offline_from_the_cache():
    pod = build_worker_pod(
        make_spec(model="meta-llama/Llama-3.1-8B-Instruct"),
        make_config(cache=ModelCache(pvc="model-cache")),
        IDENTITY,
    )
    assert_valid_pod(pod)
