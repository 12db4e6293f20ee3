"""Benchmark 4: worker memory over a very large shard stays bounded by the chunk size.

One Dagster run materializes one shard of `memory_rows` short rows (1,000,000 in the full
run) with the tiny Llama (`generate`, one new token per row, so the engine's work per row is
small and the worker's own streaming dominates). A sampler polls the RSS of the worker
process (reader, validator, tokenizer, writer, vLLM's frontend) and, apart, of the engine
processes it spawned. The worker's baseline is its RSS when the engine is ready (the load
log line appears); the claim checked is that what it adds over the shard stays small.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.context import KV_CACHE_BYTES, BenchContext
from bench.platform_run import PlatformPipeline, local_resource
from bench.workloads import write_large_shard
from dagster_gpuinfer import EngineArgs, SamplingParams

log = logging.getLogger("bench")
MIB = 1 << 20


class RssSampler(threading.Thread):
    """Samples the worker process tree under this process every `interval` seconds."""

    def __init__(self, load_log: Path, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.load_log = load_log
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.ready_at: float | None = None
        self._halt = threading.Event()
        self.started = time.perf_counter()

    def run(self) -> None:
        me = psutil.Process()
        while not self._halt.is_set():
            worker_rss = engine_rss = 0
            try:
                for proc in me.children(recursive=True):
                    try:
                        cmdline = " ".join(proc.cmdline())
                        if "dagster_gpuinfer.worker" in cmdline:
                            worker_rss += proc.memory_info().rss
                            for child in proc.children(recursive=True):
                                engine_rss += child.memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        continue
            except psutil.Error:
                pass
            now = time.perf_counter() - self.started
            if self.ready_at is None and self.load_log.exists() and self.load_log.stat().st_size:
                self.ready_at = now
            if worker_rss:
                self.samples.append(
                    {"t": now, "worker_mib": worker_rss / MIB, "engine_mib": engine_rss / MIB}
                )
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def run_memory(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir("memory")
    shard = write_large_shard(root / "inputs" / "big.parquet", sizes.memory_rows)
    results = []
    for chunk_size in sizes.memory_chunk_sizes:
        load_log = root / f"loads-{chunk_size}.log"
        resource = local_resource(
            env={**ctx.engine_env(), "GPUINFER_MODEL_LOAD_LOG": str(load_log)}
        )
        pipeline = PlatformPipeline(
            name=f"memory_{chunk_size}",
            model=ctx.generate_model(),
            task="generate",
            input_uri=str(root / "inputs" / "{partition_key}.parquet"),
            root=root / f"c{chunk_size}",
            keys=["big"],
            resource=resource,
            engine=EngineArgs(max_model_len=64, extra={"kv_cache_memory_bytes": KV_CACHE_BYTES}),
            sampling=SamplingParams(temperature=0.0, max_tokens=1),
            chunk_size=chunk_size,
        )
        sampler = RssSampler(load_log)
        sampler.start()
        try:
            timing = pipeline.run(["big"])
        finally:
            sampler.stop()
        samples = sampler.samples
        ready = sampler.ready_at or 0.0
        after_ready = [s for s in samples if s["t"] >= ready] or samples
        baseline = after_ready[0]["worker_mib"] if after_ready else float("nan")
        peak_worker = max((s["worker_mib"] for s in samples), default=float("nan"))
        peak_engine = max((s["engine_mib"] for s in samples), default=float("nan"))
        row = {
            "chunk_size": chunk_size,
            "rows": timing.rows,
            "shard_mib": shard.stat().st_size / MIB,
            "partition_seconds": timing.partition_seconds["big"],
            "worker_mib_at_engine_ready": baseline,
            "worker_peak_mib": peak_worker,
            "worker_growth_mib": peak_worker - baseline,
            "engine_peak_mib": peak_engine,
            "samples": samples,
            "engine_ready_t": ready,
        }
        log.info(
            "memory chunk %d: %d rows in %.0fs, worker %.0f MiB at ready, peak %.0f MiB",
            chunk_size,
            timing.rows,
            row["partition_seconds"],
            baseline,
            peak_worker,
        )
        results.append(row)
        pipeline.clear_outputs()
    return {"rows": sizes.memory_rows, "settings": results}
