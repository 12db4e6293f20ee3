"""The control plane's side of observability: the worker's metrics settings, the launcher's
own metrics (pod start split, out-of-memory step-downs) pushed to a Pushgateway, and the
Dagster metadata of a run's timing and a partition's telemetry.

Never imports torch or vllm; `prometheus_client` is imported only when something is pushed.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("dagster_gpuinfer")

NOT_AVAILABLE = "n/a"
PUSH_JOB = "gpuinfer_launcher"
METRICS_PORT_ENV = "GPUINFER_METRICS_PORT"  # read by worker/metrics.py
PUSHGATEWAY_ENV = "GPUINFER_PUSHGATEWAY_URL"

# What the launcher pushes (the dashboard test checks panel queries against these too).
LAUNCHER_METRICS = (
    "gpuinfer_launcher_queued_seconds",
    "gpuinfer_launcher_scheduling_seconds",
    "gpuinfer_launcher_container_start_seconds",
    "gpuinfer_launcher_oom_step_downs",
    "gpuinfer_launcher_partitions",
)
# What the launcher adds for a run whose partitions ran on an engine pool (launch="pool").
POOL_LAUNCHER_METRICS = (
    "gpuinfer_launcher_pool_partitions",
    "gpuinfer_launcher_pool_queue_wait_seconds",
    "gpuinfer_launcher_pool_leases",
)
START_FIELDS = (
    (
        "queued_seconds",
        "gpuinfer_launcher_queued_seconds",
        "Seconds the worker pod waited for Kueue admission.",
    ),
    (
        "scheduling_seconds",
        "gpuinfer_launcher_scheduling_seconds",
        "Seconds from Kueue admission to the pod bound to a node.",
    ),
    (
        "container_start_seconds",
        "gpuinfer_launcher_container_start_seconds",
        "Seconds from binding to the worker container running (image pull, mounts).",
    ),
)


def metrics_env(port: int | None, pushgateway_url: str | None) -> dict[str, str]:
    """The worker's environment for its metrics port and Pushgateway."""
    env = {}
    if port is not None:
        env[METRICS_PORT_ENV] = str(port)
    if pushgateway_url:
        env[PUSHGATEWAY_ENV] = pushgateway_url
    return env


def run_timing(result: Any) -> dict[str, Any]:
    """The run's time split, in order: the pod queued behind Kueue admission and started
    (k8s launcher; `n/a` for local workers); the worker process start (interpreter, imports,
    Pipes) to its job; the engine build (vllm import included); inference (first engine
    ready to last commit, as the worker measured it; else the partitions' own sums); the
    partitions' commit seconds (from their manifests, whichever process or replica ran
    them); the engine shutdown."""
    start = result.pod_start or {}
    summary = result.summary
    computed = [result.manifests[key] for key in result.computed if key in result.manifests]

    def value(mapping: dict[str, Any], key: str, *fallbacks: str) -> Any:
        for name in (key, *fallbacks):
            if mapping.get(name) is not None:
                return mapping[name]
        return NOT_AVAILABLE

    inference = value(summary, "inference_seconds")
    if inference == NOT_AVAILABLE and computed:
        inference = round(sum(m.inference_seconds for m in computed), 3)
    return {
        "queued_seconds": value(start, "queued_seconds"),
        "pod_start_seconds": value(start, "admission_to_running_seconds"),
        "start_seconds": value(summary, "start_seconds"),
        "load_seconds": value(summary, "load_seconds", "model_load_seconds"),
        "inference_seconds": inference,
        "commit_seconds": round(sum(m.telemetry.get("commit_seconds", 0.0) for m in computed), 3)
        if computed
        else NOT_AVAILABLE,
        "shutdown_seconds": value(summary, "shutdown_seconds"),
    }


def run_timing_fields(result: Any) -> dict[str, Any]:
    """`run_timing` under `run_`-prefixed names (every partition of the run shares them)."""
    return {f"run_{k}": v for k, v in run_timing(result).items()}


def run_timing_metadata(result: Any) -> dict[str, Any]:
    """`run_timing_fields` plus the pod start and the run's telemetry, for run metadata."""
    import dagster as dg

    metadata: dict[str, Any] = run_timing_fields(result)
    if result.pod_start:
        metadata["run_pod_start"] = dg.MetadataValue.json(result.pod_start)
    telemetry = result.summary.get("telemetry")
    if telemetry:
        metadata["run_telemetry"] = dg.MetadataValue.json(telemetry)
    return metadata


def telemetry_metadata(telemetry: dict[str, Any]) -> dict[str, Any]:
    """A partition's telemetry (from its manifest) as metadata: numbers Dagster can chart,
    `n/a` where nothing was measured (no NVIDIA GPU, no engine gauges)."""
    import dagster as dg

    if not telemetry:
        return {}

    def field(key: str) -> Any:
        found = telemetry.get(key, NOT_AVAILABLE)
        return NOT_AVAILABLE if found is None else found

    memory = field("gpu_memory_used_max_bytes")
    metadata: dict[str, Any] = {
        "gpu_utilization_mean": field("gpu_utilization_mean"),
        "gpu_utilization_p95": field("gpu_utilization_p95"),
        "gpu_memory_used_max_gib": round(memory / 2**30, 2)
        if isinstance(memory, (int, float))
        else memory,
        "engine_saturation_mean": field("engine_saturation_mean"),
        "kv_cache_usage_p95": field("kv_cache_usage_p95"),
        "commit_seconds": field("commit_seconds"),
        "telemetry": dg.MetadataValue.json(telemetry),
    }
    return metadata


def launcher_registry(*, asset: str, run_id: str, result: Any) -> Any:
    """The launcher's metrics of one run, in a fresh `prometheus_client` registry."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    labels = ("asset", "run")
    start = result.pod_start or {}
    for key, name, doc in START_FIELDS:
        if start.get(key) is not None:
            Gauge(name, doc, labels, registry=registry).labels(asset, run_id).set(start[key])
    Gauge(
        "gpuinfer_launcher_oom_step_downs",
        "Relaunches with smaller vLLM batches after the worker ran out of memory.",
        labels,
        registry=registry,
    ).labels(asset, run_id).set(1 if result.memory_step_down else 0)
    partitions = Gauge(
        "gpuinfer_launcher_partitions",
        "Partitions of the run, by outcome.",
        (*labels, "outcome"),
        registry=registry,
    )
    partitions.labels(asset, run_id, "committed").set(len(result.manifests))
    partitions.labels(asset, run_id, "failed").set(len(result.failed))
    pool_facts = getattr(result, "pool", None)
    if pool_facts:
        _pool_gauges(registry, labels, (asset, run_id), list(pool_facts.values()))
    return registry


def _pool_gauges(
    registry: Any, labels: tuple[str, ...], values: tuple[str, ...], facts: list
) -> None:
    """Warm hits vs cold starts, the longest queue wait and the leases of a pool run."""
    from prometheus_client import Gauge

    engine = Gauge(
        "gpuinfer_launcher_pool_partitions",
        "Partitions of the run served by a pool worker, by engine: warm (already built) or "
        "cold (built for this lease).",
        (*labels, "engine"),
        registry=registry,
    )
    warm = sum(1 for fact in facts if fact.get("warm"))
    engine.labels(*values, "warm").set(warm)
    engine.labels(*values, "cold").set(len(facts) - warm)
    waits = [fact["queue_wait_s"] for fact in facts if fact.get("queue_wait_s") is not None]
    Gauge(
        "gpuinfer_launcher_pool_queue_wait_seconds",
        "Longest wait of one of the run's partitions for its first lease.",
        labels,
        registry=registry,
    ).labels(*values).set(max(waits, default=0.0))
    Gauge(
        "gpuinfer_launcher_pool_leases",
        "Leases the run's partitions took (above the partitions: expired or failed leases).",
        labels,
        registry=registry,
    ).labels(*values).set(sum(int(fact.get("leases") or 0) for fact in facts))


def push_run_metrics(pushgateway_url: str | None, *, asset: str, run_id: str, result: Any) -> None:
    """Push the launcher's numbers for this run (when a Pushgateway is configured); a
    Pushgateway that cannot be reached is logged, never raised."""
    if not pushgateway_url:
        return
    from prometheus_client import push_to_gateway

    registry = launcher_registry(asset=asset, run_id=run_id, result=result)
    try:
        push_to_gateway(
            pushgateway_url,
            job=PUSH_JOB,
            registry=registry,
            grouping_key={"run": run_id, "asset": asset},
            timeout=10,
        )
    except Exception as exc:  # noqa: BLE001 - metrics never fail a run
        log.warning("cannot push launcher metrics to %s: %s", pushgateway_url, exc)
