"""`build_worker_group`: one engine across pods, as a valid Kueue plain pod group.

Every object is checked against the Kubernetes 1.37 schema in strict mode, and each pod by
the same checks as a one-pod worker (`assert_valid_pod`). The spec's rank split is validated
before anything is built.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from dagster_gpuinfer.k8s.config import PodSpecError, WorkerPlacement
from dagster_gpuinfer.k8s.group import (
    MASTER_ADDR_ENV,
    POD_GROUP_COUNT_ANNOTATION,
    POD_GROUP_NAME_LABEL,
    GroupConfig,
    build_worker_group,
)
from dagster_gpuinfer.worker.follower import (
    FOLLOWER_MODULE,
    engine_cli_args,
    parse_args,
)
from dagster_gpuinfer.worker.loop.engine import engine_kwargs
from tests.test_k8s_pod import (
    IDENTITY,
    K8S_VERSION,
    assert_valid_pod,
    make_config,
    make_spec,
)


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        item["name"]: item.get("value", item.get("valueFrom"))
        for item in pod["spec"]["containers"][0]["env"]
    }


def two_by_eight(**config: Any):
    spec = make_spec(tensor_parallel_size=8, pipeline_parallel_size=2, nodes=2)
    launcher = make_config(placement=WorkerPlacement(kueue_queue="gpu-inference"))
    return spec, build_worker_group(spec, launcher, IDENTITY, GroupConfig(**config))


def test_two_node_group_is_valid_and_one_kueue_gang():
    spec, group = two_by_eight()
    kubernetes_validate.validate(group.service, K8S_VERSION, strict=True)
    assert len(group.pods) == 2
    for pod in group.pods:
        assert_valid_pod(pod)
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels[POD_GROUP_NAME_LABEL] == group.name
        assert labels["kueue.x-k8s.io/queue-name"] == "gpu-inference"
        assert annotations[POD_GROUP_COUNT_ANNOTATION] == "2"
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "8"  # 8 x 2 ranks over 2 nodes
    assert len({pod["metadata"]["name"] for pod in group.pods}) == 2


def test_followers_reach_the_leader_through_its_headless_service():
    _, group = two_by_eight()
    service = group.service
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    leader_labels = group.leader["metadata"]["labels"]
    assert all(leader_labels[k] == v for k, v in service["spec"]["selector"].items())
    (follower,) = group.followers
    assert not all(
        follower["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items()
    )
    dns = f"{service['metadata']['name']}.team-a.svc"
    assert env_of(follower)[MASTER_ADDR_ENV] == dns
    assert env_of(group.leader)[MASTER_ADDR_ENV] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for pod in group.pods:
        env = env_of(pod)
        assert env["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_leader_runs_the_worker_and_followers_run_vllm_headless_with_its_engine_args(
    monkeypatch: pytest.MonkeyPatch,
):
    spec, group = two_by_eight()
    assert group.leader["spec"]["containers"][0]["command"] == [
        "python3",
        "-m",
        "dagster_gpuinfer.worker",
    ]
    (follower,) = group.followers
    container = follower["spec"]["containers"][0]
    assert container["command"] == ["python3", "-m", FOLLOWER_MODULE]
    args = parse_args(container["args"])
    assert (args.nnodes, args.node_rank, args.tensor_parallel_size) == (2, 1, 8)
    assert args.pipeline_parallel_size == 2
    # The follower builds its part of the engine with the leader's very arguments.
    monkeypatch.setenv(MASTER_ADDR_ENV, "10.0.0.1")
    assert engine_cli_args(json.loads(args.engine_args_json)) == engine_cli_args(
        engine_kwargs(spec)
    )


def test_followers_sit_in_the_leaders_topology_domain():
    _, group = two_by_eight(topology_key="topology.kubernetes.io/rack")
    (follower,) = group.followers
    (term,) = follower["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "topology.kubernetes.io/rack"
    selector = term["labelSelector"]["matchLabels"]
    assert all(group.leader["metadata"]["labels"][k] == v for k, v in selector.items())
    assert "affinity" not in group.leader["spec"]
    _, loose = two_by_eight(topology_key=None)
    assert "affinity" not in loose.followers[0]["spec"]


def test_node_env_goes_to_its_rank_only():
    _, group = two_by_eight(node_env=[{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"X_RANK": "1"}])
    assert env_of(group.leader)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "X_RANK" not in env_of(group.leader)
    assert env_of(group.followers[0])["X_RANK"] == "1"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"tensor_parallel_size": 3, "nodes": 2}, "must divide"),
        ({"tensor_parallel_size": 8, "nodes": 2, "replicas": 2}, "one replica"),
        (
            {
                "tensor_parallel_size": 2,
                "nodes": 2,
                "engine": {"extra": {"distributed_executor_backend": "ray"}},
            },
            "multiprocessing backend",
        ),
    ],
)
def test_spec_refuses_ranks_that_do_not_split_over_the_nodes(fields, expected):
    with pytest.raises(ValueError, match=expected):
        make_spec(**fields)


def test_one_node_spec_is_not_a_group():
    with pytest.raises(PodSpecError, match="nodes > 1"):
        build_worker_group(make_spec(), make_config(), IDENTITY, GroupConfig())


def test_group_scheduling_fields_keep_committed_chunks_valid():
    assert make_spec(tensor_parallel_size=2, nodes=2).spec_hash() == make_spec().spec_hash()


def test_leader_without_its_address_says_how_to_launch(monkeypatch: pytest.MonkeyPatch):
    from dagster_gpuinfer.worker.errors import SpecError

    monkeypatch.delenv(MASTER_ADDR_ENV, raising=False)
    with pytest.raises(SpecError, match="GPUINFER_MASTER_ADDR is not set"):
        engine_kwargs(make_spec(tensor_parallel_size=2, nodes=2))


def test_checked_in_2x8_example_is_what_the_builder_makes():
    import sys
    from pathlib import Path

    import yaml

    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "deploy" / "checkov"))
    import gate

    example = list(
        yaml.safe_load_all((repo / "deploy/multinode/worker-group-2x8.yaml").read_text())
    )
    assert example == gate.worker_group_objects()
    for doc in example:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_one_pod_pipeline_parallel_engine_requests_every_stage_gpus():
    from dagster_gpuinfer.k8s.pod import build_worker_pod

    pod = build_worker_pod(
        make_spec(tensor_parallel_size=2, pipeline_parallel_size=2), make_config(), IDENTITY
    )
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
