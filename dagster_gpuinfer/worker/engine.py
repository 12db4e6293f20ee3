"""The vLLM engine of one replica: built once per worker (or replica), used for every shard.

This is the only module that imports vllm, and it does so when an engine is built, so the
worker can preflight its shards (and skip finished ones) without paying for the import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.worker.errors import SpecError

log = logging.getLogger("dagster_gpuinfer.worker")

# Written once per engine built when set: lets tests and benchmarks count model loads from
# outside the worker (a line per load: pid and model).
LOAD_LOG_ENV = "GPUINFER_MODEL_LOAD_LOG"


@dataclass
class ChunkResult:
    """Engine output for the rows of one chunk, in input order."""

    embeddings: np.ndarray | None = None  # (rows, dim) float32, for embed
    texts: list[str] | None = None
    finish_reasons: list[str | None] | None = None
    prompt_tokens: list[int] | None = None
    generated_tokens: list[int] | None = None
    cached_tokens: list[int] | None = None  # prompt tokens served from vLLM's prefix cache
    seconds: float = 0.0


def check_model_dir(spec: InferenceSpec) -> None:
    """A model given as a local path must be a directory with a `config.json`."""
    if not spec.model_is_local_path():
        return
    path = os.path.expanduser(spec.model.removeprefix("file://"))
    if not os.path.isdir(path):
        raise SpecError(
            f"model directory {spec.model!r} does not exist. Point `model` at a directory "
            "with config.json and weights (in a pod: under the model cache mount)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SpecError(
            f"model directory {spec.model!r} has no config.json, so it is not a Hugging Face "
            "model folder vLLM can load. Point `model` at the folder holding config.json"
        )


# Set by the worker for CPU replicas (`job.plan_replica_env`) or by a user who pins cores
# themselves: then vLLM's own CPU process layout and pinning are kept as they are.
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _on_cpu() -> bool:
    forced = os.environ.get("GPUINFER_DEVICE")
    if forced:
        return forced == "cpu"
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _single_process_cpu_engine(spec: InferenceSpec, kwargs: dict[str, Any]) -> bool:
    """Whether the engine gets the platform's CPU layout (see `engine_kwargs`)."""
    return (
        spec.tensor_parallel_size == 1
        and "distributed_executor_backend" not in kwargs
        and CPU_BIND_ENV not in os.environ
        and _on_cpu()
    )


def engine_kwargs(spec: InferenceSpec, *, platform_defaults: bool = True) -> dict[str, Any]:
    """The keyword arguments `vllm.LLM` gets for `spec` (besides `model`).

    On a CPU with one rank, the platform runs the model inside vLLM's engine-core process
    (`distributed_executor_backend="uni"`) instead of vLLM's CPU default of a third process
    (executor "mp") pinned to all cores but one: one process fewer to spawn and import
    (engine start about 5-20 s shorter on 2 cores) and no hop between scheduler and model
    (measured in bench/results). `engine_env` keeps vLLM's one core for the frontend.
    `platform_defaults=False` gives vLLM's own defaults (the benchmark compares both).
    """
    kwargs = spec.engine.to_vllm_kwargs()
    kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.task == "embed":
        kwargs["runner"] = "pooling"
    if platform_defaults and _single_process_cpu_engine(spec, kwargs):
        kwargs["distributed_executor_backend"] = "uni"
    return kwargs


def engine_env(spec: InferenceSpec, *, platform_defaults: bool = True) -> dict[str, str]:
    """Environment variables the engine's processes start with (set while it is built).

    With the CPU layout of `engine_kwargs`, the model's OpenMP threads are all cores but one
    (what vLLM's own `auto` binding gives the model; the spare core runs the frontend and
    tokenization), unless `OMP_NUM_THREADS` is already set.
    """
    kwargs = spec.engine.to_vllm_kwargs()
    if not platform_defaults or "OMP_NUM_THREADS" in os.environ:
        return {}
    if not _single_process_cpu_engine(spec, kwargs):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) - 1))}


def prefix_order(token_ids: list[list[int]]) -> list[int]:
    """Row positions sorted by their token ids, so rows sharing a prompt prefix are adjacent.

    Sorting token-id lists lexicographically puts every group of prompts with a common
    header (system prompt, few-shot examples) next to each other, longest shared prefixes
    closest, which is the order in which vLLM's prefix cache serves them best.
    """
    return sorted(range(len(token_ids)), key=token_ids.__getitem__)


class InferenceEngine:
    """A vLLM `LLM` configured from the spec, with the task's one call."""

    # Generation submits a chunk's prompts grouped by shared prefix (see `prefix_order`)
    # and restores input order after; the benchmark turns it off to measure the gain.
    group_prefixes: bool = True

    def __init__(self, spec: InferenceSpec) -> None:
        check_model_dir(spec)
        from vllm import LLM, SamplingParams

        self.spec = spec
        kwargs = engine_kwargs(spec)
        env = engine_env(spec)
        started = time.perf_counter()
        try:
            with _environment(env):  # inherited by the engine processes vLLM spawns
                self.llm = LLM(
                    model=os.path.expanduser(spec.model.removeprefix("file://")), **kwargs
                )
        except (OSError, ValueError) as exc:
            message = str(exc)
            if _is_memory_error(message):
                raise  # transient for the control plane: it may step memory knobs down
            raise SpecError(
                f"vLLM could not load model {spec.model!r} with engine arguments {kwargs}: "
                f"{message.splitlines()[0] if message else type(exc).__name__}"
            ) from exc
        self.load_seconds = time.perf_counter() - started
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.sampling_params = (
            SamplingParams(**spec.sampling.to_vllm_kwargs()) if spec.task != "embed" else None
        )
        load_log = os.environ.get(LOAD_LOG_ENV)
        if load_log:
            with open(load_log, "a") as handle:
                handle.write(f"{os.getpid()}\t{spec.model}\n")
        log.info("engine ready in %.1fs (max_model_len=%d)", self.load_seconds, self.max_model_len)

    def run(self, token_ids: list[list[int]]) -> ChunkResult:
        """Run the task over pre-tokenized prompts; returns results in the same order."""
        if not token_ids:
            return ChunkResult(
                embeddings=np.zeros((0, 0), np.float32) if self.spec.task == "embed" else None,
                texts=[], finish_reasons=[], prompt_tokens=[], generated_tokens=[],
            )
        prompts: list[Any] = [{"prompt_token_ids": ids} for ids in token_ids]
        started = time.perf_counter()
        if self.spec.task == "embed":
            outputs = self.llm.embed(prompts, use_tqdm=False)
            embeddings = np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
            return ChunkResult(
                embeddings=embeddings,
                prompt_tokens=[len(ids) for ids in token_ids],
                generated_tokens=[0] * len(token_ids),
                seconds=time.perf_counter() - started,
            )
        order = prefix_order(token_ids) if self.group_prefixes else list(range(len(prompts)))
        submitted = self.llm.generate(
            [prompts[i] for i in order], self.sampling_params, use_tqdm=False
        )
        outputs: list[Any] = [None] * len(prompts)
        for position, output in zip(order, submitted, strict=True):
            outputs[position] = output  # back to input order: results stay keyed by row
        return ChunkResult(
            texts=[o.outputs[0].text for o in outputs],
            finish_reasons=[o.outputs[0].finish_reason for o in outputs],
            prompt_tokens=[len(o.prompt_token_ids or ()) for o in outputs],
            generated_tokens=[len(o.outputs[0].token_ids) for o in outputs],
            cached_tokens=[o.num_cached_tokens or 0 for o in outputs],
            seconds=time.perf_counter() - started,
        )

    def shutdown(self) -> None:
        """Stop the engine's processes now; left to garbage collection they can hang at exit."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _is_memory_error(message: str) -> bool:
    lowered = message.lower()
    return any(
        marker in lowered
        for marker in ("out of memory", "kv cache", "insufficient memory", "not enough memory")
    )
