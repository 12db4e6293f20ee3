"""Pod Security `restricted` in the worker namespaces: the worker pods, the cache warmer and the
Helm run and code-server pods pass its rules; the launcher account is on run pods only.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

from typing import Any

import pytest
from security_support import (
    DEPLOY,
    helm_values,
    hostpath_worker_pod,
    kit_objects,
    load_all,
    worker_pod,
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
