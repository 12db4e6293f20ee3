"""Lease priority of a run's pool job: its run tag, or the pods' Kueue PriorityClass."""

from __future__ import annotations

from types import SimpleNamespace

import dagster as dg
import pytest
import yaml

from dagster_gpuinfer.k8s.config import K8sLauncherConfig, WorkerPlacement
from dagster_gpuinfer.pools import JobSubmission, WorkItem, open_lease_queue
from dagster_gpuinfer.resource import (
    KIT_PRIORITY_CLASSES,
    RUN_PRIORITY_TAG,
    GpuInferenceResource,
    PoolSettings,
)


def test_the_default_classes_are_the_kits():
    with open("deploy/kueue/priority-classes.yaml") as handle:
        kit = {
            doc["metadata"]["name"]: doc["value"]
            for doc in yaml.safe_load_all(handle)
            if doc and doc.get("kind") == "PriorityClass"
        }
    assert kit == KIT_PRIORITY_CLASSES
    assert PoolSettings().priority_classes == kit


@pytest.mark.parametrize(
    ("tags", "priority_class", "expected"),
    [
        ({}, None, 0),
        ({}, "gpuinfer-batch", 1000),
        ({}, "a-class-the-pool-does-not-know", 0),
        ({RUN_PRIORITY_TAG: "7"}, "gpuinfer-batch", 7),
        ({RUN_PRIORITY_TAG: "-3"}, None, -3),
        ({RUN_PRIORITY_TAG: "gpuinfer-batch"}, None, 1000),
        ({RUN_PRIORITY_TAG: "urgent"}, None, 5000),
    ],
)
def test_a_runs_lease_priority(tags, priority_class, expected):
    settings = PoolSettings(priority_classes={**KIT_PRIORITY_CLASSES, "urgent": 5000})
    assert settings.lease_priority(tags, priority_class) == expected


def test_an_unknown_priority_tag_is_refused_naming_it():
    with pytest.raises(dg.Failure) as failure:
        PoolSettings().lease_priority({RUN_PRIORITY_TAG: "soon"}, None)
    assert failure.value.allow_retries is False
    assert "gpuinfer/priority='soon'" in failure.value.description
    assert "gpuinfer-batch" in failure.value.description


def test_the_pool_launcher_takes_the_pods_priority_class_and_a_tag_overrides_it(tmp_path):
    k8s = K8sLauncherConfig(
        image="worker:1", placement=WorkerPlacement(priority_class="gpuinfer-batch")
    )
    resource = GpuInferenceResource(
        launcher="k8s", k8s=k8s, pool=PoolSettings(queue=str(tmp_path / "q.db"))
    )
    untagged = SimpleNamespace(run=SimpleNamespace(tags={}))
    tagged = SimpleNamespace(run=SimpleNamespace(tags={RUN_PRIORITY_TAG: "5"}))
    assert resource.launcher_for(untagged, "pool").priority == 1000
    assert resource.launcher_for(tagged, "pool").priority == 5


def test_a_higher_priority_job_is_leased_first_whatever_came_first(tmp_path):
    with open_lease_queue(str(tmp_path / "q.db")) as queue:
        for job_id, priority in (("backfill", 0), ("tenant", 1000)):
            items = [WorkItem(key=f"{job_id}-{i}") for i in range(3)]
            queue.submit(JobSubmission(job_id, "pool-a", items, priority=priority))
        order = [queue.lease("pool-a", worker_id="w", ttl_s=30).job_id for _ in range(4)]
    assert order == ["tenant", "tenant", "tenant", "backfill"]
