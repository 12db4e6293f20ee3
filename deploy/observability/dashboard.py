"""The Grafana dashboard of dagster-gpuinfer, built from code with grafana-foundation-sdk.

    python deploy/observability/dashboard.py > deploy/observability/gpuinfer-dashboard.json

A test regenerates it and compares with the committed JSON, and checks that every panel's
query names a metric the worker, the launcher or NVIDIA's DCGM exporter exports.
Rows: throughput, engine saturation, GPUs, queue and start, errors, engine pools.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

UID = "dagster-gpuinfer"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
ASSET = 'asset=~"$asset"'
RATE = "[$__rate_interval]"


def p95(histogram: str) -> str:
    """The 95th percentile per asset of a histogram's `_bucket` series."""
    return f"histogram_quantile(0.95, sum by (asset, le) (rate({histogram}{{{ASSET}}}{RATE})))"


def panel(title: str, unit: str, description: str, *queries: tuple[str, str]) -> Timeseries:
    """A time series panel with one Prometheus query per (expression, legend) pair."""
    built = (
        Timeseries()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(8)
        .height(8)
    )
    for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
        built = built.with_target(
            Dataquery().ref_id(ref).expr(expr).legend_format(legend).datasource(DATASOURCE)
        )
    return built


def throughput() -> list[Timeseries]:
    return [
        panel(
            "Rows per second",
            "rows/s",
            "Rows written to the output and quarantined, per asset.",
            (f"sum by (asset) (rate(gpuinfer_rows_out_total{{{ASSET}}}{RATE}))", "{{asset}} out"),
            (
                f"sum by (asset) (rate(gpuinfer_rows_errored_total{{{ASSET}}}{RATE}))",
                "{{asset}} quarantined",
            ),
        ),
        panel(
            "Tokens per second",
            "tokens/s",
            "Prompt and generated tokens, counted by the worker per committed chunk.",
            (
                f"sum by (asset) (rate(gpuinfer_prompt_tokens_total{{{ASSET}}}{RATE}))",
                "{{asset}} prompt",
            ),
            (
                f"sum by (asset) (rate(gpuinfer_generated_tokens_total{{{ASSET}}}{RATE}))",
                "{{asset}} generated",
            ),
            (
                f"sum by (asset) (rate(vllm:generation_tokens_total{{{ASSET}}}{RATE}))",
                "{{asset}} generated (vLLM)",
            ),
        ),
        panel(
            "Chunk latency p95",
            "s",
            "From a chunk's inference start to its committed marker.",
            (
                p95("gpuinfer_chunk_seconds_bucket"),
                "{{asset}}",
            ),
        ),
    ]


def saturation() -> list[Timeseries]:
    return [
        panel(
            "Engine saturation",
            "percentunit",
            "Running requests / max_num_seqs. Low while GPUs idle: the engine is starved.",
            (
                f"avg by (asset, run) (gpuinfer_engine_saturation_ratio{{{ASSET}}})",
                "{{asset}} {{run}}",
            ),
        ),
        panel(
            "KV-cache usage",
            "percentunit",
            "vLLM's KV-cache usage (1 = full). Near 1 with waiting requests: memory bound.",
            (f"max by (asset, run) (vllm:kv_cache_usage_perc{{{ASSET}}})", "{{asset}} {{run}}"),
        ),
        panel(
            "Requests running, waiting, in flight",
            "short",
            "vLLM's scheduler queue, and what the worker has submitted.",
            (f"sum by (asset) (vllm:num_requests_running{{{ASSET}}})", "{{asset}} running"),
            (f"sum by (asset) (vllm:num_requests_waiting{{{ASSET}}})", "{{asset}} waiting"),
            (f"sum by (asset) (gpuinfer_requests_in_flight{{{ASSET}}})", "{{asset}} in flight"),
        ),
        panel(
            "Time to first token and engine queue time p95",
            "s",
            "vLLM's own request histograms.",
            (
                p95("vllm:time_to_first_token_seconds_bucket"),
                "{{asset}} TTFT",
            ),
            (
                p95("vllm:request_queue_time_seconds_bucket"),
                "{{asset}} queue",
            ),
        ),
    ]


def gpus() -> list[Timeseries]:
    return [
        panel(
            "GPU utilization (DCGM)",
            "percent",
            "DCGM exporter's utilization of the GPUs each worker pod holds.",
            ('avg by (pod) (DCGM_FI_DEV_GPU_UTIL{pod=~"gpuinfer-.+"})', "{{pod}}"),
        ),
        panel(
            "GPU memory used (DCGM)",
            "decmbytes",
            "Frame buffer used by each worker pod's GPUs.",
            ('sum by (pod) (DCGM_FI_DEV_FB_USED{pod=~"gpuinfer-.+"})', "{{pod}}"),
        ),
        panel(
            "GPU utilization (worker NVML)",
            "percent",
            "The worker's own NVML samples, per run; per partition means beside them.",
            (
                f"avg by (asset, run) (gpuinfer_gpu_utilization_percent{{{ASSET}}})",
                "{{asset}} {{run}}",
            ),
            (
                f"avg by (asset) (gpuinfer_partition_gpu_utilization_mean_percent{{{ASSET}}})",
                "{{asset}} partition mean",
            ),
        ),
    ]


def queue_and_start() -> list[Timeseries]:
    return [
        panel(
            "Pending behind Kueue",
            "s",
            "Seconds each run's worker pod waited for Kueue admission.",
            (
                f"max by (asset, run) (gpuinfer_launcher_queued_seconds{{{ASSET}}})",
                "{{asset}} {{run}}",
            ),
        ),
        panel(
            "Pod start",
            "s",
            "From admission to a node, then to the worker container running.",
            (
                f"max by (asset, run) (gpuinfer_launcher_scheduling_seconds{{{ASSET}}})",
                "{{asset}} scheduling",
            ),
            (
                f"max by (asset, run) (gpuinfer_launcher_container_start_seconds{{{ASSET}}})",
                "{{asset}} container start",
            ),
        ),
        panel(
            "Model load",
            "s",
            "Seconds the worker's vLLM engine took to load.",
            (f"max by (asset, run) (gpuinfer_model_load_seconds{{{ASSET}}})", "{{asset}} {{run}}"),
        ),
    ]


def errors() -> list[Timeseries]:
    return [
        panel(
            "Quarantined rows by error type",
            "rows/s",
            "Rows that went to errors.parquet, by reason.",
            (
                f"sum by (asset, error_type) (rate(gpuinfer_rows_errored_total{{{ASSET}}}{RATE}))",
                "{{asset}} {{error_type}}",
            ),
        ),
        panel(
            "Failed partitions and model loads",
            "short",
            "Partitions whose shard could not be processed; engines that failed to load.",
            (
                f"sum by (asset, error_type) (gpuinfer_partitions_failed_total{{{ASSET}}})",
                "{{asset}} partition {{error_type}}",
            ),
            (
                f"sum by (asset, error_type) (gpuinfer_model_load_failures_total{{{ASSET}}})",
                "{{asset}} load {{error_type}}",
            ),
        ),
        panel(
            "Retries and out-of-memory step-downs",
            "short",
            "Dagster retry number of each run's step; relaunches with smaller batches.",
            (f"max by (asset, run) (gpuinfer_run_retry_number{{{ASSET}}})", "{{asset}} retry"),
            (
                f"max by (asset, run) (gpuinfer_launcher_oom_step_downs{{{ASSET}}})",
                "{{asset}} OOM step-down",
            ),
        ),
    ]


def pools() -> list[Timeseries]:
    """Engine pools (launch="pool"): the queue side (pushed by the reconciler sensor,
    dagster_gpuinfer/pools/metrics.py) and each pool run's warm and cold partitions."""
    return [
        panel(
            "Pool workers",
            "short",
            "Live pool workers by state; a pool at zero has no engine up.",
            ("sum by (pool, state) (gpuinfer_pool_workers)", "{{pool}} {{state}}"),
        ),
        panel(
            "Pool queue depth",
            "short",
            "Work items waiting for a lease, by job priority, and under a live lease.",
            (
                "sum by (pool, priority) (gpuinfer_pool_queued_items)",
                "{{pool}} queued p{{priority}}",
            ),
            ("sum by (pool) (gpuinfer_pool_leased_items)", "{{pool}} leased"),
        ),
        panel(
            "Oldest lease and expired leases",
            "s",
            "Age of each pool's oldest live lease; leases that expired (a worker lost).",
            ("max by (pool) (gpuinfer_pool_oldest_lease_age_seconds)", "{{pool}} oldest lease"),
            (
                f"sum by (pool) (clamp_min(delta(gpuinfer_pool_expired_leases{RATE}), 0))",
                "{{pool}} expired",
            ),
        ),
        panel(
            "Warm hits vs cold starts",
            "short",
            "Partitions of pool runs served by an engine already built (warm) or built for "
            "them (cold); and the live workers' own counts.",
            (
                f"sum by (asset, engine) (gpuinfer_launcher_pool_partitions{{{ASSET}}})",
                "{{asset}} {{engine}}",
            ),
            ("sum by (pool) (gpuinfer_pool_warm_hits)", "{{pool}} live workers warm"),
            ("sum by (pool) (gpuinfer_pool_cold_starts)", "{{pool}} live workers cold"),
        ),
        panel(
            "Pool queue wait",
            "s",
            "Each pool run's longest wait of a partition for its first lease.",
            (
                f"max by (asset, run) (gpuinfer_launcher_pool_queue_wait_seconds{{{ASSET}}})",
                "{{asset}} {{run}} wait",
            ),
        ),
    ]


def build_dashboard() -> Dashboard:
    dashboard = (
        Dashboard("dagster-gpuinfer: batch inference")
        .uid(UID)
        .tags(["dagster-gpuinfer", "vllm", "gpu"])
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            QueryVariable("asset")
            .label("Asset")
            .datasource(DATASOURCE)
            .query("label_values(gpuinfer_rows_in_total, asset)")
            .include_all(True)
            .multi(True)
            .all_value(".*")
        )
    )
    panel_id = 0
    for title, panels in (
        ("Throughput", throughput()),
        ("Engine saturation", saturation()),
        ("GPUs", gpus()),
        ("Queue and start", queue_and_start()),
        ("Errors, retries, out of memory", errors()),
        ("Engine pools", pools()),
    ):
        panel_id += 1
        dashboard = dashboard.with_row(Row(title).id(panel_id))
        for built in panels:
            panel_id += 1
            dashboard = dashboard.with_panel(built.id(panel_id))
    return dashboard


def dashboard_json() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard().build()) + "\n"


if __name__ == "__main__":
    print(dashboard_json(), end="")
