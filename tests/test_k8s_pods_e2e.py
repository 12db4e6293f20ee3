"""The k8s launcher end to end: the pod it builds runs the real worker and the real engine.

Nothing between the launcher and the worker is faked except the API server: the reference
code location's `doc_embeddings` (assets/definitions.py) with the production k8s resource
(resources/k8s.py: image, ServiceAccount, Kueue queue, model cache, S3 Secret by `envFrom`)
creates a pod through `PodExecutor` (tests/pod_executor.py), which runs that pod's command
with its env, mounts, UID and network namespace; `PipesK8sClient` reads the worker's Pipes
messages from the pod log; outputs go to an S3 server (moto) that the pods reach on the pod
network's gateway. The only change to the production configuration: no `nvidia.com/gpu`
request (the executor has no GPU; the CPU build of vLLM runs the same worker).

`make test` runs the backfill case (one pod, two partitions, one engine start); the
preemption and OOMKilled cases are `slow` (two engine starts each); the image that cannot
start needs no engine. `make test-cluster` runs them all.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
from pod_executor import PodExecutor, PodPlan, executor_resource, s3_on_pod_network

from dagster_gpuinfer import EngineArgs, InputSpec, Manifest, inference_assets
from dagster_gpuinfer.k8s.config import WORKER_CONTAINER
from resources.k8s import k8s_launcher_config

REPO = Path(__file__).resolve().parent.parent
IMAGE = "registry.example.com/gpuinfer-worker:0.1.0"
NAMESPACE = "gpuinfer"
RANGE = ("dagster/asset_partition_range_start", "dagster/asset_partition_range_end")


@dataclass
class Cluster:
    executor: PodExecutor
    endpoint: str
    client: Any
    bucket: str
    pipelines: Any  # the reference code location, pointed at the cluster
    model_cache: str
    failing_pipelines: Any  # the same, writing where no passing case committed

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return [item["Key"] for page in pages for item in page.get("Contents", ())]

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def resource(
        self, image: str = IMAGE, model_cache: str | None = None, command: list[str] | None = None
    ) -> Any:
        """The production k8s resource (resources/k8s.py), minus the GPU request."""
        config = k8s_launcher_config(
            {
                "GPUINFER_WORKER_IMAGE": image,
                "GPUINFER_NAMESPACE": NAMESPACE,
                "GPUINFER_MODEL_CACHE_HOST_PATH": model_cache or self.model_cache,
                "GPUINFER_WORKER_CPU": "2",
                "GPUINFER_WORKER_MEMORY": "16Gi",
                "GPUINFER_SHM_SIZE": "1Gi",
                "GPUINFER_POD_PENDING_TIMEOUT": "120",
            }
        )
        placement = config.placement.model_copy(update={"gpu_resource_name": None})
        config = config.model_copy(update={"placement": placement, "poll_interval": 1.0})
        if command is not None:
            config = config.model_copy(update={"command": command})
        return executor_resource(
            self.executor,
            k8s=config,
            s3_endpoint_url=self.endpoint,
            s3_region="us-east-1",
            s3_allow_http=True,
            engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
            env={"VLLM_LOGGING_LEVEL": "WARNING"},
        )


def load_reference_pipelines(env: dict[str, str]) -> Any:
    """assets/definitions.py as a fresh module built with `env` (the module the tests
    import elsewhere is left as it is)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        spec = importlib.util.spec_from_file_location(
            "gpuinfer_reference_on_cluster", REPO / "assets" / "definitions.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def cluster(minilm_dir) -> Iterator[Cluster]:
    from assets.paths import input_root

    bucket = "gpuinfer-cluster"
    with s3_on_pod_network(bucket) as (executor, endpoint, client):
        docs = Path(input_root()) / "docs"
        for shard in sorted(docs.glob("docs-*.parquet")):
            client.upload_file(str(shard), bucket, f"inputs/docs/{shard.name}")
        cache = str(Path(minilm_dir).parent)
        env = {
            "GPUINFER_EMBED_MODEL": f"/models/{Path(minilm_dir).name}",
            "GPUINFER_INPUT_ROOT": f"s3://{bucket}/inputs",
            "GPUINFER_OUTPUT_ROOT": f"s3://{bucket}/outputs",
        }
        pipelines = load_reference_pipelines(env)
        # Failures that must reach a pod: outputs no other case commits to.
        failing = load_reference_pipelines(
            {**env, "GPUINFER_OUTPUT_ROOT": f"s3://{bucket}/failing-outputs"}
        )
        yield Cluster(executor, endpoint, client, bucket, pipelines, cache, failing)


def run(
    cluster: Cluster, keys: list[str], *, failing: bool = False, **kwargs: Any
) -> dg.ExecuteInProcessResult:
    pipelines = cluster.failing_pipelines if failing else cluster.pipelines
    pipeline = pipelines.doc_embeddings
    return dg.materialize(
        pipeline.assets,
        selection=[pipeline.output_asset.key],
        instance=dg.DagsterInstance.ephemeral(),
        resources={"gpu": kwargs.pop("resource", None) or cluster.resource()},
        tags={RANGE[0]: keys[0], RANGE[1]: keys[-1]},
        raise_on_error=False,
        **kwargs,
    )


def input_ids(cluster: Cluster, key: str) -> list[str]:
    table = pq.read_table(io.BytesIO(cluster.read(f"inputs/docs/{key}.parquet")))
    return table.column("doc_id").to_pylist()


def committed(cluster: Cluster, key: str) -> tuple[Manifest, list[str], np.ndarray]:
    """The partition's manifest, output ids (every part file) and embeddings, from S3."""
    prefix = f"outputs/doc_embeddings/{key}/"
    manifest = Manifest.model_validate_json(cluster.read(prefix + "_SUCCESS"))
    ids: list[str] = []
    vectors = []
    for part in manifest.parts:
        table = pq.read_table(io.BytesIO(cluster.read(prefix + part.name)))
        ids += table.column("id").to_pylist()
        vectors += table.column("embedding").to_pylist()
    return manifest, ids, np.array(vectors, dtype=np.float32)


def step_failures(result: dg.ExecuteInProcessResult) -> list[Any]:
    return [
        event
        for event in result.all_events
        if event.is_step_failure or event.event_type_value == "STEP_UP_FOR_RETRY"
    ]


def worker_messages(result: dg.ExecuteInProcessResult) -> list[str]:
    return [
        event.message or ""
        for event in result.all_events
        if event.event_type_value in ("ENGINE_EVENT", "STEP_WORKER_STARTED", "LOGS_CAPTURED")
        or (event.message or "").startswith("worker pod")
    ]


# --------------------------------------------------------------------------- backfill


@pytest.fixture(scope="module")
def backfill(cluster) -> dict[str, Any]:
    keys = ["docs-000", "docs-001"]
    started = len(cluster.executor.created)
    begun = time.monotonic()
    result = run(cluster, keys)
    pods = cluster.executor.created[started:]
    return {"result": result, "keys": keys, "pods": pods, "seconds": time.monotonic() - begun}


@pytest.mark.engine
def test_backfill_commits_every_partition_through_the_built_pod(cluster, backfill):
    result, keys, pods = backfill["result"], backfill["keys"], backfill["pods"]
    assert result.success, "\n".join(p.text()[-3000:] for p in pods)
    [pod] = pods  # one pod, one engine start, for the whole multi-partition run
    for key in keys:
        manifest, ids, vectors = committed(cluster, key)
        assert (manifest.rows_in, manifest.rows_out, manifest.rows_errored) == (500, 500, 0)
        assert sorted(ids) == sorted(input_ids(cluster, key))  # every row exactly once
        assert vectors.shape == (500, 384)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    # Materializations came from the worker's Pipes messages, read from the pod log.
    materialized = {
        event.partition: event.step_materialization_data.materialization.metadata
        for event in result.get_asset_materialization_events()
    }
    assert sorted(materialized) == keys
    assert all(meta["rows_out"].value == 500 for meta in materialized.values())


@pytest.mark.engine
def test_the_worker_ran_as_the_pod_says(cluster, backfill):
    [pod] = backfill["pods"]
    container = pod.container
    assert container["name"] == WORKER_CONTAINER and container["image"] == IMAGE
    assert container["command"] == ["python3", "-m", "dagster_gpuinfer.worker"]
    seen = pod.seen
    assert seen["argv"][-2:] == ["-m", "dagster_gpuinfer.worker"]
    assert seen["uid"][0] == seen["gid"][0] == "1000"  # runAsUser / runAsGroup
    assert seen["nonewprivs"] == ["1"] and seen["capeff"] == ["0000000000000000"]
    assert seen["netns"] != os.readlink("/proc/self/ns/net")  # its own network namespace
    assert seen["mntns"] != os.readlink("/proc/self/ns/mnt")
    env = {item["name"] for item in container["env"]}
    assert "DAGSTER_PIPES_CONTEXT" in env and "DAGSTER_PIPES_MESSAGES" in env
    assert container["envFrom"] == [{"secretRef": {"name": "gpuinfer-s3", "optional": False}}]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]} == {
        "/dev/shm": False,
        "/tmp": False,
        "/models": True,
    }
    assert pod.exit_code == 0 and pod.terminated_reason == "Completed"
    assert pod.name in cluster.executor.deleted  # the launcher deleted its pod


# --------------------------------------------------------------------------- faults


@pytest.mark.engine
@pytest.mark.slow
def test_preempted_pod_mid_shard_retries_and_commits_every_row_once(cluster):
    """SIGTERM after the first chunk commit, the grace period, SIGKILL; Dagster retries the
    step; the new pod resumes from the committed chunks. Holds whether or not the worker
    drains on SIGTERM."""
    key = "docs-002"
    started = len(cluster.executor.created)
    preempted: list[str] = []

    def preempt_after_first_chunk() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not preempted:
            if any("/_chunks/" in k for k in cluster.keys(f"outputs/doc_embeddings/{key}/")):
                pod = cluster.executor.created[started]
                cluster.executor.preempt(pod.name)
                preempted.append(pod.name)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=preempt_after_first_chunk, daemon=True)
    watcher.start()
    result = run(
        cluster, [key], run_config={"ops": {"doc_embeddings": {"config": {"chunk_size": 16}}}}
    )
    watcher.join(timeout=5)
    pods = cluster.executor.created[started:]
    assert preempted, "the first pod finished before any chunk was seen committed"
    assert result.success, "\n".join(p.text()[-3000:] for p in pods)
    assert len(pods) == 2 and pods[0].disruption == "PreemptionByScheduler"
    assert pods[0].terminated and pods[0].name not in cluster.executor.pods
    [retry] = step_failures(result)
    assert "retryable" in (retry.message or "") or retry.event_type_value == "STEP_UP_FOR_RETRY"
    manifest, ids, _ = committed(cluster, key)
    assert sorted(ids) == sorted(input_ids(cluster, key)) and len(ids) == len(set(ids)) == 500
    meta = {
        e.partition: e.step_materialization_data.materialization.metadata
        for e in result.get_asset_materialization_events()
    }[key]
    assert meta["rows_resumed"].value > 0  # the retry did not recompute committed chunks
    assert manifest.rows_out == 500


@pytest.mark.engine
@pytest.mark.slow
def test_oomkilled_pod_is_relaunched_with_smaller_batches_and_commits_once(cluster):
    key = "docs-003"
    started = len(cluster.executor.created)
    cluster.executor.plans.append(PodPlan(oom_on_log="engine ready in"))
    result = run(cluster, [key])
    pods = cluster.executor.created[started:]
    assert result.success, "\n".join(p.text()[-3000:] for p in pods)
    assert [p.terminated_reason for p in pods] == ["OOMKilled", "Completed"]
    assert pods[0].exit_code == 137
    first, second = (pod_spec(p) for p in pods)
    assert second.engine.max_num_seqs < (first.engine.max_num_seqs or 256)  # vLLM's default
    assert second.engine.gpu_memory_utilization < first.engine.gpu_memory_utilization
    assert second.spec_hash() == first.spec_hash()  # committed chunks stay valid
    _, ids, _ = committed(cluster, key)
    assert sorted(ids) == sorted(input_ids(cluster, key))


def pod_spec(pod: Any) -> Any:
    from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, decode_env_var

    from dagster_gpuinfer.spec import InferenceSpec

    env = {e["name"]: e.get("value", "") for e in pod.container["env"]}
    context = decode_env_var(env[DAGSTER_PIPES_CONTEXT_ENV_VAR])["data"]
    return InferenceSpec.model_validate(context["extras"]["spec"])


def test_an_image_that_cannot_be_pulled_fails_the_step_without_retry(cluster):
    broken = "registry.example.com/gpuinfer-worker:does-not-exist"
    cluster.executor.broken_images.add(broken)
    started = len(cluster.executor.created)
    result = run(cluster, ["docs-000"], resource=cluster.resource(image=broken), failing=True)
    assert not result.success
    pods = cluster.executor.created[started:]
    assert len(pods) == 1 and pods[0].process is None  # never started, never retried
    [failure] = step_failures(result)
    message = failure.step_failure_data.error.message
    assert "cannot pull image" in message and broken in message
    assert pods[0].name in cluster.executor.deleted


def test_an_image_without_the_workers_python_fails_at_start_without_retry(cluster):
    """The image runs, but has no `python3.99`: containerd's StartError (exit 128), which
    no retry can fix."""
    started = len(cluster.executor.created)
    command = ["python3.99", "-m", "dagster_gpuinfer.worker"]
    result = run(cluster, ["docs-000"], resource=cluster.resource(command=command), failing=True)
    assert not result.success
    pods = cluster.executor.created[started:]
    assert len(pods) == 1 and pods[0].terminated_reason == "StartError"
    [failure] = step_failures(result)
    message = failure.step_failure_data.error.message
    assert "could not start its container (StartError, exit code 128" in message
    assert '"python3.99": executable file not found' in message and "k8s.command" in message


HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def hub_cache_with(model_dir: str, root: Path, revision: str = "0" * 40) -> Path:
    """A Hugging Face hub cache (`hub/models--org--name/snapshots/REV`, refs/main) holding
    `model_dir`'s files, as the cache warmer (deploy/model-cache/) leaves it."""
    repo = root / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    for path in Path(model_dir).rglob("*"):
        if path.is_file():
            target = snapshot / path.relative_to(model_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    root.chmod(0o755)
    return root


@pytest.mark.engine
@pytest.mark.slow
def test_a_hub_model_id_loads_offline_from_the_read_only_cache(cluster, minilm_dir, tmp_path):
    """A spec naming a hub id (not a path) reads the weights from the model cache the pod
    mounts read-only, offline, with the hub's cache layout."""
    cache = hub_cache_with(minilm_dir, tmp_path / "cache")
    pipeline = inference_assets(
        name="hub_embeddings",
        model=HUB_ID,
        task="embed",
        input=InputSpec(
            uri=f"s3://{cluster.bucket}/inputs/docs/{{partition_key}}.parquet", id_column="doc_id"
        ),
        output_root=f"s3://{cluster.bucket}/outputs",
        partitions_def=dg.StaticPartitionsDefinition(["docs-000"]),
        engine=EngineArgs(dtype="float32"),
    )
    resource = cluster.resource(model_cache=str(cache))
    started = len(cluster.executor.created)
    result = dg.materialize(
        pipeline.assets,
        selection=[pipeline.output_asset.key],
        instance=dg.DagsterInstance.ephemeral(),
        resources={"gpu": resource},
        partition_key="docs-000",
        raise_on_error=False,
    )
    pods = cluster.executor.created[started:]
    assert result.success, "\n".join(p.text()[-4000:] for p in pods)
    prefix = "outputs/hub_embeddings/docs-000/"
    manifest = Manifest.model_validate_json(cluster.read(prefix + "_SUCCESS"))
    assert manifest.rows_out == 500 and manifest.model == HUB_ID
