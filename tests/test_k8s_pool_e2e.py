"""Engine pools on Kubernetes end to end: the pool pod the builder makes runs the real pool
worker and the real engine.

Nothing between the step and the worker is faked except the API server: a `launch="pool"`
pipeline's step (the production k8s resource of resources/k8s.py, minus the GPU request)
submits its job to a SQLite lease queue, its reconciler starts a worker through
`K8sPoolBackend`, whose pod (`build_pool_pod`) the pod executor (tests/pod_executor.py) runs
with its command, env, mounts, UID and network namespace. The worker reads the queue's
location from the Secret `gpuinfer-lease-queue` (as on a cluster), finds the queue on its
read-write volume (`k8s.pools.queue_pvc`, a host folder here: SQLite needs one host), leases
the partition, embeds it with vLLM, commits it to an S3 server (moto) on the pod network's
gateway, and exits 0 after its idle TTL, leaving the pod Succeeded for `reap`.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pod_executor import executor_resource, s3_on_pod_network
from support import materialize_partitions, partition_metadata

from dagster_gpuinfer import InputSpec, Manifest, inference_assets
from dagster_gpuinfer.k8s.config import QUEUE_MOUNT, PoolPods
from dagster_gpuinfer.k8s.pool_backend import K8sPoolBackend
from dagster_gpuinfer.k8s.pool_pod import POOL_LABEL
from dagster_gpuinfer.pools import open_lease_queue
from dagster_gpuinfer.resource import PoolSettings
from resources.k8s import k8s_launcher_config

pytestmark = pytest.mark.engine

BUCKET = "gpuinfer-pools"
NAMESPACE = "gpuinfer"
ROWS = 20
IDLE_TTL_S = 5.0
POD_UID = 1000  # the production pods' runAsUser (k8s.security)


def queue_folder(tmp_path: Path) -> Path:
    """The PVC's folder, writable by the pod's user; the step (root) opens the same file.
    SQLite running as root gives its -wal/-shm files the database file's owner."""
    folder = tmp_path / "queue-pvc"
    folder.mkdir()
    os.chown(folder, POD_UID, POD_UID)
    with open_lease_queue(str(folder / "pools.db")):
        pass  # the tables, made once
    for path in folder.iterdir():
        os.chown(path, POD_UID, POD_UID)
    return folder


def test_a_pool_pod_serves_a_partition_on_a_warm_engine_and_leaves_when_idle(
    tmp_path, instance, minilm_dir
):
    folder = queue_folder(tmp_path)
    with s3_on_pod_network(BUCKET) as (executor, endpoint, client):
        executor.secrets["gpuinfer-lease-queue"] = {"url": f"{QUEUE_MOUNT}/pools.db"}
        executor.claims["gpuinfer-lease-queue"] = str(folder)
        table = pa.table(
            {"id": [f"d{i}" for i in range(ROWS)], "text": [f"doc {i}" for i in range(ROWS)]}
        )
        sink = io.BytesIO()
        pq.write_table(table, sink)
        client.put_object(Bucket=BUCKET, Key="in/s0.parquet", Body=sink.getvalue())
        pipeline = inference_assets(
            name="pooled_emb",
            model=f"/models/{Path(minilm_dir).name}",
            task="embed",
            input=InputSpec(uri=f"s3://{BUCKET}/in/{{partition_key}}.parquet"),
            output_root=f"s3://{BUCKET}/out",
            partitions_def=dg.StaticPartitionsDefinition(["s0"]),
            launch="pool",
            chunk_size=8,
        )
        config = k8s_launcher_config(
            {
                "GPUINFER_WORKER_IMAGE": "registry.example.com/gpuinfer-worker:0.1.0",
                "GPUINFER_NAMESPACE": NAMESPACE,
                "GPUINFER_MODEL_CACHE_HOST_PATH": str(Path(minilm_dir).parent),
                "GPUINFER_SHM_SIZE": "1Gi",
            }
        )
        placement = config.placement.model_copy(update={"gpu_resource_name": None})
        config = config.model_copy(
            update={"placement": placement, "pools": PoolPods(queue_pvc="gpuinfer-lease-queue")}
        )
        resource = executor_resource(
            executor,
            k8s=config,
            s3_endpoint_url=endpoint,
            s3_region="us-east-1",
            s3_allow_http=True,
            engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
            env={"VLLM_LOGGING_LEVEL": "WARNING"},
            pool=PoolSettings(
                queue=str(folder / "pools.db"),
                max_workers=1,
                idle_ttl_s=IDLE_TTL_S,
                lease_ttl_s=30,
            ),
        )
        result = materialize_partitions(pipeline, ["s0"], resource=resource, instance=instance)
        assert result.success
        [pod] = executor.created
        manifest = pod.manifest
        assert manifest["metadata"]["labels"][POOL_LABEL]
        assert manifest["spec"]["restartPolicy"] == "Never"
        assert pod.seen.get("uid", [None])[0] == str(POD_UID)
        # committed on S3, from the pod
        committed = Manifest.model_validate_json(
            client.get_object(Bucket=BUCKET, Key="out/pooled_emb/s0/_SUCCESS")["Body"].read()
        )
        assert committed.rows_out == ROWS and committed.rows_errored == 0
        metadata = partition_metadata(instance, pipeline.output_asset.key, "s0")
        assert metadata["pool_warm_engine"] is False and metadata["pool_leases"] == 1
        args = manifest["spec"]["containers"][0]["args"]
        assert metadata["pool_worker"] == args[args.index("--worker-id") + 1]
        [queue_env] = [
            e
            for e in manifest["spec"]["containers"][0]["env"]
            if e["name"] == "GPUINFER_LEASE_QUEUE"
        ]
        assert "value" not in queue_env  # from the Secret, never in the manifest
        # the worker leaves after its idle TTL: exit 0, the pod Succeeded, reaped
        pool = manifest["metadata"]["labels"][POOL_LABEL]
        backend = K8sPoolBackend(config, executor.client)
        deadline = time.monotonic() + 120
        while backend.live_workers(pool) and time.monotonic() < deadline:
            time.sleep(1)
        assert backend.live_workers(pool) == []
        ended = backend.reap(pool)
        assert [(e.phase, e.exit_code) for e in ended] == [("Succeeded", 0)], executor.logs(
            manifest["metadata"]["name"]
        )[-3000:]
        with open_lease_queue(str(folder / "pools.db")) as queue:
            assert queue.pool_workers(pool) == []
            assert queue.pool_stats(pool).backlog == 0
