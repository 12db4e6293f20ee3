"""Every worker namespace gets its NetworkPolicies, Role, RoleBinding and worker account, and
an admission rule limits which Secrets its pods may read
(deploy/admission/worker-secrets-policy.yaml, evaluated with cel-python as the API server
would: variables in order, then every validation; an expression that errors rejects)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from security_support import DEPLOY, CelAdmissionPolicy, load_all

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from resources.k8s import k8s_launcher_config


def kit() -> list[dict[str, Any]]:
    return [
        doc
        for path in DEPLOY.rglob("*.yaml")
        if "local" not in path.relative_to(DEPLOY).parts and path.parent.name != "helm"
        for doc in load_all(path)
        if isinstance(doc, dict) and "kind" in doc
    ]


def worker_namespaces() -> list[str]:
    return [
        doc["metadata"]["name"]
        for doc in load_all(DEPLOY / "namespaces.yaml")
        if doc["metadata"].get("labels", {}).get("gpuinfer.dagster.io/kueue") == "managed"
    ]


@pytest.mark.parametrize("namespace", worker_namespaces())
def test_every_worker_namespace_gets_its_policies_role_and_account(namespace):
    here = [d for d in kit() if d.get("metadata", {}).get("namespace") == namespace]
    policies = {d["metadata"]["name"]: d for d in here if d["kind"] == "NetworkPolicy"}
    assert {
        "gpuinfer-default-deny",
        "gpuinfer-allow-dns",
        "gpuinfer-allow-object-storage",
        "gpuinfer-allow-model-source",
    } <= set(policies)
    deny = policies["gpuinfer-default-deny"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    accounts = [d for d in here if d["kind"] == "ServiceAccount"]
    assert [a["metadata"]["name"] for a in accounts] == ["gpuinfer-worker"]
    assert accounts[0]["automountServiceAccountToken"] is False
    (role,) = [d for d in here if d["kind"] == "Role"]
    assert all("secrets" not in rule["resources"] for rule in role["rules"])
    (binding,) = [d for d in here if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpuinfer-launcher", "namespace": "dagster"}
    ]


class SecretsPolicy(CelAdmissionPolicy):
    """deploy/admission/worker-secrets-policy.yaml; requests name the pod's namespace."""

    def __init__(self) -> None:
        super().__init__(DEPLOY / "admission" / "worker-secrets-policy.yaml")

    def admit(self, pod: dict[str, Any], namespace: str) -> list[str]:  # type: ignore[override]
        return super().admit(pod, {"namespace": namespace, "operation": "CREATE"})


@pytest.fixture(scope="module")
def policy() -> SecretsPolicy:
    return SecretsPolicy()


def helm_env() -> dict[str, str]:
    deployment = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())[
        "dagster-user-deployments"
    ]["deployments"][0]
    return {item["name"]: item["value"] for item in deployment["env"]}


def builder_pod(namespace: str = "gpuinfer") -> dict[str, Any]:
    env = helm_env()
    env["GPUINFER_HF_TOKEN_SECRET"] = "hf-token"
    env["GPUINFER_NAMESPACE"] = namespace
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "generate",
            "input": {"uri": "s3://b/in/{partition_key}.jsonl"},
            "output": {"root": "s3://b/out", "asset_name": "a"},
            "partition_keys": ["p"],
        }
    )
    config = k8s_launcher_config(env)
    return build_worker_pod(spec, config, RunIdentity(run_id="r" * 36, asset_key="a"))


def test_the_binding_covers_every_worker_namespace(policy):
    selector = policy.binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
    assert selector == {"gpuinfer.dagster.io/kueue": "managed"}
    assert policy.binding["spec"]["validationActions"] == ["Deny"]


@pytest.mark.parametrize("namespace", worker_namespaces())
def test_the_builders_pod_and_the_cache_warmers_are_admitted(policy, namespace):
    pod = builder_pod(namespace)
    container = pod["spec"]["containers"][0]
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", []) if
            "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]  # fmt: skip
    assert "hf-token" in refs  # the pod does read a Secret, by reference
    assert policy.admit(pod, namespace) == []
    for path in (DEPLOY / "model-cache").glob("warmer-*.yaml"):
        for doc in load_all(path):
            if doc["kind"] in ("Job", "DaemonSet"):
                assert policy.admit(doc["spec"]["template"], "gpuinfer") == [], path.name


def _hostile(change) -> dict[str, Any]:
    pod = copy.deepcopy(builder_pod())
    change(pod["spec"], pod["spec"]["containers"][0])
    return pod


HOSTILE = {
    "another secret by env": lambda spec, c: c.setdefault("env", []).append(
        {
            "name": "X",
            "valueFrom": {
                "secretKeyRef": {"name": "dagster-postgresql-secret", "key": "postgresql-password"}
            },
        }
    ),  # fmt: skip
    "another secret by envFrom": lambda spec, c: c.setdefault("envFrom", []).append(
        {"secretRef": {"name": "tenant-b-s3"}}
    ),
    "a secret volume": lambda spec, c: spec.setdefault("volumes", []).append(
        {"name": "s", "secret": {"secretName": "gpuinfer-s3"}}
    ),
    "a projected token": lambda spec, c: spec.setdefault("volumes", []).append(
        {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
    ),
    "a csi secrets store": lambda spec, c: spec.setdefault("volumes", []).append(
        {"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}}
    ),
    "an init container reading a secret": lambda spec, c: spec.setdefault(
        "initContainers", []
    ).append({"name": "i", "image": "x", "envFrom": [{"secretRef": {"name": "other"}}]}),
    "a pull secret not listed": lambda spec, c: spec.update(
        imagePullSecrets=[{"name": "someone-elses-registry"}]
    ),
    "the launcher's account": lambda spec, c: spec.update(serviceAccountName="gpuinfer-launcher"),
    "a mounted token": lambda spec, c: spec.update(automountServiceAccountToken=True),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_pods_reading_other_secrets_are_refused(policy, case):
    failures = policy.admit(_hostile(HOSTILE[case]), "gpuinfer")
    assert len(failures) == 1, failures


def test_a_namespace_not_listed_may_read_no_secret(policy):
    assert policy.admit(builder_pod(), "gpuinfer-unlisted")


def test_the_policy_admits_pool_worker_pods_with_the_lease_queue_secret(policy):
    from dagster_gpuinfer.k8s.pool_pod import build_pool_pod

    config = k8s_launcher_config({**helm_env(), "GPUINFER_NAMESPACE": "gpuinfer-research"})
    pod = build_pool_pod("m-0123456789ab", "w-1", config)
    assert policy.admit(pod, "gpuinfer-research") == []
    other = config.model_copy(
        update={"pools": config.pools.model_copy(update={"queue_secret": "someone-elses-db"})}
    )
    assert policy.admit(build_pool_pod("m-0123456789ab", "w-1", other), "gpuinfer-research")
