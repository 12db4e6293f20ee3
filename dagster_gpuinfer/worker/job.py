"""A worker job: preflight every shard, load the model once, serve the run's shards.

A shard that cannot be processed (`ShardError`: missing, unreadable, missing a column) fails
that partition alone: it is reported and the run's other partitions go on. Shards that fail
their preflight never cost a model load; when every shard of the run fails it, none loads.

With `replicas=N > 1` the worker starts N engine processes, each pinned to its own devices
(`CUDA_VISIBLE_DEVICES` slice of `tensor_parallel_size` GPUs, or its own CPU cores), and
each takes whole shards from a shared queue: data parallel inside one worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest, committed_manifest
from dagster_gpuinfer.worker.engine import InferenceEngine, check_model_dir
from dagster_gpuinfer.worker.errors import ShardError, SpecError, WorkerError
from dagster_gpuinfer.worker.readers import ShardReader
from dagster_gpuinfer.worker.shard import process_shard

log = logging.getLogger("dagster_gpuinfer.worker")

USER_ERRORS: dict[str, type[WorkerError]] = {"ShardError": ShardError, "SpecError": SpecError}


class Reporter(Protocol):
    """Where the worker sends progress: Dagster Pipes in a run, stdout on the command line."""

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None: ...

    def partition_failed(self, exc: ShardError) -> None: ...

    def run_finished(self, summary: dict[str, Any]) -> None: ...


def run_job(spec: InferenceSpec, reporter: Reporter) -> dict[str, Any]:
    """Commit every partition of `spec.partition_keys` that can be; returns the run summary.

    Shards that cannot be processed go to `reporter.partition_failed` and the run goes on.

    Raises:
        WorkerError: the spec cannot run (model directory, arguments); retrying will not help.
    """
    started = time.perf_counter()
    check_model_dir(spec)
    todo: list[str] = []
    failed: list[str] = []

    def shard_failed(exc: ShardError, key: str) -> None:
        exc.partition_key = exc.partition_key or key
        log.error("partition %s failed, the run goes on without it: %s", exc.partition_key, exc)
        failed.append(exc.partition_key)
        reporter.partition_failed(exc)

    for key in spec.partition_keys:
        manifest = committed_manifest(spec, key)
        if manifest is not None:
            reporter.partition_committed(manifest, computed=False)
            continue
        try:
            ShardReader(spec, key).preflight()
        except ShardError as exc:
            shard_failed(exc, key)
            continue
        todo.append(key)

    replicas = min(spec.replicas, len(todo))
    load_seconds: list[float] = []
    if replicas == 1:
        engine = InferenceEngine(spec)
        load_seconds.append(engine.load_seconds)
        try:
            for key in todo:
                try:
                    manifest, computed = process_shard(engine, spec, key)
                except ShardError as exc:
                    shard_failed(exc, key)
                    continue
                reporter.partition_committed(manifest, computed=computed)
        finally:
            engine.shutdown()
    elif replicas > 1:
        load_seconds = run_replicas(
            spec, todo, replicas, reporter.partition_committed, on_failed=shard_failed
        )
    computed_keys = [key for key in todo if key not in failed]
    summary = {
        "partitions": len(spec.partition_keys),
        "partitions_computed": len(computed_keys),
        "partitions_failed": len(failed),
        "partitions_skipped": len(spec.partition_keys) - len(computed_keys) - len(failed),
        "replicas": replicas,
        "model_loads": len(load_seconds),
        "model_load_seconds": round(max(load_seconds), 3) if load_seconds else 0.0,
        "wall_seconds": round(time.perf_counter() - started, 3),
    }
    reporter.run_finished(summary)
    return summary


# --------------------------------------------------------------------------- placement


def detect_device() -> str:
    """`cuda` when a GPU is visible to torch, else `cpu`. `GPUINFER_DEVICE` overrides."""
    forced = os.environ.get("GPUINFER_DEVICE")
    if forced:
        return forced
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def visible_gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_replica_env(
    *, replicas: int, tensor_parallel_size: int, device: str, gpu_ids: list[str], cpu_ids: list[int]
) -> list[dict[str, str]]:
    """The environment of each replica: which GPUs, or which CPU cores, it may use.

    A pure function: GPU replica i gets GPUs [i*tp, (i+1)*tp) of the visible ones; CPU
    replicas split the cores (vLLM's `VLLM_CPU_OMP_THREADS_BIND`, one range per TP rank
    separated by `|`), sharing cores round-robin when there are fewer cores than ranks.

    Raises:
        SpecError: a GPU worker sees fewer GPUs than replicas x tensor_parallel_size.
    """
    ranks = replicas * tensor_parallel_size
    if device == "cuda":
        if len(gpu_ids) < ranks:
            raise SpecError(
                f"replicas={replicas} x tensor_parallel_size={tensor_parallel_size} needs "
                f"{ranks} GPUs but this worker sees {len(gpu_ids)} ({','.join(gpu_ids) or 'none'}"
                "). Lower replicas or tensor_parallel_size, or request more GPUs per pod"
            )
        return [
            {
                "CUDA_VISIBLE_DEVICES": ",".join(
                    gpu_ids[i * tensor_parallel_size : (i + 1) * tensor_parallel_size]
                )
            }
            for i in range(replicas)
        ]
    cores = sorted(cpu_ids)
    if len(cores) >= ranks:
        per_rank = len(cores) // ranks
        groups = [cores[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]
    else:
        groups = [[cores[r % len(cores)]] for r in range(ranks)]
    envs = []
    for i in range(replicas):
        rank_groups = groups[i * tensor_parallel_size : (i + 1) * tensor_parallel_size]
        bind = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in rank_groups)
        envs.append({"VLLM_CPU_OMP_THREADS_BIND": bind})
    return envs


# --------------------------------------------------------------------------- replicas


def run_replicas(
    spec: InferenceSpec,
    partition_keys: list[str],
    replicas: int,
    on_committed: Callable[..., None],
    on_failed: Callable[[ShardError, str], None],
) -> list[float]:
    """Serve `partition_keys` with `replicas` engine processes; returns their load seconds.

    A shard a replica cannot process goes to `on_failed`; the replica takes the next one.
    """
    device = detect_device()
    envs = plan_replica_env(
        replicas=replicas,
        tensor_parallel_size=spec.tensor_parallel_size,
        device=device,
        gpu_ids=visible_gpu_ids() if device == "cuda" else [],
        cpu_ids=sorted(os.sched_getaffinity(0)),
    )
    ctx = mp.get_context("spawn")
    tasks: Any = ctx.Queue()
    results: Any = ctx.Queue()
    for key in partition_keys:
        tasks.put(key)
    for _ in range(replicas):
        tasks.put(None)
    spec_json = spec.model_dump_json()
    processes = [
        ctx.Process(
            target=replica_main,
            args=(spec_json, index, envs[index], tasks, results),
            name=f"gpuinfer-replica-{index}",
            daemon=False,  # each replica starts vLLM's own engine process
        )
        for index in range(replicas)
    ]
    for process in processes:
        process.start()
    load_seconds: list[float] = []
    pending = set(partition_keys)
    finished_replicas = 0
    try:
        while finished_replicas < replicas:
            try:
                message = results.get(timeout=5)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"replica process {dead[0].name} died with exit code {dead[0].exitcode} "
                        f"before finishing; partitions not committed: {sorted(pending)}"
                    ) from None
                continue
            kind = message[0]
            if kind == "loaded":
                load_seconds.append(message[2])
            elif kind == "committed":
                manifest = Manifest.model_validate_json(message[2])
                pending.discard(manifest.partition_key)
                on_committed(manifest, computed=message[3])
            elif kind == "finished":
                finished_replicas += 1
            elif kind == "shard_error":
                _, _, text, key = message
                pending.discard(key)
                on_failed(ShardError(text, partition_key=key), key)
            elif kind == "user_error":
                _, _, error_class, text, key = message
                raise USER_ERRORS.get(error_class, WorkerError)(text, partition_key=key)
            else:  # "crashed"
                raise RuntimeError(f"replica {message[1]} failed:\n{message[2]}")
    except BaseException:
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    if pending:
        raise RuntimeError(
            f"replicas finished but partitions were not committed: {sorted(pending)}"
        )
    return load_seconds


def replica_main(spec_json: str, index: int, env: dict[str, str], tasks: Any, results: Any) -> None:
    """Body of one replica process: pin devices, build one engine, take shards until done."""
    os.environ.update(env)
    logging.basicConfig(level=logging.INFO, format=f"[replica {index}] %(message)s")
    spec = InferenceSpec.model_validate_json(spec_json)
    engine = None
    try:
        engine = InferenceEngine(spec)
        results.put(("loaded", index, engine.load_seconds))
        while True:
            key = tasks.get()
            if key is None:
                break
            try:
                manifest, computed = process_shard(engine, spec, key, replica=index)
            except ShardError as exc:
                results.put(("shard_error", index, str(exc), exc.partition_key or key))
                continue
            results.put(("committed", index, manifest.model_dump_json(), computed))
        results.put(("finished", index))
    except WorkerError as exc:
        results.put(("user_error", index, type(exc).__name__, str(exc), exc.partition_key))
    except BaseException:
        results.put(("crashed", index, traceback.format_exc()))
    finally:
        if engine is not None:
            engine.shutdown()
