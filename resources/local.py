"""The local environment: the worker runs as a subprocess with vLLM's CPU build (or a local
GPU if there is one). This is the default for `dagster dev`, the demo and CI."""

from __future__ import annotations

import os

from dagster_gpuinfer import GpuInferenceResource


def local_resources() -> dict[str, GpuInferenceResource]:
    return {
        "gpu": GpuInferenceResource(
            launcher="local",
            engine_overrides={
                # On the CPU backend this is the share of CPU memory (NUMA node 0) for the KV
                # cache: vLLM's 0.9 default does not fit beside everything else on a laptop.
                "gpu_memory_utilization": float(
                    os.environ.get("GPUINFER_LOCAL_KV_FRACTION", "0.2")
                ),
                # Skipping graph compilation starts the CPU engine in about 23 s instead of 33 s
                # (measured here); the small models run as fast either way.
                "enforce_eager": True,
            },
            env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            # Inputs and outputs on S3 or MinIO from a laptop: credentials come from the AWS
            # chain of the environment (never from here).
            s3_endpoint_url=os.environ.get("GPUINFER_S3_ENDPOINT") or None,
            s3_region=os.environ.get("GPUINFER_S3_REGION") or None,
            s3_allow_http=(os.environ.get("GPUINFER_S3_ENDPOINT") or "").startswith("http://"),
        )
    }
