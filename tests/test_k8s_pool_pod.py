"""Engine pool worker pods: the pure builder against the Kubernetes schema and the worker
pod it derives from, and `K8sPoolBackend` against the pod executor (real processes, no
engine: the pool worker with a real engine is tests/test_k8s_pool_e2e.py)."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pod_executor import PodExecutor, to_model

from dagster_gpuinfer.k8s.config import (
    KUEUE_QUEUE_LABEL,
    QUEUE_MOUNT,
    K8sLauncherConfig,
    PodSpecError,
    PoolPods,
)
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.k8s.pool_backend import K8sPoolBackend
from dagster_gpuinfer.k8s.pool_pod import (
    POOL_LABEL,
    build_pool_pod,
    pool_pod_name,
)
from dagster_gpuinfer.pools import QUEUE_ENV
from dagster_gpuinfer.spec import InferenceSpec
from resources.k8s import k8s_launcher_config

KEY = "llama-3-1-8b-instruct-0123456789ab"
K8S_VERSION = "1.37.0"
PRODUCTION_ENV = {"GPUINFER_WORKER_IMAGE": "registry.example.com/gpuinfer-worker:0.1.0"}


def production_config(**pools: str) -> K8sLauncherConfig:
    config = k8s_launcher_config(PRODUCTION_ENV)
    return config.model_copy(update={"pools": PoolPods(**pools)}) if pools else config


def test_pool_pod_validates_strictly_and_runs_the_worker_in_pool_mode():
    pod = build_pool_pod(KEY, "w-7", production_config(), idle_ttl_s=120, lease_ttl_s=15, gpus=2)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert pod["metadata"]["labels"][POOL_LABEL] == KEY
    assert pod["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "gpu-inference"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["priorityClassName"] == "gpuinfer-batch"
    container = spec["containers"][0]
    assert container["command"] == ["python3", "-m", "dagster_gpuinfer.worker"]
    assert container["args"] == [
        "--pool",
        KEY,
        "--worker-id",
        "w-7",
        "--idle-ttl",
        "120",
        "--lease-ttl",
        "15",
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    queue = [e for e in container["env"] if e["name"] == QUEUE_ENV]
    assert queue == [
        {
            "name": QUEUE_ENV,
            "valueFrom": {
                "secretKeyRef": {"name": "gpuinfer-lease-queue", "key": "url", "optional": False}
            },
        }
    ]


def test_pool_pod_keeps_every_hardening_and_placement_field_of_the_worker_pod():
    config = production_config()
    worker = build_worker_pod(
        InferenceSpec.model_validate(
            {
                "model": "/models/Llama-3.1-8B-Instruct",
                "task": "generate",
                "input": {"uri": "s3://b/{partition_key}.jsonl"},
                "output": {"root": "s3://b/out", "asset_name": "completions"},
                "partition_keys": ["p0"],
                "tensor_parallel_size": 2,
            }
        ),
        config,
        RunIdentity(run_id="6633a66a-ab2b-4333-bb5f-adbdffff1812", asset_key="completions"),
    )
    pool = build_pool_pod(KEY, "w-1", config, gpus=2)
    for field in set(worker["spec"]) - {"containers"}:
        assert pool["spec"][field] == worker["spec"][field], field
    pool_container, worker_container = (
        pool["spec"]["containers"][0],
        worker["spec"]["containers"][0],
    )
    for field in set(worker_container) - {"env"}:
        assert pool_container[field] == worker_container[field], field
    assert pool_container["env"][: len(worker_container["env"])] == worker_container["env"]


def test_a_sqlite_queue_volume_is_mounted_read_write():
    pod = build_pool_pod(KEY, "w-1", production_config(queue_pvc="gpuinfer-queue"))
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["lease-queue"]["persistentVolumeClaim"] == {
        "claimName": "gpuinfer-queue",
        "readOnly": False,
    }
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["lease-queue"] == {"name": "lease-queue", "mountPath": QUEUE_MOUNT}


@pytest.mark.parametrize(
    ("pool_key", "worker_id", "kwargs", "message"),
    [
        ("Bad Key!", "w", {}, "not a valid label value"),
        ("x" * 64, "w", {}, "not a valid label value"),
        (KEY, " ", {}, "non-empty worker id"),
        (KEY, "w", {"idle_ttl_s": 0}, "idle_ttl_s"),
        (KEY, "w", {"gpus": 0}, "gpus=0"),
    ],
)
def test_pool_pod_refuses_what_cannot_make_a_valid_pod(pool_key, worker_id, kwargs, message):
    with pytest.raises(PodSpecError, match=message):
        build_pool_pod(pool_key, worker_id, production_config(), **kwargs)


def test_a_queue_url_with_its_password_is_refused_as_plain_env():
    with pytest.raises(PodSpecError, match="URL with credentials"):
        build_pool_pod(
            KEY,
            "w",
            production_config(),
            extra_env={"QUEUE": "postgresql://gpuinfer:hunter2@db:5432/queue"},
        )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.text(min_size=1, max_size=90).filter(str.strip), min_size=2, max_size=6, unique=True
    )
)
def test_distinct_worker_ids_get_distinct_valid_pod_names(worker_ids):
    names = [pool_pod_name(w) for w in worker_ids]
    assert len(set(names)) == len(names)
    for worker_id, name in zip(worker_ids, names, strict=True):
        pod = build_pool_pod(KEY, worker_id, production_config())
        assert pod["metadata"]["name"] == name and len(name) <= 63
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert to_model(pod, "V1Pod").metadata.annotations["gpuinfer.dagster.io/worker-id"] == (
            worker_id
        )


# --------------------------------------------------------------------------- backend


def sleeping_config(seconds: float) -> K8sLauncherConfig:
    """Pool pods whose "worker" sleeps `seconds` then exits 0 (its pool arguments ignored)."""
    config = production_config()
    placement = config.placement.model_copy(update={"gpu_resource_name": None})
    command = ["python3", "-c", f"import time; time.sleep({seconds})"]
    return config.model_copy(
        update={
            "placement": placement,
            "command": command,
            "cache": config.cache.model_copy(update={"pvc": None}),
            "shm_size": "64Mi",
        }
    )


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.skipif(sys.platform != "linux", reason="the pod executor needs Linux namespaces")
def test_backend_starts_counts_reaps_and_stops_pool_pods_by_label(pod_executor: PodExecutor):
    executor = pod_executor
    executor.secrets["gpuinfer-lease-queue"] = {"url": "/var/lib/gpuinfer/queue/pools.db"}
    executor.secrets["gpuinfer-s3"] = {"AWS_ACCESS_KEY_ID": "test"}  # the production envFrom
    settings_ = SimpleNamespace(idle_ttl_s=60, lease_ttl_s=10)
    short = K8sPoolBackend(sleeping_config(1), executor.client)
    long = K8sPoolBackend(sleeping_config(300), executor.client)
    short.start(KEY, "short-1", settings_, {})
    long.start(KEY, "long-1", settings_, {"GPUINFER_LEASE_QUEUE": "/elsewhere.db"})
    long.start("other-pool-0123456789ab", "other-1", settings_, {})
    assert long.live_workers(KEY) == ["long-1", "short-1"]
    pod = executor.pods[pool_pod_name("long-1")]
    argv = pod.manifest["spec"]["containers"][0]["args"]
    assert argv[:4] == ["--pool", KEY, "--worker-id", "long-1"]
    assert all("elsewhere" not in str(e) for e in pod.manifest["spec"]["containers"][0]["env"])
    wait_for(lambda: long.live_workers(KEY) == ["long-1"])
    ended = long.reap(KEY)
    assert [(e.worker_id, e.phase, e.exit_code) for e in ended] == [("short-1", "Succeeded", 0)]
    assert (
        pool_pod_name("short-1") not in executor.pods
        or executor.pods[pool_pod_name("short-1")].deletion_requested_at
    )
    assert long.stop("long-1", KEY) is True
    wait_for(lambda: long.live_workers(KEY) == [])
    assert long.live_workers("other-pool-0123456789ab") == ["other-1"]
    assert long.stop("nobody", KEY) is False
    # a start reaps the pool's pods that ended before it
    short.start(KEY, "short-2", settings_, {})
    wait_for(lambda: short.live_workers(KEY) == [])
    assert pool_pod_name("short-2") in executor.pods
    long.start(KEY, "long-2", settings_, {})
    wait_for(lambda: pool_pod_name("short-2") not in executor.pods)
    assert long.live_workers(KEY) == ["long-2"]


def test_without_a_spec_the_backend_sizes_pods_like_the_pools_other_pods(pod_executor):
    executor = pod_executor
    executor.secrets["gpuinfer-lease-queue"] = {"url": "/q.db"}
    executor.secrets["gpuinfer-s3"] = {"AWS_ACCESS_KEY_ID": "test"}
    config = sleeping_config(300)
    # GPUs requested, so the executor leaves the pods Pending (Unschedulable): no process
    config = config.model_copy(
        update={"placement": config.placement.model_copy(update={"gpu_resource_name": "x/gpu"})}
    )
    settings_ = SimpleNamespace(idle_ttl_s=60, lease_ttl_s=10)
    K8sPoolBackend(config, executor.client, gpus=4).start(KEY, "from-step", settings_, {})
    sensor = K8sPoolBackend(config, executor.client, gpus=None)
    sensor.start(KEY, "from-sensor", settings_, {})
    sensor.start("fresh-0123456789ab", "first", settings_, {})

    def limits(worker_id: str) -> dict:
        pod = executor.pods[pool_pod_name(worker_id)]
        return pod.manifest["spec"]["containers"][0]["resources"]["limits"]

    assert limits("from-step")["x/gpu"] == "4"
    assert limits("from-sensor")["x/gpu"] == "4"
    assert limits("first")["x/gpu"] == "1"
