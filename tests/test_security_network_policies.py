"""NetworkPolicies: default-deny for every pod of a worker namespace, then DNS, the S3 endpoint
(workers) and the model source (warmers).

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

from security_support import DEPLOY, kit_objects, load_all, worker_pod

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


def test_pool_workers_reach_s3_and_the_lease_queue_database_and_nothing_else():
    from security_support import DEPLOY as deploy

    from dagster_gpuinfer.k8s.config import K8sLauncherConfig
    from dagster_gpuinfer.k8s.pool_pod import build_pool_pod

    policies = [
        d
        for d in load_all(deploy / "network" / "network-policies.yaml")
        if d["metadata"]["name"] == "gpuinfer-allow-pool-workers"
    ]
    assert {p["metadata"]["namespace"] for p in policies} == {"gpuinfer", "gpuinfer-research"}
    pool_labels = build_pool_pod("m-0123456789ab", "w", K8sLauncherConfig(image="w:1"))["metadata"][
        "labels"
    ]
    for policy in policies:
        spec = policy["spec"]
        selector = spec["podSelector"]["matchLabels"]
        assert all(pool_labels.get(k) == v for k, v in selector.items())
        assert sorted(p["port"] for rule in spec["egress"] for p in rule["ports"]) == [443, 5432]
    worker_labels = worker_pod()["metadata"]["labels"]
    assert not all(worker_labels.get(k) == v for k, v in selector.items()), (
        "per-run workers do not talk to the lease queue"
    )
