"""The vLLM engine of one replica: built once per worker (or replica), used for every shard.

This is the only module that imports vllm, and it does so when an engine is built, so the
worker can preflight its shards (and skip finished ones) without paying for the import.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dagster_gpuinfer.out_of_memory import memory_problem
from dagster_gpuinfer.spec import POOLING_TASKS, InferenceSpec
from dagster_gpuinfer.worker.completions import choices_of
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
    choices: list[list[dict[str, Any]]] | None = None  # every choice of each row (n >= 1)
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


def engine_kwargs(spec: InferenceSpec) -> dict[str, Any]:
    """The keyword arguments `vllm.LLM` gets for `spec` (besides `model`); the benchmark
    gives the raw engine the very same ones."""
    kwargs = spec.engine.to_vllm_kwargs()
    kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.task in POOLING_TASKS:
        kwargs["runner"] = "pooling"
    return kwargs


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
        from vllm import LLM

        self.spec = spec
        kwargs = engine_kwargs(spec)
        started = time.perf_counter()
        try:
            self.llm = LLM(model=os.path.expanduser(spec.model.removeprefix("file://")), **kwargs)
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
        self.requests = request_builder(spec, self.llm)
        self.sampling_params = None
        if spec.task not in POOLING_TASKS:
            from dagster_gpuinfer.worker.request_params import ParameterError

            try:
                self.sampling_params = self.requests.build(None).sampling
            except ParameterError as exc:
                self.shutdown()
                raise SpecError(f"the pipeline's sampling parameters: {exc}") from None
        load_log = os.environ.get(LOAD_LOG_ENV)
        if load_log:
            with open(load_log, "a") as handle:
                handle.write(f"{os.getpid()}\t{spec.model}\n")
        log.info("engine ready in %.1fs (max_model_len=%d)", self.load_seconds, self.max_model_len)

    def run(self, token_ids: list[list[int]], requests: list[Any] | None = None) -> ChunkResult:
        """Run the task over pre-tokenized prompts; returns results in the same order.

        `requests[i]` (a `request_params.RowRequest`) carries row i's own sampling parameters
        and logprobs; without them every row runs the pipeline's defaults.
        """
        if not token_ids:
            return ChunkResult(
                embeddings=np.zeros((0, 0), np.float32) if self.spec.task == "embed" else None,
                texts=[],
                finish_reasons=[],
                prompt_tokens=[],
                generated_tokens=[],
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
        sampling: Any = self.sampling_params
        if requests is not None:
            sampling = [requests[i].sampling or self.sampling_params for i in order]
        submitted = self.llm.generate([prompts[i] for i in order], sampling, use_tqdm=False)
        outputs: list[Any] = [None] * len(prompts)
        for position, output in zip(order, submitted, strict=True):
            outputs[position] = output  # back to input order: results stay keyed by row
        top = [r.top_logprobs for r in requests] if requests else [None] * len(outputs)
        choices = [choices_of(o, k) for o, k in zip(outputs, top, strict=True)]
        return ChunkResult(
            texts=[c[0]["text"] for c in choices],
            finish_reasons=[c[0]["finish_reason"] for c in choices],
            prompt_tokens=[len(o.prompt_token_ids or ()) for o in outputs],
            generated_tokens=[sum(choice["generated_tokens"] for choice in c) for c in choices],
            cached_tokens=[o.num_cached_tokens or 0 for o in outputs],
            choices=choices,
            seconds=time.perf_counter() - started,
        )

    def shutdown(self) -> None:
        """Stop the engine's processes now; left to garbage collection they can hang at exit."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


def request_builder(spec: InferenceSpec, llm: Any) -> Any:
    """Builds each row's request from its parameters, checked against this engine."""
    from dagster_gpuinfer.worker.request_params import RequestBuilder

    config = llm.llm_engine.vllm_config
    tokenizer = llm.get_tokenizer()

    def verify(params: Any) -> None:
        params.verify(
            config.model_config,
            config.speculative_config,
            config.structured_outputs_config,
            tokenizer,
        )

    defaults = spec.sampling.to_vllm_kwargs() if spec.task not in POOLING_TASKS else {}
    return RequestBuilder(task=spec.task, defaults=defaults, verify=verify)


def _is_memory_error(message: str) -> bool:
    return memory_problem(message) is not None
