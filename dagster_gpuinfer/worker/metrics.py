"""Prometheus metrics of a worker: the platform's counters plus vLLM's own engine metrics.

Everything is labelled with the output `asset` and the Dagster `run` (and the `partition`
where a number belongs to one). The worker exposes them two ways, both optional:

- scraped: `GPUINFER_METRICS_PORT` set starts `prometheus_client`'s HTTP server on that port
  (worker pods declare it as the `metrics` container port, which the PodMonitor in
  `deploy/observability/` scrapes);
- pushed: `GPUINFER_PUSHGATEWAY_URL` set pushes the whole registry to that Prometheus
  Pushgateway after every chunk commit and once at exit, grouped by job, run, asset and
  process (workers are batch jobs: a pod that ended can no longer be scraped).

vLLM's metrics (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, token counters,
time-to-first-token and queue-time histograms, ...) live in the process's default registry
once the engine is built with `disable_log_stats=False`; `VllmMetricsCollector` re-exports
them with the asset and run labels added, so one query joins them to the platform's.

The inference loop calls a few one-line hooks on `current_metrics()` (`model_loaded`,
`requests_started`, `chunk_committed`, `partition_started`, `partition_telemetry`); a process
that never installed a `WorkerMetrics` gets one that records in memory and exports nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.telemetry import (
    NOT_AVAILABLE,
    Sample,
    TelemetrySampler,
    engine_saturation,
    open_gpu_reader,
    read_vllm_gauges,
)

if TYPE_CHECKING:
    from dagster_gpuinfer.storage import Manifest
    from dagster_gpuinfer.worker.errors import WorkerError

log = logging.getLogger("dagster_gpuinfer.worker")

METRICS_PORT_ENV = "GPUINFER_METRICS_PORT"
PUSHGATEWAY_ENV = "GPUINFER_PUSHGATEWAY_URL"
SAMPLE_SECONDS_ENV = "GPUINFER_TELEMETRY_INTERVAL"
RUN_ID_ENV = "GPUINFER_RUN_ID"
RETRY_ENV = "GPUINFER_RETRY_NUMBER"
PUSH_JOB = "gpuinfer_worker"
PUSH_TIMEOUT_SECONDS = 5.0
PUSH_RETRY_SECONDS = 60.0

RUN_LABELS = ("asset", "run")
PARTITION_LABELS = ("asset", "partition", "run")
CHUNK_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

# Every metric the worker exports under its own name (the dashboard test checks panel
# queries against this list, plus vLLM's and DCGM's).
PLATFORM_METRICS = (
    "gpuinfer_rows_in_total",
    "gpuinfer_rows_out_total",
    "gpuinfer_rows_errored_total",
    "gpuinfer_rows_resumed_total",
    "gpuinfer_prompt_tokens_total",
    "gpuinfer_generated_tokens_total",
    "gpuinfer_chunks_committed_total",
    "gpuinfer_chunk_seconds",
    "gpuinfer_partitions_committed_total",
    "gpuinfer_partitions_failed_total",
    "gpuinfer_requests_in_flight",
    "gpuinfer_model_load_seconds",
    "gpuinfer_model_load_failures_total",
    "gpuinfer_run_retry_number",
    "gpuinfer_gpu_utilization_percent",
    "gpuinfer_gpu_memory_used_bytes",
    "gpuinfer_engine_saturation_ratio",
    "gpuinfer_kv_cache_usage_ratio",
    "gpuinfer_partition_gpu_utilization_mean_percent",
    "gpuinfer_partition_engine_saturation_mean_ratio",
    "gpuinfer_partition_kv_cache_usage_p95_ratio",
    "gpuinfer_worker_up",
)


class VllmMetricsCollector:
    """Re-exports vLLM's `vllm:*` metrics from `source` with extra constant labels."""

    def __init__(self, labels: dict[str, str], source: Any = None) -> None:
        self.labels = labels
        self.source = source

    def collect(self) -> Iterable[Metric]:
        source = self.source
        if source is None:
            from prometheus_client import REGISTRY as source
        for metric in source.collect():
            if not metric.name.startswith("vllm:"):
                continue
            relabelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            for sample in metric.samples:
                relabelled.add_sample(
                    sample.name,
                    {**sample.labels, **self.labels},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
            yield relabelled


class WorkerMetrics:
    """The metrics of one worker process (or replica), and its telemetry sampler.

    Args:
        asset: The output asset, as a label value.
        run_id: The Dagster run id.
        process: `main` for the worker, `replica-N` for its replica processes (the label
            that keeps their pushed groups apart).
        retry_number: Dagster's retry number of the step (exported as a gauge).
        sampler: The telemetry sampler; None builds one (NVML when present, vLLM's gauges).
        pushgateway_url: Push here after each commit and at exit; None pushes nothing.
        vllm_registry: Where vLLM registered its metrics (the default registry).
    """

    def __init__(
        self,
        *,
        asset: str,
        run_id: str,
        process: str = "main",
        retry_number: int = 0,
        sampler: TelemetrySampler | None = None,
        pushgateway_url: str | None = None,
        vllm_registry: Any = None,
    ) -> None:
        self.asset = asset
        self.run_id = run_id
        self.process = process
        self.retry_number = retry_number
        self.pushgateway_url = pushgateway_url
        self.registry = CollectorRegistry()
        self.registry.register(VllmMetricsCollector({"asset": asset, "run": run_id}, vllm_registry))
        self.sampler = (
            sampler
            if sampler is not None
            else TelemetrySampler(
                gpu_reader=open_gpu_reader(),
                engine_gauges=lambda: read_vllm_gauges(vllm_registry),
                interval=float(os.environ.get(SAMPLE_SECONDS_ENV, "1.0")),
            )
        )
        self.sampler.on_sample = self._export_sample
        self._partition_started: dict[str, float] = {}
        self._push_warned = False
        self._push_paused_until = 0.0
        self._push_lock = threading.Lock()
        self._declare_counters()
        self._declare_gauges()
        self.run_labels = {"asset": asset, "run": run_id}
        self.retry_gauge.labels(**self.run_labels).set(retry_number)
        self.up.labels(**self.run_labels).set(1)
        self.in_flight.labels(**self.run_labels).set(0)

    def _declare_counters(self) -> None:
        """The platform's counters and its chunk-time histogram."""
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = PARTITION_LABELS) -> Counter:
            return Counter(name.removesuffix("_total"), doc, labels, registry=r)

        self.rows_in = counter("gpuinfer_rows_in_total", "Input rows read into chunks.")
        self.rows_out = counter("gpuinfer_rows_out_total", "Rows written to the output.")
        self.rows_errored = counter(
            "gpuinfer_rows_errored_total",
            "Rows quarantined to errors, by error_type.",
            (*PARTITION_LABELS, "error_type"),
        )
        self.rows_resumed = counter(
            "gpuinfer_rows_resumed_total", "Rows skipped because committed chunks held them."
        )
        self.prompt_tokens = counter("gpuinfer_prompt_tokens_total", "Prompt tokens.")
        self.generated_tokens = counter("gpuinfer_generated_tokens_total", "Generated tokens.")
        self.chunks = counter("gpuinfer_chunks_committed_total", "Chunks committed.")
        self.chunk_seconds = Histogram(
            "gpuinfer_chunk_seconds",
            "Seconds from a chunk's inference start to its commit.",
            PARTITION_LABELS,
            buckets=CHUNK_SECONDS_BUCKETS,
            registry=r,
        )
        self.partitions_committed = counter(
            "gpuinfer_partitions_committed_total", "Partitions this worker committed.", RUN_LABELS
        )
        self.partitions_failed = counter(
            "gpuinfer_partitions_failed_total",
            "Partitions whose shard could not be processed.",
            (*PARTITION_LABELS, "error_type"),
        )
        self.model_load_failures = counter(
            "gpuinfer_model_load_failures_total",
            "Engine builds that failed, by error_type.",
            (*RUN_LABELS, "error_type"),
        )

    def _declare_gauges(self) -> None:
        """The platform's gauges: the run's, the last telemetry sample's, each partition's."""
        r = self.registry
        self.in_flight = Gauge(
            "gpuinfer_requests_in_flight",
            "Requests submitted to the engine, not yet done.",
            RUN_LABELS,
            registry=r,
        )
        self.load_seconds = Gauge(
            "gpuinfer_model_load_seconds",
            "Seconds the last engine took to load.",
            RUN_LABELS,
            registry=r,
        )
        self.retry_gauge = Gauge(
            "gpuinfer_run_retry_number",
            "Dagster retry number of this step (0: first try).",
            RUN_LABELS,
            registry=r,
        )
        self.gpu_utilization = Gauge(
            "gpuinfer_gpu_utilization_percent",
            "GPU utilization (NVML), last sample.",
            (*RUN_LABELS, "gpu"),
            registry=r,
        )
        self.gpu_memory = Gauge(
            "gpuinfer_gpu_memory_used_bytes",
            "GPU memory used (NVML), last sample.",
            (*RUN_LABELS, "gpu"),
            registry=r,
        )
        self.saturation = Gauge(
            "gpuinfer_engine_saturation_ratio",
            "Running requests / max_num_seqs, last sample (pooling: running + waiting, "
            "capped at max_num_seqs).",
            RUN_LABELS,
            registry=r,
        )
        self.kv_cache = Gauge(
            "gpuinfer_kv_cache_usage_ratio",
            "vLLM KV-cache usage (1 = full), last sample.",
            RUN_LABELS,
            registry=r,
        )
        self.partition_gpu = Gauge(
            "gpuinfer_partition_gpu_utilization_mean_percent",
            "Mean GPU utilization while the partition ran.",
            PARTITION_LABELS,
            registry=r,
        )
        self.partition_saturation = Gauge(
            "gpuinfer_partition_engine_saturation_mean_ratio",
            "Mean running requests / max_num_seqs while the partition ran.",
            PARTITION_LABELS,
            registry=r,
        )
        self.partition_kv = Gauge(
            "gpuinfer_partition_kv_cache_usage_p95_ratio",
            "p95 KV-cache usage while the partition ran.",
            PARTITION_LABELS,
            registry=r,
        )
        self.up = Gauge(
            "gpuinfer_worker_up",
            "1 while the worker runs, 0 once it finished.",
            RUN_LABELS,
            registry=r,
        )

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def from_environment(
        cls, *, asset: str, run_id: str, process: str = "main", retry_number: int = 0
    ) -> WorkerMetrics:
        """Metrics configured by the worker's environment: port, Pushgateway, interval."""
        metrics = cls(
            asset=asset,
            run_id=run_id,
            process=process,
            retry_number=retry_number,
            pushgateway_url=os.environ.get(PUSHGATEWAY_ENV) or None,
        )
        port = os.environ.get(METRICS_PORT_ENV)
        if port and process == "main":
            from prometheus_client import start_http_server

            try:
                start_http_server(int(port), registry=metrics.registry)
                log.info("metrics on port %s", port)
            except OSError as exc:  # port taken: the run goes on, pushed metrics still flow
                log.warning("cannot serve metrics on port %s: %s", port, exc)
        return metrics

    def start(self) -> WorkerMetrics:
        self.sampler.start()
        return self

    def close(self) -> None:
        """Stop sampling, mark the worker finished and push one last time."""
        self.sampler.stop()
        self.up.labels(**self.run_labels).set(0)
        self.push(final=True)

    def push(self, *, final: bool = False) -> None:
        """Push the registry to the Pushgateway (when configured); never raises.

        After a failed push the next ones are skipped for `PUSH_RETRY_SECONDS` (but not the
        final one), so an unreachable Pushgateway costs the inference loop one timeout, not
        one per chunk.
        """
        if not self.pushgateway_url:
            return
        now = time.monotonic()
        if not final and now < self._push_paused_until:
            return
        from prometheus_client import push_to_gateway

        grouping = {
            "run": self.run_id,
            "asset": self.asset,
            "process": self.process,
            "retry": str(self.retry_number),  # a retry's group does not replace the first's
        }
        try:
            with self._push_lock:
                push_to_gateway(
                    self.pushgateway_url,
                    job=PUSH_JOB,
                    registry=self.registry,
                    grouping_key=grouping,
                    timeout=PUSH_TIMEOUT_SECONDS,
                )
        except Exception as exc:  # noqa: BLE001 - metrics never fail a job
            self._push_paused_until = time.monotonic() + PUSH_RETRY_SECONDS
            if not self._push_warned:
                log.warning("cannot push metrics to %s: %s", self.pushgateway_url, exc)
                self._push_warned = True

    # ------------------------------------------------------------------ hooks

    def serves_task(self, task: str) -> None:
        """Say which task the engine serves: pooling tasks read saturation another way."""
        self.sampler.pooling = task_facts(task).pooling

    def model_loaded(self, seconds: float, *, max_num_seqs: int | None) -> None:
        self.load_seconds.labels(**self.run_labels).set(seconds)
        self.sampler.max_num_seqs = max_num_seqs

    def model_load_failed(self, exc: BaseException) -> None:
        self.model_load_failures.labels(**self.run_labels, error_type=type(exc).__name__).inc()
        self.push()

    def requests_started(self, count: int) -> None:
        self.in_flight.labels(**self.run_labels).inc(count)

    def requests_finished(self, count: int) -> None:
        self.in_flight.labels(**self.run_labels).dec(count)

    def partition_started(self, partition: str) -> None:
        self._partition_started.setdefault(partition, self.sampler.clock())

    def chunk_committed(self, partition: str, marker: Any, errors: Iterable[Any] = ()) -> None:
        """A chunk's marker is written: count its rows and tokens, then push."""
        labels = {**self.run_labels, "partition": partition}
        self.rows_in.labels(**labels).inc(marker.rows_in)
        self.rows_out.labels(**labels).inc(marker.rows_out)
        for error in errors:
            self.rows_errored.labels(**labels, error_type=error.error_type).inc()
        self.prompt_tokens.labels(**labels).inc(marker.prompt_tokens)
        self.generated_tokens.labels(**labels).inc(marker.generated_tokens)
        self.chunks.labels(**labels).inc()
        self.chunk_seconds.labels(**labels).observe(marker.inference_seconds + marker.write_seconds)
        self.push()

    def partition_telemetry(
        self, partition: str, *, rows_resumed: int = 0, commit_seconds: float = 0.0
    ) -> dict[str, Any]:
        """The partition is being committed: its telemetry, for the manifest and metadata.

        `commit_seconds` is the time its chunks' files took to write, summed from their
        markers (written in whichever process, replica or not, served the chunk)."""
        self.sampler.sample_once()  # at least one sample, however short the partition
        started = self._partition_started.pop(partition, None)
        summary = self.sampler.summarise(started if started is not None else 0.0)
        summary["commit_seconds"] = round(commit_seconds, 3)
        labels = {**self.run_labels, "partition": partition}
        if rows_resumed:
            self.rows_resumed.labels(**labels).inc(rows_resumed)
        self.partitions_committed.labels(**self.run_labels).inc()
        for key, gauge in (
            ("gpu_utilization_mean", self.partition_gpu),
            ("engine_saturation_mean", self.partition_saturation),
            ("kv_cache_usage_p95", self.partition_kv),
        ):
            if summary[key] != NOT_AVAILABLE:
                gauge.labels(**labels).set(summary[key])
        return summary

    def partition_failed(self, partition: str, error_type: str) -> None:
        self._partition_started.pop(partition, None)
        labels = {**self.run_labels, "partition": partition, "error_type": error_type}
        self.partitions_failed.labels(**labels).inc()
        self.push()

    def _export_sample(self, sample: Sample) -> None:
        for gpu in sample.gpus:
            self.gpu_utilization.labels(**self.run_labels, gpu=gpu.gpu).set(gpu.utilization_percent)
            self.gpu_memory.labels(**self.run_labels, gpu=gpu.gpu).set(gpu.memory_used_bytes)
        if sample.engine is not None:
            self.kv_cache.labels(**self.run_labels).set(sample.engine.kv_cache_usage)
            if self.sampler.max_num_seqs:
                self.saturation.labels(**self.run_labels).set(
                    engine_saturation(
                        sample.engine, self.sampler.max_num_seqs, pooling=self.sampler.pooling
                    )
                )


# --------------------------------------------------------------------------- the process's


_current: WorkerMetrics | None = None


def current_metrics() -> WorkerMetrics:
    """The metrics this process installed; a local, exporting-nothing one if none was."""
    global _current
    if _current is None:
        _current = WorkerMetrics(
            asset="unknown",
            run_id="unknown",
            sampler=TelemetrySampler(gpu_reader=None, interval=3600.0),
        )
    return _current


def install_metrics(metrics: WorkerMetrics | None) -> WorkerMetrics | None:
    """Make `metrics` the process's (None uninstalls); returns it."""
    global _current
    _current = metrics
    return metrics


class MeteredReporter:
    """Wraps the worker's reporter: failures are counted and the run summary gets the run's
    telemetry (GPU utilization, engine saturation over the whole run)."""

    def __init__(self, reporter: Any, metrics: WorkerMetrics) -> None:
        self.reporter = reporter
        self.metrics = metrics
        self.started = metrics.sampler.clock()

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None:
        self.reporter.partition_committed(manifest, computed=computed)

    def partition_failed(self, exc: WorkerError) -> None:
        self.metrics.partition_failed(str(exc.partition_key), exc.error_type)
        self.reporter.partition_failed(exc)

    def run_finished(self, summary: dict[str, Any]) -> None:
        summary = dict(summary)
        telemetry = self.metrics.sampler.summarise(self.started)
        telemetry.pop("gpus", None)
        summary["telemetry"] = telemetry
        self.reporter.run_finished(summary)

    def __getattr__(self, name: str) -> Any:  # fatal(), and whatever the reporter grows
        return getattr(self.reporter, name)


def start_worker_metrics(
    *,
    asset: str,
    run_id: str | None = None,
    process: str = "main",
    retry_number: int | None = None,
) -> WorkerMetrics:
    """Build the process's metrics from the environment, install and start them.

    The run id and retry number are kept in `GPUINFER_RUN_ID` and `GPUINFER_RETRY_NUMBER`,
    where replica processes (spawned with this environment) find them when they pass None.
    """
    if run_id is None:
        run_id = os.environ.get(RUN_ID_ENV, "unknown")
    if retry_number is None:
        retry_number = int(os.environ.get(RETRY_ENV, "0"))
    os.environ[RUN_ID_ENV] = run_id
    os.environ[RETRY_ENV] = str(retry_number)
    metrics = WorkerMetrics.from_environment(
        asset=asset, run_id=run_id, process=process, retry_number=retry_number
    )
    install_metrics(metrics)
    return metrics.start()
