"""Security findings of issue 12, one test (or more) each.

- Pod Security `restricted`: enforced in the worker namespaces; the worker pods the Helm values
  make (PVC cache), the cache warmer Job and the run and code-server pods of the Helm values
  pass its rules (a faithful rendering of the Pod Security Standards' checks below).
- The hostPath alternative: the ValidatingAdmissionPolicy's CEL, evaluated with cel-python,
  admits the builder's pod and rejects a privileged pod, a `hostPath: /` pod, a writable
  cache, another Secret or service account.
- NetworkPolicies: default-deny for every pod of a worker namespace, then DNS, the S3
  endpoint (workers) and the model source (warmers).
- Images pinned by digest; the GPU image installs from a hash-locked lock.
- Secrets stay references: `extra` refuses secret-looking keys, the env-name rule covers
  *_PASS*, *_KEY, *TOKEN* and credentials in URLs, `gpu_settings_from_s3_resource` passes
  `dg.EnvVar` names that the worker resolves itself.
- Inputs: traversal partition keys refused (spec and arrival sensor), manifest part names
  must be plain file names.
- Weights load from safetensors unless a spec opts in to pickle.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import dagster as dg
import pyarrow as pa
import pytest
import yaml
from dagster_aws.s3 import S3Resource

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.arrivals import WatchedFiles, scan_arrivals
from dagster_gpuinfer.aws import gpu_settings_from_s3_resource
from dagster_gpuinfer.k8s.pod import (
    K8sLauncherConfig,
    PodSpecError,
    RunIdentity,
    build_worker_pod,
)
from dagster_gpuinfer.resource import InvalidInferenceSpec, validate_spec
from dagster_gpuinfer.secrets import (
    ENV_REFERENCES_VARIABLE,
    is_secret_env_name,
    is_secret_option_name,
    url_with_credentials,
)
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, SamplingParams
from dagster_gpuinfer.storage import (
    MANIFEST_NAME,
    FileEntry,
    ListedFile,
    filesystem_for,
    partition_dir,
    read_partition,
    table_to_parquet_bytes,
    write_bytes_atomic,
    write_file_entry,
)
from resources.k8s import k8s_launcher_config

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
LAUNCHER = "system:serviceaccount:dagster:gpuinfer-launcher"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kit_objects() -> list[tuple[Path, dict[str, Any]]]:
    skip = {
        DEPLOY / "helm" / "values.yaml",
        DEPLOY / "dagster.yaml",
        # Helm values of the DCGM exporter chart and a promtool test file: no Kubernetes objects
        DEPLOY / "observability" / "dcgm-exporter-values.yaml",
        DEPLOY / "observability" / "rules-test.yaml",
    }
    return [
        (path, doc)
        for path in sorted(DEPLOY.rglob("*.yaml"))
        if path not in skip and "local" not in path.relative_to(DEPLOY).parts
        for doc in load_all(path)
    ]


def helm_values() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())


def code_location_env(**overrides: str | None) -> dict[str, str]:
    deployment = helm_values()["dagster-user-deployments"]["deployments"][0]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def worker_pod(tp: int = 1, replicas: int = 1, **env_overrides: str | None) -> dict[str, Any]:
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/Llama-3.1-8B-Instruct",
            "task": "generate",
            "input": {"uri": "s3://gpuinfer-data/inputs/{partition_key}.jsonl"},
            "output": {"root": "s3://gpuinfer-data/outputs", "asset_name": "completions"},
            "partition_keys": ["prompts-000"],
            "tensor_parallel_size": tp,
            "replicas": replicas,
        }
    )
    config = k8s_launcher_config(code_location_env(**env_overrides))
    return build_worker_pod(spec, config, RunIdentity(run_id="r" * 36, asset_key="completions"))


def hostpath_worker_pod(tp: int = 2, replicas: int = 2) -> dict[str, Any]:
    return worker_pod(
        tp,
        replicas,
        GPUINFER_MODEL_CACHE_HOST_PATH="/var/lib/gpuinfer/models",
        GPUINFER_MODEL_CACHE_PVC=None,
        GPUINFER_HF_TOKEN_SECRET="hf-token",
    )


# --------------------------------------------------------------------------- Pod Security

# The Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards),
# version "latest": the baseline checks, then what restricted adds.
_BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
_SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """The Pod Security `restricted` rules a pod spec breaks (empty: admitted)."""
    problems = []
    pod_sc = pod_spec.get("securityContext") or {}
    containers = [
        *pod_spec.get("containers", []),
        *pod_spec.get("initContainers", []),
        *pod_spec.get("ephemeralContainers", []),
    ]
    # baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            problems.append(f"{field}")
    for volume in pod_spec.get("volumes", []):
        if "hostPath" in volume:
            problems.append(f"hostPath volume {volume['name']}")
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']} of type {kinds - _RESTRICTED_VOLUMES}")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in _SAFE_SYSCTLS:
            problems.append(f"sysctl {sysctl['name']}")
    for where in [pod_sc, *(c.get("securityContext") or {} for c in containers)]:
        selinux = where.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in _SELINUX_TYPES or "user" in selinux or "role" in selinux:
            problems.append("seLinuxOptions")
        if (where.get("appArmorProfile") or {}).get("type") == "Unconfined":
            problems.append("appArmorProfile Unconfined")
        if (where.get("seccompProfile") or {}).get("type") == "Unconfined":
            problems.append("seccompProfile Unconfined")
        if where.get("runAsUser") == 0:
            problems.append("runAsUser 0")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in (
        "RuntimeDefault",
        "Localhost",
    )
    for container in containers:
        name = container["name"]
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"{name}: procMount")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"{name}: hostPort")
        capabilities = sc.get("capabilities") or {}
        added = set(capabilities.get("add", []))
        if not added <= _BASELINE_CAPABILITIES:
            problems.append(f"{name}: adds {added - _BASELINE_CAPABILITIES}")
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            problems.append(f"{name}: runAsNonRoot is not true")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (seccomp in ("RuntimeDefault", "Localhost") or (seccomp is None and pod_seccomp)):
            problems.append(f"{name}: no RuntimeDefault/Localhost seccomp profile")
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: does not drop ALL capabilities")
        if not added <= {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {added}")
    return problems


def test_the_restricted_check_catches_what_pod_security_rejects():
    assert restricted_violations(hostpath_worker_pod()["spec"]) == [
        "hostPath volume model-cache",
        "volume model-cache of type {'hostPath'}",
    ]
    privileged = worker_pod()["spec"]
    privileged["containers"][0]["securityContext"] = {"privileged": True, "runAsUser": 0}
    found = restricted_violations(privileged)
    assert "worker: privileged" in found and "runAsUser 0" in found
    assert "worker: allowPrivilegeEscalation is not false" in found


def test_worker_namespaces_enforce_restricted():
    tenants = [
        doc
        for _, doc in kit_objects()
        if doc["kind"] == "Namespace"
        and doc["metadata"]["labels"].get("gpuinfer.dagster.io/kueue") == "managed"
    ]
    assert len(tenants) >= 2
    for namespace in tenants:
        labels = namespace["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        assert labels["pod-security.kubernetes.io/enforce-version"] == "latest"


@pytest.mark.parametrize(("tp", "replicas"), [(1, 1), (4, 1), (1, 4), (2, 2)])
def test_the_default_worker_pods_pass_the_restricted_profile(tp, replicas):
    pod = worker_pod(tp, replicas, GPUINFER_HF_TOKEN_SECRET="hf-token")
    assert any("persistentVolumeClaim" in v for v in pod["spec"]["volumes"])
    assert restricted_violations(pod["spec"]) == []


def test_every_kit_pod_in_an_enforcing_namespace_passes_restricted_except_the_hostpath_warmer():
    enforcing = {
        doc["metadata"]["name"]
        for _, doc in kit_objects()
        if doc["kind"] == "Namespace"
        and doc["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
    }
    checked = 0
    for path, doc in kit_objects():
        template = (doc.get("spec") or {}).get("template", {}).get("spec")
        if template is None or doc["metadata"].get("namespace") not in enforcing:
            continue
        problems = restricted_violations(template)
        if doc["kind"] == "DaemonSet":  # the opt-in node-local cache: see deploy/admission/
            assert problems == ["hostPath volume cache", "volume cache of type {'hostPath'}"]
            assert not any("root" in p or "privileged" in p or "adds" in p for p in problems)
        else:
            assert problems == [], (path, problems)
        checked += 1
    assert checked >= 2


def test_the_warmer_runs_nothing_as_root():
    for path in (DEPLOY / "model-cache").glob("warmer-*.yaml"):
        for doc in load_all(path):
            if doc["kind"] not in ("Job", "DaemonSet"):
                continue
            spec = doc["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                sc = container["securityContext"]
                assert sc.get("runAsUser", spec["securityContext"].get("runAsUser")) != 0
                assert "add" not in sc.get("capabilities", {}), container["name"]


def test_helm_run_and_code_server_pods_get_a_restricted_security_context():
    import kubernetes
    from dagster_k8s.job import UserDefinedDagsterK8sConfig
    from dagster_k8s.models import k8s_model_from_dict

    values = helm_values()
    run_config = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    # As dagster-k8s reads runK8sConfig into the run pod's models.
    user = UserDefinedDagsterK8sConfig.from_dict(
        {
            "container_config": run_config["containerConfig"],
            "pod_spec_config": run_config["podSpecConfig"],
        }
    )
    pod_spec = k8s_model_from_dict(
        kubernetes.client.V1PodSpec,
        {**user.pod_spec_config, "containers": [{**user.container_config, "name": "dagster"}]},
    )
    run_pod = kubernetes.client.ApiClient().sanitize_for_serialization(pod_spec)
    assert run_pod["serviceAccountName"] == "gpuinfer-launcher"
    assert restricted_violations(run_pod) == []
    deployment = values["dagster-user-deployments"]["deployments"][0]
    code_server = {
        "securityContext": deployment["podSecurityContext"],
        "containers": [{"name": "grpc", "securityContext": deployment["securityContext"]}],
    }
    assert restricted_violations(code_server) == []


# --------------------------------------------------------------------------- service accounts


def test_the_launcher_account_is_only_on_run_pods():
    values = helm_values()
    assert "serviceAccountName" not in values.get("global", {}), (
        "global.serviceAccountName would give every Dagster component the launcher's token"
    )
    assert values["serviceAccount"]["create"] is True
    assert values["dagster-user-deployments"]["serviceAccount"]["create"] is True
    run_config = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    assert run_config["podSpecConfig"]["serviceAccountName"] == "gpuinfer-launcher"
    role = next(
        doc
        for _, doc in kit_objects()
        if doc["kind"] == "Role" and doc["metadata"]["name"] == "gpuinfer-launcher"
    )
    verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert "watch" not in verbs and verbs <= {"create", "get", "list", "delete"}


# --------------------------------------------------------------------------- admission policy


class AdmissionPolicy:
    """deploy/admission/hostpath-worker-policy.yaml evaluated as the API server does: match
    conditions, then the variables in order, then every validation; an expression that
    errors rejects the request (failurePolicy: Fail)."""

    def __init__(self) -> None:
        docs = load_all(DEPLOY / "admission" / "hostpath-worker-policy.yaml")
        self.policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
        self.binding = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding")
        self.env = celpy.Environment()

    def _evaluate(self, expression: str, activation: dict[str, Any]) -> Any:
        program = self.env.program(self.env.compile(expression))
        return program.evaluate(activation)

    def admit(self, pod: dict[str, Any], username: str = LAUNCHER) -> list[str]:
        """Messages of the failed validations; empty when the pod is admitted."""
        request = {"userInfo": {"username": username}, "operation": "CREATE"}
        activation: dict[str, Any] = {
            "object": celpy.json_to_cel(pod),
            "request": celpy.json_to_cel(request),
        }
        for condition in self.policy["spec"]["matchConditions"]:
            if not bool(self._evaluate(condition["expression"], activation)):
                return []  # the policy does not apply to this request
        variables: dict[str, Any] = {}
        for variable in self.policy["spec"]["variables"]:
            activation["variables"] = celpy.json_to_cel(variables)
            variables[variable["name"]] = _to_json(
                self._evaluate(variable["expression"], activation)
            )
        activation["variables"] = celpy.json_to_cel(variables)
        failures = []
        for validation in self.policy["spec"]["validations"]:
            try:
                allowed = self._evaluate(validation["expression"], activation)
                if isinstance(allowed, Exception):
                    raise allowed
            except Exception as exc:  # noqa: BLE001 - an evaluation error fails closed
                failures.append(f"{validation['message'].strip()} (error: {exc})")
                continue
            if allowed is not True and not (
                isinstance(allowed, celpy.celtypes.BoolType) and allowed
            ):
                failures.append(validation["message"].strip())
        return failures


def _to_json(value: Any) -> Any:
    """A CEL value as plain JSON, to bind a variable for the next expressions."""
    if isinstance(value, Exception):
        raise value
    if isinstance(value, celpy.celtypes.BoolType):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, int):
        return int(value)
    return value


@pytest.fixture(scope="module")
def policy() -> AdmissionPolicy:
    return AdmissionPolicy()


@pytest.mark.parametrize(("tp", "replicas"), [(1, 1), (2, 2), (8, 1)])
def test_the_policy_admits_the_builders_hostpath_pod(policy, tp, replicas):
    assert policy.admit(hostpath_worker_pod(tp, replicas)) == []
    assert policy.admit(worker_pod(tp, replicas)) == []  # and the PVC pod


def test_the_policy_rejects_a_privileged_pod(policy):
    pod = hostpath_worker_pod()
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = True
    assert any("unprivileged" in m for m in policy.admit(pod))
    escalating = hostpath_worker_pod()
    escalating["spec"]["containers"][0]["securityContext"] = {
        "capabilities": {"add": ["SYS_ADMIN"]}
    }
    assert any("unprivileged" in m for m in policy.admit(escalating))


def test_the_policy_rejects_a_pod_mounting_the_host_root(policy):
    pod = hostpath_worker_pod()
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    pod["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "host", "mountPath": "/host", "readOnly": True}
    )
    assert any("mount only emptyDir" in m for m in policy.admit(pod))
    writable = hostpath_worker_pod()
    for mount in writable["spec"]["containers"][0]["volumeMounts"]:
        if mount["name"] == "model-cache":
            mount["readOnly"] = False
    assert policy.admit(writable) == ["the model cache (hostPath) is mounted read-only"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s.update(serviceAccountName="default"), "service account gpuinfer-worker"),
        (lambda s: s.update(automountServiceAccountToken=True), "service account gpuinfer-worker"),
        (lambda s: s.update(hostNetwork=True), "no host network"),
        (
            lambda s: s["containers"][0]["env"].append(
                {"name": "X", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}
            ),
            "only the listed Secrets",
        ),
        (
            lambda s: s["volumes"].append({"name": "s", "secret": {"secretName": "other"}}),
            "mount only emptyDir",
        ),
        (lambda s: s["securityContext"].update(runAsNonRoot=False), "non-root"),
        (
            lambda s: s.update(initContainers=[{"name": "i", "image": "busybox"}]),
            "no init or ephemeral containers",
        ),
    ],
)
def test_the_policy_rejects_pods_unlike_the_builders(policy, change, expected):
    pod = hostpath_worker_pod()
    change(pod["spec"])
    assert any(expected in message for message in policy.admit(pod)), policy.admit(pod)


def test_the_policy_applies_to_the_launcher_in_worker_namespaces_only(policy):
    pod = hostpath_worker_pod()
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = True
    assert (
        policy.admit(pod, username="system:serviceaccount:kube-system:daemon-set-controller") == []
    )
    selector = policy.binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
    namespaces = [d for _, d in kit_objects() if d["kind"] == "Namespace"]
    selected = {
        n["metadata"]["name"]
        for n in namespaces
        if all(n["metadata"]["labels"].get(k) == v for k, v in selector.items())
    }
    assert selected == {"gpuinfer", "gpuinfer-research"}
    assert policy.binding["spec"]["validationActions"] == ["Deny"]
    assert policy.policy["spec"]["failurePolicy"] == "Fail"


# --------------------------------------------------------------------------- network


def test_network_policies_deny_by_default_and_allow_dns_s3_and_the_model_source():
    policies = {
        d["metadata"]["name"]: d for d in load_all(DEPLOY / "network" / "network-policies.yaml")
    }
    deny = policies["gpuinfer-default-deny"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    assert not any("ingress" in p["spec"] for p in policies.values()), "workers take no traffic"
    dns = policies["gpuinfer-allow-dns"]["spec"]["egress"][0]
    assert {p["port"] for p in dns["ports"]} == {53}
    pod_labels = worker_pod()["metadata"]["labels"]
    s3 = policies["gpuinfer-allow-object-storage"]["spec"]
    assert all(pod_labels.get(k) == v for k, v in s3["podSelector"]["matchLabels"].items())
    assert [p["port"] for rule in s3["egress"] for p in rule["ports"]] == [443]
    source = policies["gpuinfer-allow-model-source"]["spec"]
    warmer_labels = next(
        d for _, d in kit_objects() if d["kind"] == "Job" and "warmer" in d["metadata"]["name"]
    )["spec"]["template"]["metadata"]["labels"]
    assert all(warmer_labels.get(k) == v for k, v in source["podSelector"]["matchLabels"].items())


# --------------------------------------------------------------------------- images

DIGEST = re.compile(r"^[^\s@]+:[^:@/\s]+@sha256:[0-9a-f]{64}$")


def images_in(node: Any) -> list[str]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                found.append(value)
            elif key == "image" and isinstance(value, dict) and "repository" in value:
                found.append(f"{value['repository']}:{value['tag']}")
            else:
                found.extend(images_in(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(images_in(value))
    return found


def test_every_image_in_the_kit_is_pinned_by_digest():
    images = [image for _, doc in kit_objects() for image in images_in(doc)]
    values = helm_values()
    images += images_in(values)
    images += [v for k, v in code_location_env().items() if k == "GPUINFER_WORKER_IMAGE"]
    for dockerfile in DEPLOY.rglob("Dockerfile*"):
        images += re.findall(r"^ARG \w+_BASE=(\S+)$", dockerfile.read_text(), flags=re.MULTILINE)
    assert len(images) >= 8
    unpinned = [image for image in images if not DIGEST.match(image)]
    assert unpinned == []
    for bad in ("busybox:1.37.0", "repo/x:latest", "repo/x@sha256:abc", "repo/x"):
        assert not DIGEST.match(bad), bad


def test_the_gpu_image_installs_only_hash_locked_packages():
    dockerfile = (DEPLOY / "worker" / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert installs == [
        "RUN python3 -m pip install --require-hashes --no-deps -r requirements/lock-gpu.txt"
    ]
    lock = (REPO / "requirements" / "lock-gpu.txt").read_text()
    pins = re.findall(
        r"^([A-Za-z0-9_.-]+)==(\S+) \\\n    --hash=sha256:[0-9a-f]{64}$", lock, re.MULTILINE
    )
    entries = [line for line in lock.splitlines() if line and not line.startswith(("#", " "))]
    assert len(pins) == len(entries) > 100, "every entry is pinned with its sha256"
    pinned = {name.lower(): version for name, version in pins}
    for requirement in (REPO / "requirements" / "worker-gpu.in").read_text().splitlines():
        if requirement and not requirement.startswith("#"):
            name, version = requirement.split("==")
            assert pinned[name.lower()] == version, requirement


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    "name",
    ["DB_PASS", "DB_PASSWORD", "SMTP_PASSPHRASE", "OPENAI_KEY", "AWS_SECRET_KEY", "HF_TOKEN",
     "GITHUB_TOKEN_FILE", "MY_API_KEY", "CREDENTIALS_JSON", "TOKENIZER_HUB_TOKEN"],
)  # fmt: skip
def test_secret_env_names_are_refused_in_plain_env(name):
    assert is_secret_env_name(name)
    with pytest.raises(PodSpecError, match=rf"{name}.*SecretEnvRef"):
        build_worker_pod(
            worker_spec(),
            K8sLauncherConfig(image="w:1", env={name: "x"}),
            RunIdentity(run_id="r", asset_key="a"),
        )


def worker_spec() -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "embed",
            "input": {"uri": "s3://b/in/{partition_key}.jsonl"},
            "output": {"root": "s3://b/out", "asset_name": "a"},
            "partition_keys": ["p"],
        }
    )


@pytest.mark.parametrize(
    "name",
    ["HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL", "KEYBOARD", "PASSAGE_LIMIT", "TOKENIZERS_PARALLELISM"],
)
def test_honest_env_names_pass(name):
    assert not is_secret_env_name(name)
    pod = build_worker_pod(
        worker_spec(),
        K8sLauncherConfig(image="w:1", env={name: "false"}),
        RunIdentity(run_id="r", asset_key="a"),
    )
    entries = pod["spec"]["containers"][0]["env"]
    assert [item["value"] for item in entries if item["name"] == name] == ["false"]


def test_credentials_in_url_values_are_refused():
    assert url_with_credentials("postgresql://dagster:hunter2@db:5432/dagster")
    assert url_with_credentials("https://ghp_abc@github.com/x.git")
    assert not url_with_credentials("https://s3.us-east-1.amazonaws.com/bucket")
    assert not url_with_credentials("user@example.com")
    with pytest.raises(PodSpecError, match="DATABASE_URL.*credentials.*SecretEnvRef"):
        build_worker_pod(
            worker_spec(),
            K8sLauncherConfig(image="w:1", env={"DATABASE_URL": "postgres://u:p@db/x"}),
            RunIdentity(run_id="r", asset_key="a"),
        )


@pytest.mark.parametrize(
    "extra",
    [
        {"hf_token": "hf_abc"},
        {"api_key": "sk-1"},
        {"hf_overrides": {"access_token": "x"}},
        {"model_loader_extra_config": {"url": "s3://AKIA:secret@bucket/x"}},
        {"password": "x"},
    ],
)
def test_secret_looking_keys_in_engine_extra_are_refused_pointing_at_secret_env_ref(extra):
    with pytest.raises(ValueError, match="looks like a credential.*SecretEnvRef"):
        EngineArgs(extra=extra)
    with pytest.raises(InvalidInferenceSpec, match="SecretEnvRef"):
        validate_spec({**worker_spec().model_dump(), "engine": {"extra": extra}}, where="test")


def test_secret_looking_keys_in_sampling_extra_are_refused():
    with pytest.raises(ValueError, match=r"sampling.extra\['auth_token'\].*SecretEnvRef"):
        SamplingParams(extra={"auth_token": "x"})


@pytest.mark.parametrize(
    "key", ["stop_token_ids", "max_tokens", "tokenizer_mode", "skip_special_tokens",
            "allowed_token_ids", "kv_cache_dtype", "hf_overrides", "logit_bias"],
)  # fmt: skip
def test_vllm_option_names_with_token_in_them_pass(key):
    assert not is_secret_option_name(key)
    EngineArgs(extra={key: 1})


def test_a_secret_in_engine_overrides_fails_the_step_before_any_worker():
    gpu = GpuInferenceResource(engine_overrides={"extra": {"hf_token": "hf_abc"}})
    with pytest.raises(InvalidInferenceSpec, match="hf_token.*SecretEnvRef"):
        gpu.prepare_spec(worker_spec())


def test_s3_credentials_travel_as_env_var_names_and_the_worker_resolves_them(monkeypatch):
    s3 = S3Resource(
        endpoint_url="http://127.0.0.1:9000",
        region_name="us-east-1",
        aws_access_key_id=dg.EnvVar("MINIO_KEY"),
        aws_secret_access_key=dg.EnvVar("MINIO_SECRET"),
    )
    # No variable is set: nothing is resolved in the control plane.
    monkeypatch.delenv("MINIO_KEY", raising=False)
    settings = gpu_settings_from_s3_resource(s3)
    assert settings["env_references"] == {
        "AWS_ACCESS_KEY_ID": "MINIO_KEY",
        "AWS_SECRET_ACCESS_KEY": "MINIO_SECRET",
    }
    assert settings["env"] == {} and settings["s3_allow_http"] is True
    gpu = GpuInferenceResource(**settings)

    # What the local launcher hands the worker process: names only.
    from dagster_gpuinfer.resource import env_references_variable

    handed = env_references_variable(gpu.env_references)
    assert json.loads(handed[ENV_REFERENCES_VARIABLE]) == settings["env_references"]

    # The worker resolves them from its own environment, in its own process.
    worker_env = {**os.environ, **handed, "MINIO_KEY": "AKIA-LOCAL", "MINIO_SECRET": "s3cr3t"}
    worker_env.pop("AWS_SECRET_ACCESS_KEY", None)
    probe = (
        "import os\n"
        "from dagster_gpuinfer.worker.env_references import apply_env_references\n"
        "apply_env_references()\n"
        "print(os.environ['AWS_ACCESS_KEY_ID'], os.environ['AWS_SECRET_ACCESS_KEY'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=worker_env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["AKIA-LOCAL", "s3cr3t"]

    # A missing variable is named, and no value is printed.
    missing = {k: v for k, v in worker_env.items() if k != "MINIO_SECRET"}
    failed = subprocess.run(
        [sys.executable, "-c", probe], env=missing, capture_output=True, text=True, check=False
    )
    assert failed.returncode != 0 and "MINIO_SECRET" in failed.stderr
    assert "AKIA-LOCAL" not in failed.stderr


def test_literal_s3_credentials_are_refused_with_the_fix():
    s3 = S3Resource(aws_access_key_id="AKIA", aws_secret_access_key="literal")
    with pytest.raises(ValueError, match=r"aws_access_key_id.*dg.EnvVar"):
        gpu_settings_from_s3_resource(s3)


def test_env_references_cannot_reach_a_pod():
    gpu = GpuInferenceResource(
        launcher="k8s",
        k8s=K8sLauncherConfig(image="w:1"),
        env_references={"AWS_SECRET_ACCESS_KEY": "MINIO_SECRET"},
    )
    context = dg.build_asset_context()
    with pytest.raises(dg.Failure, match="Kubernetes Secret"):
        gpu._launch(context=context, spec=worker_spec())


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "key",
    ["../../../etc/x", "a/../../b", "/etc/passwd", "\\\\server\\share", "a\\..\\b", "a\x00b", ".."],
)
def test_traversal_partition_keys_are_refused_naming_the_key(key):
    raw = {**worker_spec().model_dump(), "partition_keys": [key]}
    with pytest.raises(InvalidInferenceSpec) as caught:
        validate_spec(raw, where="test")
    assert repr(key) in str(caught.value)


@pytest.mark.parametrize("key", ["2026/01/a", "a..b", "big@rows=0-100", ".hidden-ok/x", "x.."])
def test_ordinary_partition_keys_pass(key):
    InferenceSpec.model_validate({**worker_spec().model_dump(), "partition_keys": [key]})


def test_a_traversal_key_cannot_read_a_local_file_outside_the_input_root(tmp_path):
    root = tmp_path / "inputs"
    root.mkdir()
    (tmp_path / "secret.jsonl").write_text('{"id": "1", "text": "not yours"}\n')
    raw = {
        **worker_spec().model_dump(),
        "input": {"uri": f"{root}/{{partition_key}}.jsonl"},
        "partition_keys": ["../secret"],
    }
    with pytest.raises(InvalidInferenceSpec, match="'../secret'"):
        validate_spec(raw, where="test")


class ListedKeys:
    """A FileLister over a fixed listing: object stores list such keys as they are."""

    def __init__(self, names: list[str]) -> None:
        self.names = sorted(names)

    def list_after(self, start_after: str):
        return iter([ListedFile(n, 10) for n in self.names if n > start_after])

    def open(self, name: str):  # pragma: no cover - no splitting here
        raise AssertionError(name)


def test_the_arrival_scan_refuses_traversal_keys_naming_them():
    watched = WatchedFiles("s3://bucket/in/{partition_key}.jsonl")
    lister = ListedKeys(
        ["good.jsonl", "a/../../etc/x.jsonl", "x\\..\\..\\up.jsonl", "2026/ok.jsonl"]
    )
    scan = scan_arrivals(
        lister, watched, start_after="", is_known=lambda _: False, max_new_files=10, max_listed=10
    )
    assert [f.name for f in scan.new_files] == ["2026/ok.jsonl", "good.jsonl"]
    reasons = dict(scan.rejected)
    assert "'a/../../etc/x'" in reasons["a/../../etc/x.jsonl"]
    assert "'x\\\\..\\\\..\\\\up'" in reasons["x\\..\\..\\up.jsonl"]


def test_the_arrival_sensor_on_s3_registers_no_traversal_key(s3_server):
    bucket = s3_server.new_bucket("traversal")
    for key in ("in/good.jsonl", "in/x/../../../etc/passwd.jsonl"):
        s3_server.client.put_object(Bucket=bucket, Key=key, Body=b'{"id": "1", "text": "t"}\n')
    pipeline = inference_assets(
        name="traversal_guard",
        model="/models/x",
        task="embed",
        input=InputSpec(uri=f"s3://{bucket}/in/{{partition_key}}.jsonl"),
        output_root=f"s3://{bucket}/out",
        partitions_def=dg.DynamicPartitionsDefinition(name="traversal_files"),
    )
    sensor = arrival_sensor(pipeline, s3_resource_key="s3")
    s3 = S3Resource(endpoint_url=s3_server.endpoint_url, region_name=s3_server.region)
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(
            instance=instance, resources={"gpu": GpuInferenceResource(), "s3": s3}
        )
        result = sensor(context)
    assert [k for r in result.dynamic_partitions_requests for k in r.partition_keys] == ["good"]


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../other/part.parquet", "sub/part.parquet", "a\\b.parquet", "..", ""]
)
def test_manifest_part_names_must_be_plain_file_names(name):
    with pytest.raises(ValueError, match="not a plain file name"):
        FileEntry(name=name, rows=1, bytes=1, sha256="0" * 64)


def test_read_partition_refuses_a_manifest_naming_a_file_outside_the_partition(tmp_path):
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(table_to_parquet_bytes(pa.table({"id": ["stolen"]})))
    spec = worker_spec().model_copy(
        update={"output": worker_spec().output.model_copy(update={"root": str(tmp_path / "out")})}
    )
    fs, path = filesystem_for(partition_dir(spec.output, "p"), spec.storage)
    errors = write_file_entry(fs, path, "errors.parquet", table_to_parquet_bytes(pa.table({})), 0)
    manifest = {
        "partition_key": "p",
        "spec_hash": spec.spec_hash(),
        "model": spec.model,
        "task": spec.task,
        "output_format": "parquet",
        "rows_in": 1,
        "rows_out": 1,
        "rows_errored": 0,
        "parts": [{"name": str(outside), "rows": 1, "bytes": 1, "sha256": "0" * 64}],
        "errors": errors.model_dump(),
    }
    write_bytes_atomic(fs, f"{path}/{MANIFEST_NAME}", json.dumps(manifest).encode())
    with pytest.raises(ValueError, match="not a plain file name"):
        read_partition(spec.output, "p", spec.storage)


# --------------------------------------------------------------------------- weights


def test_weights_load_from_safetensors_unless_the_spec_opts_in_to_pickle():
    assert EngineArgs().to_vllm_kwargs()["load_format"] == "safetensors"
    assert "allow_pickle_weights" not in EngineArgs().to_vllm_kwargs()
    for unsafe in ("auto", "pt", "npcache", "hf"):
        with pytest.raises(ValueError, match="pickle.*allow_pickle_weights=True"):
            EngineArgs(load_format=unsafe)
        assert (
            EngineArgs(load_format=unsafe, allow_pickle_weights=True).to_vllm_kwargs()[
                "load_format"
            ]
            == unsafe
        )
    with pytest.raises(ValueError, match="engine.load_format"):
        EngineArgs(extra={"load_format": "pt"})
    # The load format decides nothing about results: it stays out of the spec hash.
    spec = worker_spec()
    opted = spec.model_copy(
        update={"engine": EngineArgs(load_format="pt", allow_pickle_weights=True)}
    )
    assert opted.spec_hash() == spec.spec_hash()


def test_the_test_models_ship_safetensors(minilm_dir, tiny_llama_dir):
    for directory in (minilm_dir, tiny_llama_dir):
        files = os.listdir(directory)
        assert any(f.endswith(".safetensors") for f in files), files
        assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files), files
