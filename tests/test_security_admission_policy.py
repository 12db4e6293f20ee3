"""The hostPath alternative: the ValidatingAdmissionPolicy's CEL, evaluated with cel-python,
admits the builder's pod and rejects a privileged pod, a `hostPath: /` pod, a writable cache,
another Secret or service account.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

from typing import Any

import celpy
import pytest
from security_support import (
    DEPLOY,
    LAUNCHER,
    hostpath_worker_pod,
    kit_objects,
    load_all,
    worker_pod,
)

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
