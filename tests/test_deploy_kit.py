"""The deployment kit in deploy/: every file parses, every Kubernetes-native object validates,
and the pieces agree with each other and with the code (names, labels, quotas, paths).

Native kinds are validated against the Kubernetes 1.37 schema in strict mode and by a round
trip through the `kubernetes` client's models. Kueue objects have no schema here, so their
cross-references are checked instead: queues name existing flavors and ClusterQueues, quotas
cover what a worker pod requests, selectors select the tenant namespaces.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import kubernetes_validate
import pytest
import yaml
from dagster._config import validate_config
from dagster._core.instance.config import dagster_instance_config
from dagster._serdes.config_class import class_from_code_pointer
from kubernetes.client import ApiClient
from kubernetes.utils import parse_quantity

from dagster_gpuinfer.k8s.config import MODEL_CACHE_MOUNT
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.spec import InferenceSpec
from resources.k8s import k8s_launcher_config, k8s_resources

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"
NATIVE_GROUPS = {
    "v1",
    "apps/v1",
    "batch/v1",
    "rbac.authorization.k8s.io/v1",
    "scheduling.k8s.io/v1",
    "policy/v1",
    "networking.k8s.io/v1",
    "admissionregistration.k8s.io/v1",
}
NOT_MANIFESTS = {
    DEPLOY / "helm" / "values.yaml",
    DEPLOY / "dagster.yaml",
    # Helm values and a promtool test file (tests/test_observability_deploy.py checks them)
    DEPLOY / "observability" / "dcgm-exporter-values.yaml",
    DEPLOY / "observability" / "rules-test.yaml",
}
_API = ApiClient()
# Custom resources: no schema here; their contents are checked by the tests below.
CRD_GROUPS = ("kueue.x-k8s.io/", "monitoring.coreos.com/", "keda.sh/")


def manifest_files() -> list[Path]:
    return sorted(
        p
        for p in DEPLOY.rglob("*.yaml")
        if p not in NOT_MANIFESTS and "local" not in p.relative_to(DEPLOY).parts
    )


def all_objects() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path, doc))
    return found


def objects(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in all_objects() if doc["kind"] == kind]


def helm_values() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())


def code_location_env() -> dict[str, str]:
    deployment = helm_values()["dagster-user-deployments"]["deployments"][0]
    return {item["name"]: item["value"] for item in deployment["env"]}


def round_trip(doc: dict[str, Any]) -> dict[str, Any]:
    class _Response:
        data = json.dumps(doc)

    return _API.sanitize_for_serialization(_API.deserialize(_Response(), f"V1{doc['kind']}"))


def match_labels(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are used in the kit"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# --------------------------------------------------------------------------- every file


def test_the_kit_has_every_piece_the_issue_asks_for():
    kinds = {doc["kind"] for _, doc in all_objects()}
    assert {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ResourceFlavor",
        "ClusterQueue",
        "LocalQueue",
        "PriorityClass",
        "ConfigMap",
        "DaemonSet",
        "Job",
        "PersistentVolumeClaim",
        "Namespace",
    } <= kinds
    for path in (
        "worker/Dockerfile",
        "code-location/Dockerfile",
        "helm/values.yaml",
        "dagster.yaml",
        "README.md",
    ):
        assert (DEPLOY / path).is_file(), path


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_native_objects_validate_strictly_and_round_trip_through_the_client_models(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no object"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path}: not a Kubernetes object"
        if doc["apiVersion"] not in NATIVE_GROUPS:
            assert doc["apiVersion"].startswith(CRD_GROUPS), (
                f"{path}: unexpected {doc['apiVersion']}"
            )
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert round_trip(doc) == doc, f"{path}: {doc['kind']} has a field the client model drops"


def test_every_quantity_in_the_kit_parses():
    def walk(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif key in ("cpu", "memory", "storage", "sizeLimit", "nominalQuota"):
            parse_quantity(node)

    for _, doc in all_objects():
        walk(doc)


def test_readme_documents_every_file_of_the_kit():
    readme = (DEPLOY / "README.md").read_text()
    for path in [*manifest_files(), *NOT_MANIFESTS, DEPLOY / "worker" / "Dockerfile.cpu"]:
        relative = str(path.relative_to(DEPLOY))
        assert relative in readme, f"deploy/README.md does not mention {relative}"


# --------------------------------------------------------------------------- Kueue


def test_local_queues_point_at_existing_cluster_queues_in_tenant_namespaces():
    cluster_queues = {cq["metadata"]["name"]: cq for cq in objects("ClusterQueue")}
    namespaces = {
        ns["metadata"]["name"]: ns["metadata"].get("labels", {}) for ns in objects("Namespace")
    }
    for queue in objects("LocalQueue"):
        namespace = queue["metadata"]["namespace"]
        target = cluster_queues.get(queue["spec"]["clusterQueue"])
        assert target is not None, (
            f"LocalQueue {namespace}/{queue['metadata']['name']} names a missing ClusterQueue"
        )
        assert match_labels(target["spec"]["namespaceSelector"], namespaces[namespace]), (
            f"ClusterQueue {target['metadata']['name']} does not accept namespace {namespace}"
        )


def test_cluster_queues_use_existing_flavors_with_full_quota_and_share_a_fair_cohort():
    flavors = {f["metadata"]["name"] for f in objects("ResourceFlavor")}
    cohorts = set()
    for cq in objects("ClusterQueue"):
        spec = cq["spec"]
        cohorts.add(spec["cohort"])
        assert float(spec["fairSharing"]["weight"]) > 0
        for group in spec["resourceGroups"]:
            covered = group["coveredResources"]
            for flavor in group["flavors"]:
                assert flavor["name"] in flavors, (
                    f"{cq['metadata']['name']}: unknown flavor {flavor['name']}"
                )
                assert [r["name"] for r in flavor["resources"]] == covered, (
                    "quota for each covered resource, in order"
                )
    assert len(cohorts) == 1, "fair sharing works between ClusterQueues of one cohort"


def test_kueue_configuration_admits_plain_pods_in_tenant_namespaces_with_fair_sharing():
    configmap = next(
        cm for cm in objects("ConfigMap") if cm["metadata"]["name"] == "kueue-manager-config"
    )
    config = yaml.safe_load(configmap["data"]["controller_manager_config.yaml"])
    assert (
        config["apiVersion"] == "config.kueue.x-k8s.io/v1beta1"
        and config["kind"] == "Configuration"
    )
    assert "pod" in config["integrations"]["frameworks"]
    assert config["fairSharing"]["enable"] is True
    assert config["manageJobsWithoutQueueName"] is False
    selector = config["managedJobsNamespaceSelector"]
    namespaces = {
        ns["metadata"]["name"]: ns["metadata"].get("labels", {}) for ns in objects("Namespace")
    }
    for queue in objects("LocalQueue"):
        assert match_labels(selector, namespaces[queue["metadata"]["namespace"]])
    assert not match_labels(selector, {"kubernetes.io/metadata.name": "kube-system"})


def test_flavors_match_the_gpu_label_and_types_the_pods_select():
    placement = k8s_launcher_config(code_location_env()).placement
    flavor_labels = [f["spec"]["nodeLabels"] for f in objects("ResourceFlavor")]
    assert all(set(labels) == {placement.gpu_type_label} for labels in flavor_labels)
    flavor_types = {labels[placement.gpu_type_label] for labels in flavor_labels}
    assert placement.gpu_type in flavor_types


# ---------------------------------------------------------------------- the kit and the code agree


def sample_spec(**overrides: Any) -> InferenceSpec:
    raw = {
        "model": f"{MODEL_CACHE_MOUNT}/Llama-3.1-8B-Instruct",
        "task": "generate",
        "input": {"uri": "s3://gpuinfer-data/inputs/prompts/{partition_key}.jsonl"},
        "output": {"root": "s3://gpuinfer-data/outputs", "asset_name": "completions"},
        "partition_keys": ["prompts-000"],
        "tensor_parallel_size": 2,
        "replicas": 2,
    }
    raw.update(overrides)
    return InferenceSpec.model_validate(raw)


def helm_worker_pod() -> dict[str, Any]:
    resource = k8s_resources(code_location_env())["gpu"]
    return build_worker_pod(
        sample_spec(), resource.k8s, RunIdentity(run_id="r" * 36, asset_key="completions")
    )


def test_helm_env_builds_a_valid_pod_that_references_only_objects_the_kit_creates():
    pod = helm_worker_pod()
    namespace = pod["metadata"]["namespace"]
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)

    accounts = {
        (sa["metadata"]["namespace"], sa["metadata"]["name"]) for sa in objects("ServiceAccount")
    }
    assert (namespace, pod["spec"]["serviceAccountName"]) in accounts
    assert pod["spec"]["priorityClassName"] in {
        pc["metadata"]["name"] for pc in objects("PriorityClass")
    }
    queues = {(q["metadata"]["namespace"], q["metadata"]["name"]) for q in objects("LocalQueue")}
    assert (namespace, pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]) in queues
    assert namespace in {ns["metadata"]["name"] for ns in objects("Namespace")}

    # The default model cache is the shared PVC: workers read the claim the warmer Job fills.
    warmer = next(
        j for j in objects("Job") if j["metadata"]["name"] == "gpuinfer-model-cache-warmer"
    )
    warmer_cache = next(
        v for v in warmer["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"
    )
    pod_cache = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-cache")
    claim = pod_cache["persistentVolumeClaim"]["claimName"]
    assert claim == warmer_cache["persistentVolumeClaim"]["claimName"], (
        "workers read where the warmer writes"
    )
    assert (namespace, claim) in {
        (c["metadata"]["namespace"], c["metadata"]["name"])
        for c in objects("PersistentVolumeClaim")
    }
    assert warmer["metadata"]["namespace"] == namespace

    # The opt-in node-local cache: the hostPath the warmer DaemonSet fills.
    env = {**code_location_env(), "GPUINFER_MODEL_CACHE_HOST_PATH": "/var/lib/gpuinfer/models"}
    host_pod = build_worker_pod(
        sample_spec(),
        k8s_launcher_config(env),
        RunIdentity(run_id="r" * 36, asset_key="completions"),
    )
    daemonset = objects("DaemonSet")[0]
    node_cache = next(
        v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"
    )
    host_cache = next(v for v in host_pod["spec"]["volumes"] if v["name"] == "model-cache")
    assert host_cache["hostPath"]["path"] == node_cache["hostPath"]["path"]
    assert daemonset["metadata"]["namespace"] == namespace


def test_cluster_queue_covers_every_resource_a_worker_pod_requests():
    pod = helm_worker_pod()
    requested = set(pod["spec"]["containers"][0]["resources"]["requests"])
    namespace_labels = next(
        ns["metadata"]["labels"]
        for ns in objects("Namespace")
        if ns["metadata"]["name"] == pod["metadata"]["namespace"]
    )
    queue = next(
        cq
        for cq in objects("ClusterQueue")
        if match_labels(cq["spec"]["namespaceSelector"], namespace_labels)
    )
    covered = {r for group in queue["spec"]["resourceGroups"] for r in group["coveredResources"]}
    assert requested <= covered, f"Kueue never admits a pod requesting {requested - covered}"
    gpus = int(pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"])
    quota = max(
        int(r["nominalQuota"])
        for group in queue["spec"]["resourceGroups"]
        for f in group["flavors"]
        for r in f["resources"]
        if r["name"] == "nvidia.com/gpu"
    )
    assert gpus <= quota, "one pod must fit in the quota"


def test_worker_namespaces_enforce_pod_security_restricted_and_the_default_pod_uses_no_hostpath():
    pod = helm_worker_pod()
    assert not any("hostPath" in v for v in pod["spec"]["volumes"]), "PVC cache by default"
    tenants = [
        ns
        for ns in objects("Namespace")
        if ns["metadata"]["labels"].get("gpuinfer.dagster.io/kueue") == "managed"
    ]
    assert pod["metadata"]["namespace"] in {ns["metadata"]["name"] for ns in tenants}
    for ns in tenants:
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted", ns[
            "metadata"
        ]["name"]


def test_rbac_grants_what_the_launcher_calls_and_nothing_more(tmp_path):
    import math

    from k8s_fakes import (
        FakeKubernetes,
        PodScript,
        committing_worker,
        crashing_worker,
        materialize,
    )

    calls: set[str] = set()

    class Recording(FakeKubernetes):
        def __getattribute__(self, name: str) -> Any:
            if name.endswith(("_namespaced_pod", "_namespaced_pod_log", "_namespaced_event")):
                calls.add(name)
            return super().__getattribute__(name)

    scripts = [
        PodScript(worker=committing_worker()),
        PodScript(unschedulable_for=math.inf),
        PodScript(worker=crashing_worker("RuntimeError: boom"), exit_code=1),
    ]
    for index, script in enumerate(scripts):
        cluster = Recording(script)
        materialize(tmp_path / str(index), cluster, retry_policy=None)
        assert cluster.created

    verb_of = {
        "create_namespaced_pod": ("pods", "create"),
        "list_namespaced_pod": ("pods", "list"),
        "read_namespaced_pod": ("pods", "get"),
        "delete_namespaced_pod": ("pods", "delete"),
        "read_namespaced_pod_log": ("pods/log", "get"),
        "list_namespaced_event": ("events", "list"),
    }
    needed = {verb_of[call] for call in calls}
    role = next(r for r in objects("Role") if r["metadata"]["name"] == "gpuinfer-launcher")
    granted = {
        (res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
    }
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert needed <= granted, f"the Role lacks {needed - granted}"
    # `get` on pods: dagster-k8s's wait_for_pod reads the pod (read_namespaced_pod) on paths
    # these three scripts may not reach; nothing else beyond what was called.
    assert granted - needed <= {("pods", "get")}, f"the Role grants more: {granted - needed}"
    binding = next(b for b in objects("RoleBinding") if b["roleRef"]["name"] == "gpuinfer-launcher")
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    run_pod_account = helm_values()["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"][
        "podSpecConfig"
    ]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": run_pod_account, "namespace": "dagster"}
    ]


# ---------------------------------------------------------------------- Dagster instance and chart


def test_deployed_instance_config_validates_against_dagster(tmp_path):
    shutil.copy(DEPLOY / "dagster.yaml", tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))
    for section in ("run_launcher", "run_coordinator"):
        klass = class_from_code_pointer(config[section]["module"], config[section]["class"])
        result = validate_config(klass.config_type(), config[section].get("config") or {})
        assert result.success, (section, [e.message for e in result.errors])


def test_helm_values_match_the_instance_config():
    values = helm_values()
    instance = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    daemon = values["dagsterDaemon"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert daemon["runRetries"] == {
        "enabled": instance["run_retries"]["enabled"],
        "maxRetries": instance["run_retries"]["max_retries"],
        "retryOnAssetOrOpFailure": instance["run_retries"]["retry_on_asset_or_op_failure"],
    }
    monitoring = {
        re.sub(r"_(\w)", lambda m: m.group(1).upper(), k): v
        for k, v in instance["run_monitoring"].items()
    }
    assert daemon["runMonitoring"] == monitoring
    assert values["concurrency"]["pools"] == {
        "granularity": instance["concurrency"]["pools"]["granularity"],
        "defaultLimit": instance["concurrency"]["pools"]["default_limit"],
    }
    assert (
        values["concurrency"]["runs"]["maxConcurrentRuns"]
        == instance["concurrency"]["runs"]["max_concurrent_runs"]
    )
    assert (
        values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]["podSpecConfig"][
            "serviceAccountName"
        ]
        == (instance["run_launcher"]["config"]["service_account_name"])
    )


# Keys of the Dagster chart's values this kit sets (from the chart's values schema).
CHART_KEYS = {
    "global": {"serviceAccountName", "postgresqlSecretName", "dagsterHome"},
    "serviceAccount": {"create", "name", "annotations"},
    "dagster-user-deployments": {
        "enabled",
        "enableSubchart",
        "imagePullSecrets",
        "deployments",
        "serviceAccount",
    },
    "runLauncher": {"type", "config"},
    "postgresql": {
        "enabled",
        "image",
        "postgresqlHost",
        "postgresqlUsername",
        "postgresqlPassword",
        "postgresqlDatabase",
        "postgresqlParams",
        "postgresqlScheme",
        "service",
    },
    "generatePostgresqlPasswordSecret": None,
    "dagsterDaemon": {
        "enabled",
        "image",
        "runCoordinator",
        "heartbeatTolerance",
        "env",
        "envConfigMaps",
        "envSecrets",
        "resources",
        "runMonitoring",
        "runRetries",
        "sensors",
        "schedules",
        "backfills",
        "nodeSelector",
        "affinity",
        "tolerations",
        "annotations",
        "labels",
    },
    "concurrency": {"enabled", "pools", "runs"},
}
DEPLOYMENT_KEYS = {
    "name",
    "image",
    "dagsterApiGrpcArgs",
    "codeServerArgs",
    "includeConfigInLaunchedRuns",
    "port",
    "env",
    "envConfigMaps",
    "envSecrets",
    "annotations",
    "nodeSelector",
    "affinity",
    "tolerations",
    "podSecurityContext",
    "securityContext",
    "resources",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "labels",
    "volumeMounts",
    "volumes",
    "schedulerName",
}
K8S_RUN_LAUNCHER_KEYS = {
    "image",
    "imagePullPolicy",
    "jobNamespace",
    "loadInclusterConfig",
    "kubeconfigFile",
    "envConfigMaps",
    "envSecrets",
    "envVars",
    "volumeMounts",
    "volumes",
    "labels",
    "failPodOnRunFailure",
    "resources",
    "schedulerName",
    "securityContext",
    "runK8sConfig",
}


def test_helm_values_use_only_keys_the_dagster_chart_knows():
    values = helm_values()
    for key, value in values.items():
        assert key in CHART_KEYS, f"unknown top-level chart key {key!r}"
        if CHART_KEYS[key] is not None and isinstance(value, dict):
            assert set(value) <= CHART_KEYS[key], (
                f"{key}: unknown keys {set(value) - CHART_KEYS[key]}"
            )
    for deployment in values["dagster-user-deployments"]["deployments"]:
        assert set(deployment) <= DEPLOYMENT_KEYS, set(deployment) - DEPLOYMENT_KEYS
    assert set(values["runLauncher"]["config"]["k8sRunLauncher"]) <= K8S_RUN_LAUNCHER_KEYS
    assert "postgresqlPassword" not in values["postgresql"], "the password comes from a Secret"


def test_code_location_env_loads_the_reference_definitions_on_k8s(monkeypatch):
    for name, value in code_location_env().items():
        monkeypatch.setenv(name, value)
    from resources import resources_for_environment

    resource = resources_for_environment()["gpu"]
    assert resource.launcher == "k8s"
    assert resource.k8s.image == code_location_env()["GPUINFER_WORKER_IMAGE"]
    assert isinstance(resource, dg.ConfigurableResource)


def test_k8s_environment_without_a_worker_image_says_what_to_set():
    with pytest.raises(ValueError, match="GPUINFER_WORKER_IMAGE"):
        k8s_resources({})


# --------------------------------------------------------------------------- images


def test_worker_image_pins_the_vllm_base_the_worker_extra_pins():
    dockerfile = (DEPLOY / "worker" / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    vllm_pin = re.search(r'"vllm==([0-9.]+)"', pyproject).group(1)
    assert f"ARG VLLM_BASE=vllm/vllm-openai:v{vllm_pin}@sha256:" in dockerfile
    lock = (REPO / "requirements" / "lock-gpu.txt").read_text()
    assert f"vllm=={vllm_pin}" in lock
    assert "USER 1000" in dockerfile


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("Dockerfile*")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_images_are_pinned_and_non_root(path):
    text = path.read_text()
    bases = re.findall(r"^ARG \w+_BASE=(\S+)$", text, flags=re.MULTILINE)
    assert bases, f"{path}: the base image is not an ARG with a pinned default"
    for base in bases:
        assert re.search(r":[^:@/]+@sha256:[0-9a-f]{64}$", base), (
            f"{path}: base image {base} is not pinned by tag and digest"
        )
    assert re.search(r"^USER 1000$", text, flags=re.MULTILINE), f"{path} runs as root"


def test_kit_images_are_pinned():
    for _, doc in all_objects():
        spec = doc.get("spec", {})
        template = spec.get("template", {}).get("spec", {})
        for container in template.get("containers", []) + template.get("initContainers", []):
            image = container["image"]
            assert re.search(r":[^:@/]+@sha256:[0-9a-f]{64}$", image), (
                f"{image} is not pinned by tag and digest"
            )


# --------------------------------------------------------------------------- engine pools


def gate_module():
    import sys

    sys.path.insert(0, str(DEPLOY / "checkov"))
    import gate

    return gate


def test_keda_scaled_job_is_what_the_builder_makes_and_its_job_validates():
    scaled_job, pool_pod = gate_module().pool_objects()
    [committed] = [doc for doc in objects("ScaledJob")]
    assert committed == scaled_job, (
        "regenerate deploy/pools/keda-scaledjob.yaml from gate.pool_objects() (its header says how)"
    )
    job = gate_module().keda_job(committed)
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    assert round_trip(job) == job
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # The Job's pod is the reconciler's pool pod, but for the worker id (the pod's own name).
    template = committed["spec"]["jobTargetRef"]["template"]
    assert template["spec"] == {
        **pool_pod["spec"],
        "containers": template["spec"]["containers"],
    }
    [container], [pod_container] = template["spec"]["containers"], pool_pod["spec"]["containers"]
    worker_id = pod_container["args"][pod_container["args"].index("--worker-id") + 1]
    assert container["args"] == [
        "$(GPUINFER_POD_NAME)" if arg == worker_id else arg for arg in pod_container["args"]
    ]
    assert {k: v for k, v in container.items() if k != "args"} == {
        k: v for k, v in pod_container.items() if k != "args"
    }
    labels = {k: v for k, v in pool_pod["metadata"]["labels"].items() if "worker-id" not in k}
    assert template["metadata"]["labels"] == labels


def test_keda_scaler_reads_the_queue_the_pool_pods_read_in_a_kueue_queue_of_the_kit():
    [scaled_job] = objects("ScaledJob")
    [trigger] = scaled_job["spec"]["triggers"]
    assert trigger["type"] == "postgresql"
    env = {
        e["name"]: e
        for e in scaled_job["spec"]["jobTargetRef"]["template"]["spec"]["containers"][0]["env"]
    }
    source = env[trigger["metadata"]["connectionFromEnv"]]["valueFrom"]["secretKeyRef"]
    assert (source["name"], source["key"]) == ("gpuinfer-lease-queue", "url")
    namespace = scaled_job["metadata"]["namespace"]
    queues = {(q["metadata"]["namespace"], q["metadata"]["name"]) for q in objects("LocalQueue")}
    assert (namespace, scaled_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]) in queues
    assert int(trigger["metadata"]["targetQueryValue"]) >= 1
    assert scaled_job["spec"]["maxReplicaCount"] >= 1
