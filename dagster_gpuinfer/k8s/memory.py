"""The out-of-memory step-down: one relaunch with smaller vLLM batches, then a clear hint.

When a worker pod runs out of memory (`failures.classify_pod_failure` says `out_of_memory`),
the resource relaunches it once with `step_down_memory(spec)`. This changes the spec, not a
verdict about a pod, so it lives apart from the failure table.
"""

from __future__ import annotations

from typing import Any

from dagster_gpuinfer.k8s.failures import PodFailure
from dagster_gpuinfer.spec import InferenceSpec

DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's usual `max_num_seqs` when a spec leaves it unset; the step-down halves it."""


def step_down_memory(spec: InferenceSpec) -> tuple[InferenceSpec, dict[str, Any]]:
    """The spec with `max_num_seqs` halved and `gpu_memory_utilization` lowered.

    Both are performance-only engine fields, left out of `spec_hash()`, so committed chunks
    of the first attempt stay valid for the second.

    Returns:
        (stepped-down spec, what changed: `{field: {"from": old, "to": new}}`).
    """
    engine = spec.engine
    seqs_from = engine.max_num_seqs
    seqs_to = max(1, (seqs_from or DEFAULT_MAX_NUM_SEQS) // 2)
    util_from = engine.gpu_memory_utilization
    util_to = round(util_from - 0.1, 3) if util_from > 0.5 else round(util_from * 0.8, 3)
    util_to = max(0.05, util_to)
    stepped = spec.model_copy(
        update={
            "engine": engine.model_copy(
                update={"max_num_seqs": seqs_to, "gpu_memory_utilization": util_to}
            )
        }
    )
    change = {
        "max_num_seqs": {"from": seqs_from, "to": seqs_to},
        "gpu_memory_utilization": {"from": util_from, "to": util_to},
    }
    return stepped, change


def out_of_memory_hint(first: PodFailure, second: PodFailure, change: dict[str, Any]) -> str:
    """The message when the stepped-down retry ran out of memory too."""
    seqs = change["max_num_seqs"]["to"]
    util = change["gpu_memory_utilization"]["to"]
    container = "container_oom_killed" in (first.detail.get("memory"), second.detail.get("memory"))
    memory_advice = (
        "raise k8s.memory_limit (and memory_request) so the container can hold the model's "
        "weights while loading, "
        if container
        else ""
    )
    return (
        f"the worker ran out of memory twice: first {first.message.splitlines()[0]} Then, "
        f"retried with max_num_seqs={seqs} and gpu_memory_utilization={util}: "
        f"{second.message.splitlines()[0]} Not retried again. To fix: {memory_advice}lower "
        "engine max_num_seqs and gpu_memory_utilization further (InferenceRunConfig in the "
        "launchpad), lower max_model_len, or raise tensor_parallel_size to spread the model "
        "over more GPUs."
    )
