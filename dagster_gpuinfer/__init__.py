"""dagster-gpuinfer: batch inference with vLLM as partitioned Dagster assets.

The control plane (this package minus `worker/`) never imports torch or vllm. Names are
loaded on first use, so `python -m dagster_gpuinfer.worker` in a pod does not import
Dagster's control plane either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "inference_assets": "dagster_gpuinfer.asset_factory",
    "InferencePipeline": "dagster_gpuinfer.asset_factory",
    "InferenceRunConfig": "dagster_gpuinfer.asset_factory",
    "default_backfill_policy": "dagster_gpuinfer.asset_factory",
    "recompute_stale": "dagster_gpuinfer.asset_factory",
    "GpuInferenceResource": "dagster_gpuinfer.resource",
    "InvalidInferenceSpec": "dagster_gpuinfer.resource",
    "PoolSettings": "dagster_gpuinfer.resource",
    "pool_reconciler_sensor": "dagster_gpuinfer.launchers.pool",
    "InferenceSpec": "dagster_gpuinfer.spec",
    "InputSpec": "dagster_gpuinfer.spec",
    "ImageOptions": "dagster_gpuinfer.image_options",
    "OutputSpec": "dagster_gpuinfer.spec",
    "EngineArgs": "dagster_gpuinfer.spec",
    "SamplingParams": "dagster_gpuinfer.spec",
    "StorageOptions": "dagster_gpuinfer.spec",
    "K8sLauncherConfig": "dagster_gpuinfer.k8s.config",
    "SecretEnvRef": "dagster_gpuinfer.k8s.config",
    "Toleration": "dagster_gpuinfer.k8s.config",
    "WorkerPlacement": "dagster_gpuinfer.k8s.config",
    "ModelCache": "dagster_gpuinfer.k8s.config",
    "PodSecurity": "dagster_gpuinfer.k8s.config",
    "SecretRefs": "dagster_gpuinfer.k8s.config",
    "build_worker_pod": "dagster_gpuinfer.k8s.pod",
    "arrival_sensor": "dagster_gpuinfer.sensors",
    "backfill_estimate_sensor": "dagster_gpuinfer.estimate",
    "estimate_backfill": "dagster_gpuinfer.estimate",
    "SplitLargeFiles": "dagster_gpuinfer.arrivals",
    "InferencePipelineComponent": "dagster_gpuinfer.components.inference_pipeline",
    "gpu_settings_from_s3_resource": "dagster_gpuinfer.aws",
    "Manifest": "dagster_gpuinfer.storage",
    "read_partition": "dagster_gpuinfer.storage",
    "read_errors": "dagster_gpuinfer.storage",
    "partition_error_files": "dagster_gpuinfer.storage",
    "RowLimits": "dagster_gpuinfer.spec",
    "PgVectorSink": "dagster_gpuinfer.sinks",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dagster_gpuinfer.arrivals import SplitLargeFiles as SplitLargeFiles
    from dagster_gpuinfer.asset_factory import InferencePipeline as InferencePipeline
    from dagster_gpuinfer.asset_factory import InferenceRunConfig as InferenceRunConfig
    from dagster_gpuinfer.asset_factory import default_backfill_policy as default_backfill_policy
    from dagster_gpuinfer.asset_factory import inference_assets as inference_assets
    from dagster_gpuinfer.asset_factory import recompute_stale as recompute_stale
    from dagster_gpuinfer.aws import gpu_settings_from_s3_resource as gpu_settings_from_s3_resource
    from dagster_gpuinfer.components.inference_pipeline import (
        InferencePipelineComponent as InferencePipelineComponent,
    )
    from dagster_gpuinfer.estimate import backfill_estimate_sensor as backfill_estimate_sensor
    from dagster_gpuinfer.estimate import estimate_backfill as estimate_backfill
    from dagster_gpuinfer.image_options import ImageOptions as ImageOptions
    from dagster_gpuinfer.k8s.config import K8sLauncherConfig as K8sLauncherConfig
    from dagster_gpuinfer.k8s.config import ModelCache as ModelCache
    from dagster_gpuinfer.k8s.config import PodSecurity as PodSecurity
    from dagster_gpuinfer.k8s.config import SecretEnvRef as SecretEnvRef
    from dagster_gpuinfer.k8s.config import SecretRefs as SecretRefs
    from dagster_gpuinfer.k8s.config import Toleration as Toleration
    from dagster_gpuinfer.k8s.config import WorkerPlacement as WorkerPlacement
    from dagster_gpuinfer.k8s.pod import build_worker_pod as build_worker_pod
    from dagster_gpuinfer.launchers.pool import pool_reconciler_sensor as pool_reconciler_sensor
    from dagster_gpuinfer.resource import GpuInferenceResource as GpuInferenceResource
    from dagster_gpuinfer.resource import InvalidInferenceSpec as InvalidInferenceSpec
    from dagster_gpuinfer.resource import PoolSettings as PoolSettings
    from dagster_gpuinfer.sensors import arrival_sensor as arrival_sensor
    from dagster_gpuinfer.sinks import PgVectorSink as PgVectorSink
    from dagster_gpuinfer.spec import EngineArgs as EngineArgs
    from dagster_gpuinfer.spec import InferenceSpec as InferenceSpec
    from dagster_gpuinfer.spec import InputSpec as InputSpec
    from dagster_gpuinfer.spec import OutputSpec as OutputSpec
    from dagster_gpuinfer.spec import RowLimits as RowLimits
    from dagster_gpuinfer.spec import SamplingParams as SamplingParams
    from dagster_gpuinfer.spec import StorageOptions as StorageOptions
    from dagster_gpuinfer.storage import Manifest as Manifest
    from dagster_gpuinfer.storage import partition_error_files as partition_error_files
    from dagster_gpuinfer.storage import read_errors as read_errors
    from dagster_gpuinfer.storage import read_partition as read_partition


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dagster_gpuinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
