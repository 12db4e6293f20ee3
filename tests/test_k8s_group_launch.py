"""The pod group's lifecycle through the k8s launcher, on the fake cluster (`k8s_fakes`).

Everything above the Kubernetes API is real: the asset, the resource, `PipesK8sClient`
reading the leader's Pipes messages, Dagster's retry policy. The followers' pods are scripted
(they run and stay running, or fail at a given fake second).
"""

from __future__ import annotations

from typing import Any

import pytest

from dagster_gpuinfer.k8s.config import KUEUE_QUEUE_LABEL
from dagster_gpuinfer.k8s.group import ROLE_LABEL
from dagster_gpuinfer.resource import RUN_QUEUE_TAG
from dagster_gpuinfer.worker.follower import FOLLOWER_MODULE
from tests.k8s_fakes import (
    POLL,
    FakeKubernetes,
    PodScript,
    _error_text,
    committing_worker,
    crashing_worker,
    failure_metadata,
    failures,
    materialize,
)


def follower_script() -> PodScript:
    return PodScript(worker=lambda env: ["follower rank 1: leader reachable, starting vLLM"])


class FollowerFailsAt(FakeKubernetes):
    """A cluster where followers' containers exit 1 `at` fake seconds after their creation
    (the first `times` followers)."""

    def __init__(self, *scripts: PodScript, at: float, times: int = 1) -> None:
        super().__init__(*scripts)
        self.at = at
        self.times = times
        self.failed_at: list[float] = []
        self.deleted_at: dict[str, float] = {}

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs: Any):
        self._maybe_fail(name)
        return super().read_namespaced_pod(name, namespace, **kwargs)

    def _maybe_fail(self, name: str) -> None:
        pod = self.pods.get(name)
        if (
            pod is not None
            and pod.manifest["metadata"]["labels"][ROLE_LABEL] == "follower"
            and not pod.finished
            and len(self.failed_at) < self.times
            and self.clock.now - pod.created_at >= self.at
        ):
            pod.logs = [*(pod.logs or []), "RuntimeError: Gloo connectFullMesh failed"]
            pod.script.exit_code, pod.finished = 1, True
            self.failed_at.append(self.clock.now)

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> None:
        self.deleted_at.setdefault(name, self.clock.now)
        super().delete_namespaced_pod(name, namespace, **kwargs)


def roles(cluster: FakeKubernetes) -> list[str]:
    return [p.manifest["metadata"]["labels"][ROLE_LABEL] for p in cluster.created]


def test_leader_success_ends_the_group_and_leaves_nothing_behind(tmp_path):
    cluster = FakeKubernetes(follower_script())
    result = materialize(tmp_path, cluster, tensor_parallel_size=2, nodes=2)
    assert result.success, failures(result)
    assert roles(cluster) == ["follower", "leader"]
    follower, leader = cluster.created
    assert follower.manifest["spec"]["containers"][0]["command"][-1] == FOLLOWER_MODULE
    assert "DAGSTER_PIPES_CONTEXT" in {
        e["name"] for e in leader.manifest["spec"]["containers"][0]["env"]
    }
    assert cluster.pods == {} and cluster.services == {}
    assert (tmp_path / "out" / "doc_embeddings" / "shard-0" / "_SUCCESS").exists()


def test_lost_follower_fails_the_group_fast_and_the_retry_commits_once(tmp_path):
    cluster = FollowerFailsAt(
        follower_script(),
        PodScript(pulling_for=600.0, worker=committing_worker()),  # still starting at 30 s
        follower_script(),
        at=30.0,
    )
    result = materialize(
        tmp_path, cluster, partitions=("shard-0", "shard-1"), tensor_parallel_size=2, nodes=2
    )
    assert result.success, failures(result)
    (first,) = failures(result)
    message = _error_text(first.error)
    assert "follower pod" in message and "node rank 1" in message
    assert "Gloo connectFullMesh failed" in message
    # The leader was deleted at the poll that saw the loss, not at its pending timeout.
    (lost_at,) = cluster.failed_at
    assert cluster.deleted_at[cluster.created[1].name] == lost_at < 30.0 + POLL
    assert roles(cluster) == ["follower", "leader", "follower", "leader"]
    assert cluster.pods == {} and cluster.services == {}
    for key in ("shard-0", "shard-1"):
        assert (tmp_path / "out" / "doc_embeddings" / key / "_SUCCESS").exists()


def test_group_loss_is_retryable_with_the_lost_rank_in_metadata(tmp_path):
    cluster = FollowerFailsAt(
        follower_script(),
        PodScript(pulling_for=600.0, worker=committing_worker()),
        follower_script(),
        PodScript(pulling_for=600.0, worker=committing_worker()),
        at=0.0,
        times=2,
    )
    result = materialize(tmp_path, cluster, tensor_parallel_size=2, nodes=2)
    assert not result.success
    metadata = failure_metadata(result)
    assert metadata["retryable"] is True
    assert metadata["pod_failure_detail"]["node_rank"] == 1
    assert len(cluster.failed_at) == 2
    for pod in (cluster.created[1], cluster.created[3]):  # the two leaders
        assert cluster.deleted_at[pod.name] - pod.created_at <= POLL  # a poll, not a timeout
    assert cluster.pods == {} and cluster.services == {}


def test_leader_crashing_on_a_lost_follower_reports_the_follower(tmp_path):
    """The follower dies between two polls and its broken collective takes the leader down
    before the launcher reads the follower: the failure names the lost rank, not the
    leader's gloo traceback (seen through the pod executor: 'Connection reset by peer')."""
    cluster = FollowerFailsAt(
        follower_script(),
        PodScript(
            worker=crashing_worker("RuntimeError: gloo Read error: Connection reset by peer"),
            exit_code=1,
        ),
        follower_script(),
        PodScript(worker=committing_worker()),
        at=0.0,
    )
    result = materialize(tmp_path, cluster, tensor_parallel_size=2, nodes=2)
    assert result.success, failures(result)
    (first,) = failures(result)
    message = _error_text(first.error)
    assert "follower pod" in message and "node rank 1" in message
    assert "Gloo connectFullMesh failed" in message  # the follower's own log tail
    assert roles(cluster) == ["follower", "leader", "follower", "leader"]
    assert cluster.pods == {} and cluster.services == {}


@pytest.mark.parametrize("nodes", [1, 2], ids=["one_pod", "pod_group"])
def test_run_queue_tag_puts_every_worker_pod_in_the_tenants_kueue_queue(tmp_path, nodes):
    # The batch API tags a tenant's runs with the tenant's LocalQueue; a model spanning
    # nodes must not fall back to the resource's shared queue (k8s.placement.kueue_queue).
    cluster = FakeKubernetes(*[follower_script()] * (nodes - 1))
    result = materialize(
        tmp_path,
        cluster,
        run_tags={RUN_QUEUE_TAG: "acme-gpu"},
        tensor_parallel_size=2,
        nodes=nodes,
    )
    assert result.success, failures(result)
    assert len(cluster.created) == nodes
    queues = [p.manifest["metadata"]["labels"].get(KUEUE_QUEUE_LABEL) for p in cluster.created]
    assert queues == ["acme-gpu"] * nodes
