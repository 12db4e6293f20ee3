"""The chaos run's cluster: the tests' pod executor (a fake API server whose pods run for
real, tests/pod_executor.py), a loopback S3 server (moto) on the pod network's gateway, and
the fault proxy in front of it, which every pod and the control plane use as their S3.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bench.chaos.s3_proxy import FaultProxy

REPO = Path(__file__).resolve().parents[2]
IMAGE = "registry.example.com/gpuinfer-worker:0.1.0"
NAMESPACE = "gpuinfer"
TOPICS = ("rivers", "compilers", "bread", "glaciers", "chess", "tides", "looms", "comets")


@dataclass
class Setup:
    """What the code location (bench/chaos/defs.py) is pointed at for one backfill."""

    executor: Any
    s3_endpoint: str  # the proxy: what pods and the control plane use
    model: str  # the model's path inside the pod
    model_cache: str  # the host folder mounted as the model cache
    input_root: str
    output_root: str
    partition_keys: list[str]
    per_run: int
    chunk_size: int
    batch: Any = None  # bench/chaos/store_faults.py's BatchSetup: the batch pipelines
    pools: Any = None  # pool_faults.PoolsSetup in --mode pools: the pool and group pipelines


_CURRENT: list[Setup] = []


def current() -> Setup:
    if not _CURRENT:
        raise RuntimeError("no chaos setup: bench.chaos.cluster.use(setup) before loading defs")
    return _CURRENT[-1]


def use(setup: Setup) -> None:
    _CURRENT[:] = [setup]


def k8s_resource(setup: Setup) -> Any:
    """The production k8s resource (resources/k8s.py) minus the GPU request, on the executor."""
    from pod_executor import executor_resource

    from resources.k8s import k8s_launcher_config

    config = k8s_launcher_config(
        {
            "GPUINFER_WORKER_IMAGE": IMAGE,
            "GPUINFER_NAMESPACE": NAMESPACE,
            "GPUINFER_MODEL_CACHE_HOST_PATH": setup.model_cache,
            "GPUINFER_WORKER_CPU": "2",
            "GPUINFER_WORKER_MEMORY": "16Gi",
            "GPUINFER_SHM_SIZE": "1Gi",
            "GPUINFER_POD_PENDING_TIMEOUT": "120",
        }
    )
    placement = config.placement.model_copy(update={"gpu_resource_name": None})
    config = config.model_copy(update={"placement": placement, "poll_interval": 1.0})
    extra: dict[str, Any] = {}
    if setup.pools is not None:
        from bench.chaos.pool_faults import resource_fields

        config, extra = resource_fields(config, setup.pools)
    return executor_resource(
        setup.executor,
        k8s=config,
        s3_endpoint_url=setup.s3_endpoint,
        s3_region="us-east-1",
        s3_allow_http=True,
        engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
        env={"VLLM_LOGGING_LEVEL": "WARNING"},
        **extra,
    )


@dataclass
class Cluster:
    executor: Any
    proxy: FaultProxy
    client: Any  # boto3, straight to moto (the harness's own reads never meet a fault)
    bucket: str
    inputs: dict[str, list[str]] = field(default_factory=dict)  # partition -> input ids
    postgres: Any = None  # bench/chaos/store_faults.py's Postgres, under every phase


@contextlib.contextmanager
def cluster(seed: int, bucket: str = "gpuinfer-chaos") -> Iterator[Cluster]:
    """The executor, moto on its gateway and the proxy (seeded) in front of moto."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)  # the pod executor is the tests' fixture module
    from pod_executor import s3_on_pod_network

    with s3_on_pod_network(bucket) as (executor, endpoint, client):
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        proxy = FaultProxy(executor.gateway, (host, int(port)), seed).start()
        try:
            yield Cluster(executor, proxy, client, bucket)
        finally:
            proxy.stop()


def write_shards(found: Cluster, prefix: str, keys: list[str], rows: int, seed: int) -> None:
    """`rows` documents per shard, ids `<key>-<n>`, texts of seeded lengths."""
    rng = random.Random(seed)
    for key in keys:
        ids = [f"{key}-{n:04d}" for n in range(rows)]
        texts = [
            " ".join(
                f"A note on {rng.choice(TOPICS)}, part {n}, line {i}."
                for i in range(rng.randint(1, 6))
            )
            for n in range(rows)
        ]
        sink = io.BytesIO()
        pq.write_table(pa.table({"doc_id": ids, "text": texts}), sink)
        found.client.put_object(
            Bucket=found.bucket, Key=f"{prefix}/docs/{key}.parquet", Body=sink.getvalue()
        )
        found.inputs[key] = ids
