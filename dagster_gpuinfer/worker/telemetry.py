"""Per-partition telemetry of a worker: GPU utilization (NVML) and engine saturation (vLLM).

A `TelemetrySampler` thread reads, every `interval` seconds, the GPUs this worker holds
(through NVML, `nvidia-ml-py`) and vLLM's own scheduler gauges (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, which the engine sets at every step when it is built with
`disable_log_stats=False`). A partition's telemetry is the summary of the samples taken while
it ran: mean and p95 utilization and memory per GPU, mean running requests over
`max_num_seqs`, p95 KV-cache usage. Without NVIDIA GPUs (or NVML) the GPU fields say `n/a`;
without vLLM's gauges the engine fields do.

Tests drive `NvmlGpuReader` through an injected fake NVML module and the saturation through
an injected registry: the code that runs on a GPU node is the code under test.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dagster_gpuinfer.worker")

NOT_AVAILABLE = "n/a"
DEFAULT_SAMPLE_SECONDS = 1.0


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant."""

    gpu: str  # the CUDA_VISIBLE_DEVICES entry (index or UUID) as the worker sees it
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass(frozen=True)
class EngineGauges:
    """vLLM's scheduler gauges at one instant, summed over the engines of this process."""

    running: float
    waiting: float
    kv_cache_usage: float  # fraction, 1.0 = full


@dataclass(frozen=True)
class Sample:
    at: float
    gpus: tuple[GpuSample, ...]
    engine: EngineGauges | None


# --------------------------------------------------------------------------- GPUs (NVML)


class NvmlGpuReader:
    """Reads utilization and memory of the GPUs this process may use, through NVML.

    Args:
        nvml: The `pynvml` module (from `nvidia-ml-py`), or a fake with the same functions.
        visible: The GPUs to read, as `CUDA_VISIBLE_DEVICES` names them (indices or
            `GPU-...` UUIDs); None reads every GPU NVML sees.
    """

    def __init__(self, nvml: Any, visible: Sequence[str] | None = None) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        if visible is None:
            visible = [str(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.handles: list[tuple[str, Any]] = []
        for name in visible:
            if name.startswith(("GPU-", "MIG-")):
                handle = nvml.nvmlDeviceGetHandleByUUID(name)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(name))
            self.handles.append((name, handle))

    def read(self) -> tuple[GpuSample, ...]:
        samples = []
        for name, handle in self.handles:
            rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            samples.append(
                GpuSample(
                    gpu=name,
                    utilization_percent=float(rates.gpu),
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                )
            )
        return tuple(samples)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - shutting down a library that may be half gone
            log.debug("nvmlShutdown failed: %s", exc)


def open_gpu_reader(nvml: Any = None) -> NvmlGpuReader | None:
    """An NVML reader for the GPUs in `CUDA_VISIBLE_DEVICES`, or None where there are none
    (no NVIDIA driver, no `nvidia-ml-py`, no visible GPU): the telemetry then says `n/a`."""
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            try:
                from vllm.third_party import pynvml as nvml  # the copy vLLM ships
            except ImportError:
                return None
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = None
    if visible_env is not None:
        visible = [d.strip() for d in visible_env.split(",") if d.strip()]
        if not visible:
            return None
    try:
        reader = NvmlGpuReader(nvml, visible)
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.info("no GPU telemetry (NVML unavailable: %s)", exc)
        return None
    return reader if reader.handles else None


# --------------------------------------------------------------------------- vLLM gauges


def read_vllm_gauges(registry: Any = None) -> EngineGauges | None:
    """vLLM's scheduler gauges from a Prometheus registry (the process's default one, where
    vLLM's `PrometheusStatLogger` registers them); None before an engine set them."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    found: dict[str, list[float]] = {}
    for metric in registry.collect():
        if metric.name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        ):
            found[metric.name] = [s.value for s in metric.samples if s.name == metric.name]
    if "vllm:num_requests_running" not in found:
        return None
    kv = found.get("vllm:kv_cache_usage_perc") or [0.0]
    return EngineGauges(
        running=sum(found["vllm:num_requests_running"]),
        waiting=sum(found.get("vllm:num_requests_waiting") or [0.0]),
        kv_cache_usage=max(kv),
    )


# --------------------------------------------------------------------------- sampler


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by nearest rank, as Prometheus summaries read."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass
class TelemetrySampler:
    """Samples GPUs and engine gauges on a thread; summarises any time window of them.

    Args:
        gpu_reader: Reads the GPUs (an `NvmlGpuReader`), or None without GPUs.
        engine_gauges: Returns vLLM's gauges now, or None when no engine has set them.
        interval: Seconds between samples.
        clock: Monotonic seconds (inject a fake one in tests).
    """

    gpu_reader: Any = None
    engine_gauges: Callable[[], EngineGauges | None] = read_vllm_gauges
    interval: float = DEFAULT_SAMPLE_SECONDS
    clock: Callable[[], float] = time.monotonic
    max_num_seqs: int | None = None
    # The engine serves pooling requests (embed, score, classify): see `engine_saturation`.
    pooling: bool = False
    samples: list[Sample] = field(default_factory=list)
    on_sample: Callable[[Sample], None] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sample_once(self) -> Sample:
        gpus: tuple[GpuSample, ...] = ()
        if self.gpu_reader is not None:
            try:
                gpus = self.gpu_reader.read()
            except Exception as exc:  # noqa: BLE001 - a GPU that fell off the bus, say
                log.warning("GPU telemetry stopped: NVML read failed: %s", exc)
                self.gpu_reader = None
        try:
            engine = self.engine_gauges()
        except Exception as exc:  # noqa: BLE001 - never fail inference over telemetry
            log.warning("engine telemetry read failed: %s", exc)
            engine = None
        sample = Sample(at=self.clock(), gpus=gpus, engine=engine)
        with self._lock:
            self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="gpuinfer-telemetry", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.gpu_reader is not None:
            self.gpu_reader.close()

    def window(self, start: float, end: float | None = None) -> list[Sample]:
        with self._lock:
            return [s for s in self.samples if s.at >= start and (end is None or s.at <= end)]

    def summarise(self, start: float, end: float | None = None) -> dict[str, Any]:
        """Telemetry of the samples in [start, end]; `n/a` for what was not measured."""
        samples = self.window(start, end)
        summary: dict[str, Any] = {"samples": len(samples)}
        summary.update(summarise_gpus(samples))
        summary.update(summarise_engine(samples, self.max_num_seqs, pooling=self.pooling))
        return summary


def summarise_gpus(samples: Sequence[Sample]) -> dict[str, Any]:
    per_gpu: dict[str, list[GpuSample]] = {}
    for sample in samples:
        for gpu in sample.gpus:
            per_gpu.setdefault(gpu.gpu, []).append(gpu)
    if not per_gpu:
        return {
            "gpu_utilization_mean": NOT_AVAILABLE,
            "gpu_utilization_p95": NOT_AVAILABLE,
            "gpu_memory_used_max_bytes": NOT_AVAILABLE,
            "gpus": {},
        }
    gpus = {}
    for name, series in per_gpu.items():
        utilization = [g.utilization_percent for g in series]
        memory = [g.memory_used_bytes for g in series]
        gpus[name] = {
            "utilization_mean": round(sum(utilization) / len(utilization), 2),
            "utilization_p95": round(percentile(utilization, 0.95), 2),
            "memory_used_mean_bytes": int(sum(memory) / len(memory)),
            "memory_used_max_bytes": max(memory),
            "memory_total_bytes": series[-1].memory_total_bytes,
        }
    all_utilization = [g.utilization_percent for series in per_gpu.values() for g in series]
    return {
        "gpu_utilization_mean": round(sum(all_utilization) / len(all_utilization), 2),
        "gpu_utilization_p95": round(percentile(all_utilization, 0.95), 2),
        "gpu_memory_used_max_bytes": max(v["memory_used_max_bytes"] for v in gpus.values()),
        "gpus": gpus,
    }


def engine_saturation(gauges: EngineGauges, max_num_seqs: int, *, pooling: bool) -> float:
    """How full the engine's batch is at one sample, 0 to 1.

    Generation: running requests over `max_num_seqs`. Pooling (embed, score, classify): a
    pooling request lives a single engine step, and vLLM's gauges are read between steps,
    where `running` is about 0 however busy the engine is; the requests queued for the next
    step (`waiting`, plus any running) capped at `max_num_seqs` are how full that step is.
    """
    held = gauges.running + gauges.waiting if pooling else gauges.running
    return min(held, max_num_seqs) / max_num_seqs if pooling else held / max_num_seqs


def summarise_engine(
    samples: Sequence[Sample], max_num_seqs: int | None, *, pooling: bool = False
) -> dict[str, Any]:
    """Mean saturation (`engine_saturation`), p95 KV-cache usage and mean waiting requests.

    KV-cache usage is `n/a` for pooling: its requests hold no KV cache between steps, so
    the gauge reads 0 at every sample, which says nothing about the engine."""
    engine = [s.engine for s in samples if s.engine is not None]
    if not engine:
        return {
            "engine_saturation_mean": NOT_AVAILABLE,
            "kv_cache_usage_p95": NOT_AVAILABLE,
            "requests_waiting_mean": NOT_AVAILABLE,
        }
    saturation: Any = NOT_AVAILABLE
    if max_num_seqs:
        per_sample = [engine_saturation(e, max_num_seqs, pooling=pooling) for e in engine]
        saturation = round(sum(per_sample) / len(per_sample), 4)
    kv: Any = NOT_AVAILABLE
    if not pooling:
        kv = round(percentile([e.kv_cache_usage for e in engine], 0.95), 6)
    return {
        "engine_saturation_mean": saturation,
        "kv_cache_usage_p95": kv,
        "requests_waiting_mean": round(sum(e.waiting for e in engine) / len(engine), 2),
    }
