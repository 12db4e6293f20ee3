"""The hostPath alternative: the ValidatingAdmissionPolicy's CEL, evaluated with cel-python,
admits the builder's pod and rejects a privileged pod, a `hostPath: /` pod, a writable cache,
another Secret or service account.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

from typing import Any

import pytest
from security_support import (
    DEPLOY,
    LAUNCHER,
    CelAdmissionPolicy,
    hostpath_worker_pod,
    kit_objects,
    worker_pod,
)

# --------------------------------------------------------------------------- admission policy


class AdmissionPolicy(CelAdmissionPolicy):
    """deploy/admission/hostpath-worker-policy.yaml; requests come from `username`."""

    def __init__(self) -> None:
        super().__init__(DEPLOY / "admission" / "hostpath-worker-policy.yaml")

    def admit(self, pod: dict[str, Any], username: str = LAUNCHER) -> list[str]:  # type: ignore[override]
        """Messages of the failed validations; empty when the pod is admitted."""
        return super().admit(pod, {"userInfo": {"username": username}, "operation": "CREATE"})


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
