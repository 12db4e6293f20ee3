"""Worker metrics and per-partition telemetry, without an engine: a fake NVML module (the
same functions `pynvml` has), a real Prometheus registry holding gauges named as vLLM's."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.metrics import MeteredReporter, WorkerMetrics
from dagster_gpuinfer.worker.telemetry import (
    NOT_AVAILABLE,
    NvmlGpuReader,
    TelemetrySampler,
    open_gpu_reader,
    percentile,
    read_vllm_gauges,
)


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """`pynvml`'s functions over scripted readings: {device: [(util %, used bytes), ...]}."""

    def __init__(self, readings: dict[str, list[tuple[int, int]]], *, uuids=None, fail=False):
        self.readings = {k: list(v) for k, v in readings.items()}
        self.uuids = uuids or {}
        self.fail = fail
        self.initialised = False
        self.shut_down = False

    def nvmlInit(self):
        if self.fail:
            raise FakeNvmlError("NVML Shared Library Not Found")
        self.initialised = True

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.readings)

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"handle-{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return f"handle-{self.uuids[uuid]}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        """Each call moves the device to its next scripted reading."""
        series = self.readings[handle.removeprefix("handle-")]
        self.current = series.pop(0) if len(series) > 1 else series[0]
        return SimpleNamespace(gpu=self.current[0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = self.current[1]
        return SimpleNamespace(used=used, total=80 * 2**30, free=80 * 2**30 - used)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def vllm_like_registry(running: float, kv: float) -> tuple[CollectorRegistry, Gauge, Gauge]:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    run = Gauge("vllm:num_requests_running", "running", labels, registry=registry)
    wait = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry)
    cache = Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry)
    run.labels("m", "0").set(running)
    wait.labels("m", "0").set(3)
    cache.labels("m", "0").set(kv)
    return registry, run, cache


def test_percentile_is_nearest_rank():
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.95) == 10
    assert percentile([5.0], 0.95) == 5.0
    assert percentile(list(range(1, 101)), 0.95) == 95


def test_nvml_reader_reads_the_visible_gpus_by_index_and_uuid(monkeypatch):
    nvml = FakeNvml({"0": [(10, 1)], "1": [(90, 2)], "2": [(50, 3)]}, uuids={"GPU-abc": "2"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-abc")
    reader = open_gpu_reader(nvml)
    assert reader is not None and nvml.initialised
    samples = reader.read()
    assert [(s.gpu, s.utilization_percent, s.memory_used_bytes) for s in samples] == [
        ("1", 90.0, 2),
        ("GPU-abc", 50.0, 3),
    ]
    reader.close()
    assert nvml.shut_down


def test_no_nvml_means_no_gpu_reader(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert open_gpu_reader(FakeNvml({}, fail=True)) is None
    assert open_gpu_reader(FakeNvml({})) is None  # NVML up, no GPU


def test_this_machine_without_nvidia_gpus_says_not_available():
    """The real pynvml here finds no driver: GPU telemetry is `n/a`, never an error."""
    pytest.importorskip("pynvml")
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    assert open_gpu_reader() is None
    summary = TelemetrySampler(gpu_reader=None, engine_gauges=lambda: None).summarise(0.0)
    assert summary["gpu_utilization_mean"] == NOT_AVAILABLE


def test_partition_telemetry_summarises_only_its_own_window():
    clock = FakeClock()
    nvml = FakeNvml({"0": [(0, 5), (20, 5), (40, 6), (60, 6), (80, 7), (100, 9)]})
    registry, _, kv = vllm_like_registry(running=64, kv=0.5)
    sampler = TelemetrySampler(
        gpu_reader=NvmlGpuReader(nvml, ["0"]),
        engine_gauges=lambda: read_vllm_gauges(registry),
        clock=clock,
        max_num_seqs=128,
    )
    sampler.sample_once()  # before the partition: utilization 0, not counted
    clock.now = 110.0
    start = clock()
    for kv_value in (0.1, 0.2, 0.9, 0.3):
        kv.labels("m", "0").set(kv_value)
        clock.now += 1
        sampler.sample_once()
    summary = sampler.summarise(start)
    assert summary["samples"] == 4
    assert summary["gpu_utilization_mean"] == pytest.approx((20 + 40 + 60 + 80) / 4)
    assert summary["gpu_utilization_p95"] == 80
    assert summary["gpu_memory_used_max_bytes"] == 7
    assert summary["gpus"]["0"]["utilization_mean"] == 50
    assert summary["engine_saturation_mean"] == pytest.approx(64 / 128)
    assert summary["kv_cache_usage_p95"] == pytest.approx(0.9)
    assert summary["requests_waiting_mean"] == 3


def test_without_engine_gauges_saturation_is_not_available():
    sampler = TelemetrySampler(gpu_reader=None, engine_gauges=lambda: None, clock=FakeClock())
    sampler.sample_once()
    summary = sampler.summarise(0.0)
    assert summary["engine_saturation_mean"] == NOT_AVAILABLE
    assert summary["kv_cache_usage_p95"] == NOT_AVAILABLE
    assert summary["gpu_utilization_p95"] == NOT_AVAILABLE


def test_sampler_thread_samples_until_stopped():
    nvml = FakeNvml({"0": [(55, 1)]})
    sampler = TelemetrySampler(
        gpu_reader=NvmlGpuReader(nvml, None), engine_gauges=lambda: None, interval=0.01
    )
    seen = threading.Event()
    sampler.on_sample = lambda sample: seen.set()
    sampler.start()
    assert seen.wait(5)
    sampler.stop()
    count = len(sampler.samples)
    assert count >= 1 and nvml.shut_down
    assert all(s.gpus[0].utilization_percent == 55 for s in sampler.samples)


@dataclass
class Marker:
    rows_in: int = 10
    rows_out: int = 8
    rows_errored: int = 2
    prompt_tokens: int = 100
    generated_tokens: int = 40
    inference_seconds: float = 0.5
    write_seconds: float = 0.25


def test_worker_metrics_carry_asset_partition_run_labels_and_vllm_metrics():
    registry, _, _ = vllm_like_registry(running=32, kv=0.25)
    nvml = FakeNvml({"0": [(75, 4 * 2**30)]})
    sampler = TelemetrySampler(
        gpu_reader=NvmlGpuReader(nvml, ["0"]),
        engine_gauges=lambda: read_vllm_gauges(registry),
        clock=FakeClock(),
    )
    metrics = WorkerMetrics(asset="docs", run_id="r1", sampler=sampler, vllm_registry=registry)
    metrics.model_loaded(12.5, max_num_seqs=64)
    metrics.partition_started("p1")
    metrics.requests_started(10)
    metrics.requests_finished(10)
    errors = [RowError("a", "f", 1, "too_long", "m"), RowError("b", "f", 2, "empty", "m")]
    metrics.chunk_committed("p1", Marker(), errors)
    telemetry = metrics.partition_telemetry("p1", commit_seconds=0.25)
    assert telemetry["engine_saturation_mean"] == 0.5
    assert telemetry["gpu_utilization_mean"] == 75

    text = generate_latest(metrics.registry).decode()
    assert 'gpuinfer_rows_out_total{asset="docs",partition="p1",run="r1"} 8.0' in text
    assert (
        'gpuinfer_rows_errored_total{asset="docs",error_type="too_long",partition="p1",'
        'run="r1"} 1.0' in text
    )
    assert 'gpuinfer_generated_tokens_total{asset="docs",partition="p1",run="r1"} 40.0' in text
    assert 'gpuinfer_chunk_seconds_count{asset="docs",partition="p1",run="r1"} 1.0' in text
    assert 'gpuinfer_model_load_seconds{asset="docs",run="r1"} 12.5' in text
    assert 'gpuinfer_requests_in_flight{asset="docs",run="r1"} 0.0' in text
    assert 'gpuinfer_gpu_utilization_percent{asset="docs",gpu="0",run="r1"} 75.0' in text
    assert (
        'gpuinfer_partition_engine_saturation_mean_ratio{asset="docs",partition="p1",run="r1"} 0.5'
        in text
    )
    # vLLM's own gauge, re-exported with the run's labels
    assert 'vllm:num_requests_running{asset="docs",engine="0",model_name="m",run="r1"} 32.0' in text
    assert telemetry["commit_seconds"] == 0.25


def test_metered_reporter_counts_failures_and_adds_the_runs_telemetry():
    sent = []

    class Reporter:
        def partition_committed(self, manifest, *, computed):
            sent.append(("committed", manifest))

        def partition_failed(self, exc):
            sent.append(("failed", exc.partition_key))

        def run_finished(self, summary):
            sent.append(("run", summary))

        def fatal(self, exc):
            sent.append(("fatal", exc))

    metrics = WorkerMetrics(
        asset="docs",
        run_id="r2",
        sampler=TelemetrySampler(gpu_reader=None, engine_gauges=lambda: None, clock=FakeClock()),
    )
    reporter = MeteredReporter(Reporter(), metrics)
    reporter.partition_failed(SimpleNamespace(partition_key="p9", error_type="ShardError"))
    reporter.run_finished({"partitions": 1})
    reporter.fatal("boom")
    assert sent[0] == ("failed", "p9")
    summary = sent[1][1]
    assert summary["partitions"] == 1
    assert summary["telemetry"]["gpu_utilization_mean"] == NOT_AVAILABLE
    assert sent[2] == ("fatal", "boom")
    text = generate_latest(metrics.registry).decode()
    assert (
        'gpuinfer_partitions_failed_total{asset="docs",error_type="ShardError",partition="p9",'
        'run="r2"} 1.0' in text
    )


def test_worker_serves_its_registry_on_the_metrics_port(monkeypatch):
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("GPUINFER_METRICS_PORT", str(port))
    monkeypatch.delenv("GPUINFER_PUSHGATEWAY_URL", raising=False)
    metrics = WorkerMetrics.from_environment(asset="docs", run_id="r3")
    metrics.model_loaded(3.0, max_num_seqs=8)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'gpuinfer_model_load_seconds{asset="docs",run="r3"} 3.0' in text
    assert 'gpuinfer_worker_up{asset="docs",run="r3"} 1.0' in text


def test_worker_pod_declares_the_metrics_port_and_still_validates():
    import kubernetes_validate

    from dagster_gpuinfer.k8s.config import K8sLauncherConfig
    from dagster_gpuinfer.k8s.metrics_port import with_metrics_port
    from dagster_gpuinfer.k8s.names import RunIdentity
    from dagster_gpuinfer.k8s.pod import build_worker_pod
    from dagster_gpuinfer.run_metrics import metrics_env
    from dagster_gpuinfer.spec import InferenceSpec

    spec = InferenceSpec.model_validate(
        {
            "model": "/models/Llama-3.1-8B-Instruct",
            "task": "generate",
            "input": {"uri": "s3://corpus/prompts/{partition_key}.jsonl"},
            "output": {"root": "s3://corpus/out", "asset_name": "completions"},
            "partition_keys": ["prompts-000"],
        }
    )
    env = metrics_env(9400, "http://pushgateway.monitoring:9091")
    pod = build_worker_pod(
        spec,
        K8sLauncherConfig(image="registry.example.com/w:1", namespace="team-a"),
        RunIdentity(run_id="6633a66a-ab2b-4333-bb5f-adbdffff1812", asset_key="completions"),
        extra_env=env,
    )
    exposed = with_metrics_port(pod, env)
    kubernetes_validate.validate(exposed, "1.37.0", strict=True)
    container = exposed["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    assert {e["name"]: e.get("value") for e in container["env"]}["GPUINFER_METRICS_PORT"] == "9400"
    assert exposed["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    assert with_metrics_port(pod, {}) == pod  # no port configured: the pod is unchanged


def test_an_unreachable_pushgateway_costs_one_attempt_not_one_per_chunk(monkeypatch):
    attempts = []

    def refused(*args, **kwargs):
        attempts.append(kwargs.get("grouping_key"))
        raise OSError("connection refused")

    monkeypatch.setattr("prometheus_client.push_to_gateway", refused)
    metrics = WorkerMetrics(
        asset="docs",
        run_id="r4",
        pushgateway_url="http://127.0.0.1:9",
        sampler=TelemetrySampler(gpu_reader=None, engine_gauges=lambda: None, clock=FakeClock()),
    )
    for _ in range(5):
        metrics.chunk_committed("p", Marker())
    assert len(attempts) == 1
    assert attempts[0] == {"run": "r4", "asset": "docs", "process": "main", "retry": "0"}
    metrics.close()  # the final push is tried regardless
    assert len(attempts) == 2
