"""Materialization metadata: per partition (from its manifest) and per run."""

from __future__ import annotations

from typing import Any

import dagster as dg

from dagster_gpuinfer.resource import InferenceRunResult
from dagster_gpuinfer.run_metrics import NOT_AVAILABLE, run_timing_metadata, telemetry_metadata
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest, RowCounts, partition_dir
from dagster_gpuinfer.task_table import task_facts

# What the partition figures mean, said once: the output asset's description carries it
# (`inference_assets`), so the partitions' own entries stay numbers.
PARTITION_FIGURES = """\
**Partition figures.** Each partition lists its own figures first, then the run's (`run_*`).

- `rows_per_second`, `tokens_per_second`: the rows and tokens this attempt computed over
  `engine_seconds`, the partition's share of its engine's time (generation: each engine step
  shared by the requests it runs; pooling: each step's time to the rows it finished; summed
  over replicas). The last partitions of a run carry the engine's drain and can read lower
  than equal partitions before them; `run_rows_per_second` is the run's own rate. `n/a` when
  nothing was computed (every chunk resumed).
- `active_seconds`: first row submitted to last row done (partitions streamed together
  overlap). `inference_seconds`: the union of the chunks' inference intervals, within
  `wall_seconds` (reading began to commit).
- `rows_reused`, `rows_computed`, `rows_deduplicated`: output rows copied from the
  partition's earlier output (same reuse key: model, settings, request, images' bytes,
  parameters and seed; with `row_reuse_scope="pipeline"` from any committed partition of
  the pipeline), computed by the engine, and copied from an identical request computed
  once in this run (`row_reuse`; unseeded sampling is computed unless the pipeline asks).
- `input_version`, `model_files_version`: the shard and local model files the outputs were
  computed from; when either changes, the next materialization computes the partition again.
  `engine_versions`: the vLLM and torch versions that computed them (a spec's
  `vllm_version` pins the first). `lora_adapters` (pipelines with adapters): each adapter's
  path and its files' version; a changed adapter recomputes the partition too.
- `pool_warm_engine`, `pool_queue_wait_s`, `pool_leases` (runs with `launch="pool"`):
  whether the partition's lease found its pool worker's engine already built, the seconds
  from the job's submission to the partition's first lease, and how many leases it took
  (above 1: a lease lapsed or failed and the partition was leased again).
- `sampling_params` (generation tasks only): the pipeline's sampling defaults, unset ones
  left out; a row's own parameters override them.
"""


def rows_computed(counts: RowCounts) -> int:
    """Rows the engine computed: the rows out less those copied (reused or deduplicated)
    and those quarantined."""
    return counts.rows_out - counts.rows_reused - counts.rows_deduplicated


def rows_engine_took(counts: RowCounts) -> int:
    """Rows read for the engine (computed or quarantined), less those copied."""
    return counts.rows_in - counts.rows_reused - counts.rows_deduplicated


def partition_rates(manifest: Manifest) -> dict[str, Any]:
    """rows/s and tokens/s over the partition's share of engine time; `n/a` without one
    (every chunk resumed or quarantined, or a manifest of an older worker)."""
    seconds = manifest.engine_seconds
    if seconds <= 0:
        return {"rows_per_second": NOT_AVAILABLE, "tokens_per_second": NOT_AVAILABLE}
    return {
        "rows_per_second": round(rows_engine_took(manifest.computed) / seconds, 2),
        "tokens_per_second": round(manifest.computed.tokens / seconds, 2),
    }


def image_metadata(manifest: Manifest) -> dict[str, Any]:
    """Image tasks: the partition's images and encoded image bytes/s (over its inference
    time, which includes decoding in the read-ahead); nothing for text-only partitions."""
    if not manifest.images:
        return {}
    seconds = manifest.inference_seconds
    return {
        "images": manifest.images,
        "image_bytes": manifest.image_bytes,
        "image_bytes_per_second": round(manifest.image_bytes / seconds, 1)
        if seconds > 0
        else NOT_AVAILABLE,
    }


def partition_metadata(
    spec: InferenceSpec, manifest: Manifest, *, computed: bool
) -> dict[str, Any]:
    """What the UI shows for one partition: counts, speed, tokens, where the output is."""
    return {
        "rows_in": manifest.rows_in,
        "rows_out": manifest.rows_out,
        "rows_errored": manifest.rows_errored,
        "rows_resumed": manifest.rows_resumed,
        "rows_reused": manifest.rows_reused,
        "rows_computed": rows_computed(manifest),
        "rows_deduplicated": manifest.rows_deduplicated,
        "rows_invalid_output": manifest.rows_invalid_output,
        "prompt_tokens": manifest.prompt_tokens,
        "generated_tokens": manifest.generated_tokens,
        **partition_rates(manifest),
        **image_metadata(manifest),
        "engine_seconds": round(manifest.engine_seconds, 3),
        "active_seconds": round(manifest.active_seconds, 3),
        "inference_seconds": round(manifest.inference_seconds, 3),
        "wall_seconds": round(manifest.wall_seconds, 3),
        "model_load_seconds": round(manifest.model_load_seconds, 3),
        "computed_in_this_run": computed,
        "spec_hash": manifest.spec_hash,
        # The shard's version (S3 ETag, or size and mtime) and a local model folder's (its
        # files' sizes and mtimes): PARTITION_FIGURES says what they mean to a user.
        "input_version": manifest.source.input if manifest.source else NOT_AVAILABLE,
        "model_files_version": (manifest.source.model if manifest.source else None)
        or NOT_AVAILABLE,
        "engine_versions": engine_versions(manifest),
        **adapter_metadata(spec, manifest),
        "error_types": dg.MetadataValue.json(manifest.error_types),
        "output_path": dg.MetadataValue.path(partition_dir(spec.output, manifest.partition_key)),
        "engine_args": dg.MetadataValue.json(spec.engine.model_dump(mode="json")),
        **sampling_metadata(spec),
        **telemetry_metadata(manifest.telemetry),
    }


def adapter_metadata(spec: InferenceSpec, manifest: Manifest) -> dict[str, Any]:
    """`lora_adapters` (pipelines that list adapters): each adapter's path and the version
    of its files the partition was computed from; nothing for a pipeline without."""
    if not spec.lora_adapters:
        return {}
    recorded = (manifest.source.adapters if manifest.source else None) or ""
    versions = dict(entry.split("=", 1) for entry in recorded.split(";") if "=" in entry)
    return {
        "lora_adapters": dg.MetadataValue.json(
            {
                name: {"path": path, "version": versions.get(name, NOT_AVAILABLE)}
                for name, path in sorted(spec.lora_adapters.items())
            }
        )
    }


def pool_metadata(result: InferenceRunResult, partition_key: str) -> dict[str, Any]:
    """How a partition ran on an engine pool (`launch="pool"`); nothing for a partition
    this run did not send to a pool (per-run launch, or already committed)."""
    facts = result.pool.get(partition_key)
    if facts is None:
        return {}
    wait = facts.get("queue_wait_s")
    return {
        "pool_warm_engine": bool(facts["warm"]),
        "pool_queue_wait_s": round(wait, 3) if wait is not None else NOT_AVAILABLE,
        "pool_leases": int(facts["leases"]),
        "pool_worker": facts.get("worker_id") or NOT_AVAILABLE,
    }


def engine_versions(manifest: Manifest) -> str:
    """The vLLM and torch versions the partition was committed with (`n/a` for a manifest
    of an older worker, which did not record them)."""
    worker = manifest.worker
    found = [f"{name} {worker[name]}" for name in ("vllm", "torch") if worker.get(name)]
    return ", ".join(found) or NOT_AVAILABLE


def sampling_metadata(spec: InferenceSpec) -> dict[str, Any]:
    """`sampling_params` for tasks that sample (the task table says which), holding only the
    parameters that are set; nothing for pooling tasks, which take none."""
    if not task_facts(spec.task).samples:
        return {}
    params = spec.sampling.model_dump(mode="json", exclude_none=True)
    return {
        "sampling_params": dg.MetadataValue.json(
            {name: value for name, value in params.items() if value not in ([], {})}
        )
    }


def run_metadata(result: InferenceRunResult) -> dict[str, Any]:
    """What is true of the whole run (shared by all its partitions): shown after each
    partition's own figures (`run_*` rows below them in the UI)."""
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
    metadata["run_rows_per_second"] = _run_rate(result, metadata["run_inference_seconds"])
    if spec is not None:
        metadata["model"] = spec.model
        metadata["tensor_parallel_size"] = spec.tensor_parallel_size
    return metadata


def _run_rate(result: InferenceRunResult, inference_seconds: Any) -> Any:
    """The rows the run computed over its inference span (first engine ready to last
    commit): the run's own rate, drain included, which no partition's share misstates."""
    rows = sum(
        result.manifests[k].computed.rows_in for k in result.computed if k in result.manifests
    )
    if not isinstance(inference_seconds, (int, float)) or inference_seconds <= 0:
        return NOT_AVAILABLE
    return round(rows / inference_seconds, 2)
