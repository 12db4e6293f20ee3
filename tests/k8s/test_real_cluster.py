"""The Kubernetes launcher against a real cluster (kind works): skipped without a kubeconfig.

Tests that need no worker image run on any cluster: the API server accepts the built pod,
an unschedulable pod fails with the scheduler's reason, an image that does not exist fails
fast. The end-to-end test launches the CPU worker image (deploy/worker/Dockerfile.cpu) on
one small partition and needs `GPUINFER_TEST_WORKER_IMAGE` and an S3 endpoint both the test
and the pods reach (`GPUINFER_TEST_S3_ENDPOINT`, `GPUINFER_TEST_S3_BUCKET`, credentials in
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.k8s.config import K8sLauncherConfig, SecretRefs, WorkerPlacement
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.spec import InferenceSpec

pytestmark = pytest.mark.k8s_cluster

SMALL_IMAGE = "registry.k8s.io/pause:3.10"
CPU_MODEL = "/opt/models/all-MiniLM-L6-v2"  # baked into deploy/worker/Dockerfile.cpu
PARTITIONS = dg.StaticPartitionsDefinition(["shard-0"])


def launcher_config(kubeconfig: Path, namespace: str, **overrides: Any) -> K8sLauncherConfig:
    values: dict[str, Any] = {
        "image": SMALL_IMAGE,
        "namespace": namespace,
        "kubeconfig_file": str(kubeconfig),
        "placement": WorkerPlacement(gpu_resource_name=None),  # CPU-only test cluster
        "cpu_request": "100m",
        "memory_request": "64Mi",
        "shm_size": "64Mi",
        "scratch_size": "256Mi",
        "poll_interval": 2.0,
        "pod_pending_timeout": 30.0,
    }
    values.update(overrides)
    return K8sLauncherConfig(**values)


def run_asset(
    tmp_path: Path,
    resource: GpuInferenceResource,
    *,
    input_uri: str | None = None,
    output_root: str | None = None,
    engine: dict[str, Any] | None = None,
) -> dg.ExecuteInProcessResult:
    pipeline = inference_assets(
        name="cluster_embeddings",
        model=CPU_MODEL,
        task="embed",
        input=InputSpec(
            uri=input_uri or f"{tmp_path}/in/{{partition_key}}.parquet", id_column="id"
        ),
        output_root=output_root or str(tmp_path / "out"),
        partitions_def=PARTITIONS,
        engine=engine,
    )
    return dg.materialize(
        [pipeline.output_asset],
        partition_key="shard-0",
        resources={"gpu": resource},
        raise_on_error=False,
    )


def error_text(result: dg.ExecuteInProcessResult) -> str:
    texts = []
    for event in result.all_events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            while error is not None:
                texts.append(error.message)
                error = error.cause
    return "\n".join(texts)


def pods_of(core_api: Any, namespace: str, run_id: str) -> list[Any]:
    return core_api.list_namespaced_pod(namespace, label_selector=f"dagster/run-id={run_id}").items


def test_worker_pod_is_accepted_by_the_api_server(core_api, test_namespace, kubeconfig):
    spec = InferenceSpec.model_validate(
        {
            "model": CPU_MODEL,
            "task": "embed",
            "input": {"uri": "s3://b/{partition_key}.parquet"},
            "output": {"root": "s3://b/out", "asset_name": "e"},
            "partition_keys": ["shard-0"],
            "replicas": 2,
        }
    )
    pod = build_worker_pod(
        spec,
        launcher_config(kubeconfig, test_namespace),
        RunIdentity(run_id="dry-run", asset_key="e"),
    )

    created = core_api.create_namespaced_pod(test_namespace, pod, dry_run="All")

    assert created.metadata.labels["gpuinfer.dagster.io/partition"] == "shard-0"
    assert created.spec.containers[0].security_context.run_as_non_root is True


def test_unschedulable_pod_fails_with_the_schedulers_reason_and_is_deleted(
    tmp_path, core_api, test_namespace, kubeconfig
):
    config = launcher_config(kubeconfig, test_namespace, cpu_request="100000")
    result = run_asset(tmp_path, GpuInferenceResource(launcher="k8s", k8s=config))

    assert not result.success
    message = error_text(result)
    assert "Insufficient cpu" in message and "pod_pending_timeout" in message
    assert pods_of(core_api, test_namespace, result.run_id) == []


def test_image_that_does_not_exist_fails_fast_naming_it(
    tmp_path, core_api, test_namespace, kubeconfig
):
    image = "registry.invalid/gpuinfer/no-such-image:0.0.0"
    config = launcher_config(kubeconfig, test_namespace, image=image, pod_pending_timeout=600.0)
    result = run_asset(tmp_path, GpuInferenceResource(launcher="k8s", k8s=config))

    assert not result.success
    assert image in error_text(result)
    assert pods_of(core_api, test_namespace, result.run_id) == []


def test_one_small_partition_materializes_in_a_real_pod(
    tmp_path, core_api, test_namespace, kubeconfig
):
    image = os.environ.get("GPUINFER_TEST_WORKER_IMAGE")
    endpoint = os.environ.get("GPUINFER_TEST_S3_ENDPOINT")
    bucket = os.environ.get("GPUINFER_TEST_S3_BUCKET")
    if not (image and endpoint and bucket and os.environ.get("AWS_ACCESS_KEY_ID")):
        pytest.skip(
            "end-to-end needs GPUINFER_TEST_WORKER_IMAGE (deploy/worker/Dockerfile.cpu), "
            "GPUINFER_TEST_S3_ENDPOINT, GPUINFER_TEST_S3_BUCKET and AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY for an S3 endpoint reachable from the test and the pods"
        )
    import kubernetes
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dagster_gpuinfer.spec import StorageOptions
    from dagster_gpuinfer.storage import filesystem_for

    core_api.create_namespaced_secret(
        test_namespace,
        kubernetes.client.V1Secret(
            metadata=kubernetes.client.V1ObjectMeta(name="test-s3"),
            string_data={k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
        ),
    )
    storage = StorageOptions(endpoint_url=endpoint, allow_http=endpoint.startswith("http://"))
    prefix = f"s3://{bucket}/{test_namespace}"
    fs, path = filesystem_for(f"{prefix}/in/shard-0.parquet", storage)
    texts = [f"sentence number {i} about GPUs" for i in range(20)]
    with fs.open_output_stream(path) as out:
        pq.write_table(pa.table({"id": [str(i) for i in range(20)], "text": texts}), out)

    config = launcher_config(
        kubeconfig,
        test_namespace,
        image=image,
        cpu_request="2",
        memory_request="6Gi",
        memory_limit="8Gi",
        shm_size="1Gi",
        scratch_size="4Gi",
        secrets=SecretRefs(env_from=["test-s3"]),
        pod_pending_timeout=900.0,
    )
    resource = GpuInferenceResource(
        launcher="k8s",
        k8s=config,
        s3_endpoint_url=endpoint,
        s3_allow_http=endpoint.startswith("http://"),
        engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
    )
    result = run_asset(
        tmp_path,
        resource,
        input_uri=f"{prefix}/in/{{partition_key}}.parquet",
        output_root=f"{prefix}/out",
    )

    assert result.success, error_text(result)
    materialization = result.asset_materializations_for_node("cluster_embeddings")[0]
    assert materialization.metadata["rows_out"].value == 20
    assert pods_of(core_api, test_namespace, result.run_id) == []
