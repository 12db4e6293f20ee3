"""Which engine pool a spec runs on: the key of everything that fixes an engine.

Two specs share a pool exactly when one built engine can serve both: the same model files,
the same runner, the same `vllm.LLM` arguments, the same tensor/pipeline/node shape, the
same vLLM pin, image and GPU type. What a pipeline may change per run without rebuilding the
engine stays out of the key: sampling parameters, per-row parameters and limits, input and
output locations, partitions, `chunk_size`, `replicas` (a pool sizes itself) and the engine
loop's own knobs (`max_requests_in_flight`, `group_prefixes`). LoRA adapters are loaded
per request, so the adapter list is not in the key either: pipelines with other adapters over
one base share a pool when their LoRA engine arguments (`enable_lora`, `max_loras`,
`max_lora_rank`) agree; set `engine.max_loras` to share one across adapter counts.

Imports only the standard library and the job spec, so the control plane and the worker
both read the same key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.task_table import task_facts

_SLUG_CHARACTERS = re.compile(r"[^a-z0-9]+")
_SLUG_LENGTH = 30
_DIGEST_LENGTH = 12


def pool_identity(
    spec: InferenceSpec,
    *,
    model_revision: str | None = None,
    image: str | None = None,
    gpu_type: str | None = None,
) -> dict[str, Any]:
    """The facts that fix `spec`'s engine, as JSON-ready values: what `pool_key` hashes.

    The engine arguments are the ones the worker passes to `vllm.LLM`
    (`EngineArgs.to_vllm_kwargs`, so a hub revision in `engine.extra["revision"]` counts),
    with the runner and, for image tasks, the images-per-prompt limit the worker adds.

    Args:
        spec: The job spec.
        model_revision: The version of the model's files: for a local folder
            `dagster_gpuinfer.storage.model_version(spec)`, for a hub id its revision when it
            is not already in `engine.extra`. None: the model's name alone identifies it.
        image: The worker image (with its digest where known), when pools differ by image.
        gpu_type: The accelerator the pool runs on (`nvidia-h100-80gb`, `cpu`, ...).

    Returns:
        A dict of the engine's identity; equal dicts mean one engine serves both specs.
    """
    facts = task_facts(spec.task)
    engine = spec.engine.to_vllm_kwargs()
    for name, value in spec.lora_engine_kwargs().items():  # the worker's (engine_kwargs)
        engine.setdefault(name, value)
    if facts.images:  # the worker's default (worker/engine.py engine_kwargs)
        engine.setdefault(
            "limit_mm_per_prompt", {"image": spec.input.images.max_images_per_request}
        )
    model = os.path.normpath(spec.model) if spec.model_is_local_path() else spec.model
    return {
        "model": model,
        "model_revision": model_revision,
        "runner": facts.runner,
        "engine": engine,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "pipeline_parallel_size": spec.pipeline_parallel_size,
        "nodes": spec.nodes,
        "vllm_version": spec.vllm_version,
        "image": image,
        "gpu_type": gpu_type,
    }


def pool_key(
    spec: InferenceSpec,
    *,
    model_revision: str | None = None,
    image: str | None = None,
    gpu_type: str | None = None,
) -> str:
    """A stable key of the engine pool `spec` runs on: `<model name>-<12 hex digits>`.

    The name part is for people (the model folder's or hub id's last segment); the digits are
    a SHA-256 of `pool_identity`, so any change to what fixes the engine gives another pool.
    The key is a valid Kubernetes label value and DNS-1123 label (lowercase letters, digits
    and `-`, at most 43 characters), so pool pods can be named and selected by it.

    Args:
        spec: The job spec.
        model_revision: See `pool_identity`.
        image: See `pool_identity`.
        gpu_type: See `pool_identity`.

    Returns:
        The pool key.

    Examples:
        >>> from dagster_gpuinfer.spec import InputSpec, OutputSpec
        >>> spec = InferenceSpec(
        ...     model="/models/all-MiniLM-L6-v2",
        ...     task="embed",
        ...     input=InputSpec(uri="docs/{partition_key}.parquet"),
        ...     output=OutputSpec(root="out", asset_name="emb"),
        ... )
        >>> pool_key(spec).startswith("all-minilm-l6-v2-")
        True
    """
    identity = pool_identity(spec, model_revision=model_revision, image=image, gpu_type=gpu_type)
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_LENGTH]
    return f"{_model_slug(spec.model)}-{digest}"


def _model_slug(model: str) -> str:
    """The model's last path segment, lowercased, runs of other characters as one `-`."""
    name = model.removeprefix("file://").rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    slug = _SLUG_CHARACTERS.sub("-", name.lower())[:_SLUG_LENGTH].strip("-")
    return slug or "model"
