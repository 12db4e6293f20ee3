"""Materialization metadata: per partition (from its manifest) and per run."""

from __future__ import annotations

from typing import Any

import dagster as dg

from dagster_gpuinfer.resource import InferenceRunResult
from dagster_gpuinfer.run_metrics import run_timing_metadata, telemetry_metadata
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest, partition_dir


def partition_metadata(
    spec: InferenceSpec, manifest: Manifest, *, computed: bool
) -> dict[str, Any]:
    """What the UI shows for one partition: counts, speed, tokens, where the output is."""
    seconds = manifest.wall_seconds or 1e-9
    tokens = manifest.prompt_tokens + manifest.generated_tokens
    return {
        "rows_in": manifest.rows_in,
        "rows_out": manifest.rows_out,
        "rows_errored": manifest.rows_errored,
        "rows_resumed": manifest.rows_resumed,
        "rows_invalid_output": manifest.rows_invalid_output,
        "prompt_tokens": manifest.prompt_tokens,
        "generated_tokens": manifest.generated_tokens,
        "rows_per_second": round(manifest.rows_in / seconds, 2),
        "tokens_per_second": round(tokens / seconds, 2),
        "model_load_seconds": round(manifest.model_load_seconds, 3),
        "wall_seconds": round(manifest.wall_seconds, 3),
        "inference_seconds": round(manifest.inference_seconds, 3),
        "computed_in_this_run": computed,
        "spec_hash": manifest.spec_hash,
        "error_types": dg.MetadataValue.json(manifest.error_types),
        "output_path": dg.MetadataValue.path(partition_dir(spec.output, manifest.partition_key)),
        "engine_args": dg.MetadataValue.json(spec.engine.model_dump(mode="json")),
        "sampling_params": dg.MetadataValue.json(spec.sampling.model_dump(mode="json")),
        **telemetry_metadata(manifest.telemetry),
    }


def run_metadata(result: InferenceRunResult) -> dict[str, Any]:
    """What is true of the whole run (shared by all its partitions)."""
    summary = result.summary
    spec = result.spec
    metadata: dict[str, Any] = {
        "run_partitions": len(result.manifests),
        "run_partitions_computed": len(result.computed),
        "run_model_loads": int(summary.get("model_loads", 0)),
        "run_replicas": int(summary.get("replicas", 0)),
        "run_wall_seconds": float(summary.get("wall_seconds", 0.0)),
    }
    metadata.update(run_timing_metadata(result))
    if spec is not None:
        metadata["model"] = spec.model
        metadata["tensor_parallel_size"] = spec.tensor_parallel_size
    return metadata
