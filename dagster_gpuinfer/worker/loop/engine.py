"""The vLLM engine of one replica: built once per worker (or replica), used for every shard.

This is the only module that imports vllm, and it does so when an engine is built, so the
worker can preflight its shards (and skip finished ones) without paying for the import.

A pool worker (`worker/pool/`) keeps one engine across jobs: `InferenceEngine.bind(spec)`
points a built engine at another job's spec (sampling defaults, limits, window, task) as
long as that spec needs the same engine (`same_engine`), and `abort_in_flight` clears what
a stopped loop left in it before the next job's loop starts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from dagster_gpuinfer.out_of_memory import memory_problem
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.errors import SpecError
from dagster_gpuinfer.worker.lifecycle import EngineWatch, engine_processes_started_by
from dagster_gpuinfer.worker.loop.adapters import (
    BASE_ADAPTER,
    AdapterIds,
    check_local_adapters,
    ready_adapters,
    resolve_cpu_lora,
    zeroed_adapter,
)
from dagster_gpuinfer.worker.loop.cpu_dtype import resolve_cpu_dtype
from dagster_gpuinfer.worker.loop.cpu_seeds import resolve_cpu_chunked_prefill, seeds_unsafe
from dagster_gpuinfer.worker.metrics import current_metrics
from dagster_gpuinfer.worker.rows.request_params import AdapterNames, RequestBuilder
from dagster_gpuinfer.worker.stage_messages import RequestRejected
from dagster_gpuinfer.worker.tasks.image import vllm_prompt
from dagster_gpuinfer.worker.tasks.image_fit import model_image_fit
from dagster_gpuinfer.worker.tasks.params import SEED_REFUSED
from dagster_gpuinfer.worker.tasks.table import worker_task

log = logging.getLogger("dagster_gpuinfer.worker")

# Written once per engine built when set: lets tests and benchmarks count model loads from
# outside the worker (a line per load: pid and model).
LOAD_LOG_ENV = "GPUINFER_MODEL_LOAD_LOG"
# Seconds the engine process gets to exit at shutdown before it is killed.
SHUTDOWN_GRACE_ENV = "GPUINFER_ENGINE_SHUTDOWN_GRACE_SECONDS"
DEFAULT_SHUTDOWN_GRACE_SECONDS = 1.0


def check_model_dir(spec: InferenceSpec) -> None:
    """A model given as a local path must be a directory with a `config.json`; a local
    LoRA adapter a PEFT adapter folder the engine takes (`adapters.check_local_adapters`)."""
    check_local_adapters(spec)
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
    for name, value in spec.lora_engine_kwargs().items():  # LoRA adapters listed
        kwargs.setdefault(name, value)
    kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.pipeline_parallel_size > 1:
        kwargs["pipeline_parallel_size"] = spec.pipeline_parallel_size
    if spec.nodes > 1:
        kwargs.update(leader_kwargs(spec))
    if task_facts(spec.task).pooling:
        kwargs["runner"] = task_facts(spec.task).runner
    if task_facts(spec.task).images:  # images per request: vLLM's limit, the same as ours
        kwargs.setdefault(
            "limit_mm_per_prompt", {"image": spec.input.images.max_images_per_request}
        )
    kwargs.setdefault(
        "disable_log_stats", False
    )  # vLLM's own Prometheus metrics: worker/metrics.py
    return kwargs


def built_engine_kwargs(spec: InferenceSpec) -> dict[str, Any]:
    """What the worker passes to `vllm.LLM` for `spec`: `engine_kwargs` with compact JSON
    outputs, the CPU build's dtype (`worker/loop/cpu_dtype.py`) and, on the CPU build, no
    chunked prefill for sampling tasks (`worker/loop/cpu_seeds.py`) and a LoRA slot for
    base rows (`worker/loop/adapters.py`). It asks vLLM which
    platform it runs on, so call it where vLLM is imported anyway; the benchmark gives raw
    vLLM the same."""
    kwargs = with_compact_json(spec, engine_kwargs(spec))
    kwargs = resolve_cpu_chunked_prefill(kwargs, samples=task_facts(spec.task).samples)
    kwargs = resolve_cpu_lora(kwargs)
    return resolve_cpu_dtype(kwargs, spec.model)


def with_compact_json(spec: InferenceSpec, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with structured JSON outputs compact by default (vLLM's
    `disable_any_whitespace`, an engine setting): with vLLM's default grammar a weak model
    pads an object with whitespace until `max_tokens`. vLLM takes the setting only with the
    xgrammar or guidance backend, so the default is xgrammar (a row asking for what xgrammar
    cannot do is refused for that row at parameter time). Opt out with engine.extra
    `structured_outputs_config={"disable_any_whitespace": False}` (or another backend)."""
    if task_facts(spec.task).pooling:
        return kwargs
    config = kwargs.get("structured_outputs_config")
    if config is None:
        config = {}
    if not isinstance(config, dict) or "disable_any_whitespace" in config:
        return kwargs
    backend = config.get("backend", "xgrammar")
    if backend not in ("xgrammar", "guidance"):
        return kwargs
    compact = {**config, "backend": backend, "disable_any_whitespace": True}
    return {**kwargs, "structured_outputs_config": compact}


# The leader's address and port, set by the pod group (k8s/group.py) in every pod of it.
MASTER_ADDR_ENV = "GPUINFER_MASTER_ADDR"
MASTER_PORT_ENV = "GPUINFER_MASTER_PORT"
DEFAULT_MASTER_PORT = 29500


def leader_kwargs(spec: InferenceSpec) -> dict[str, Any]:
    """vLLM's multi-node arguments of the leader (node rank 0) of an engine across
    `spec.nodes` pods; the followers run `worker/follower.py` with the same address.

    Raises:
        SpecError: the leader's address is not in the environment (not run by a pod group).
    """
    master_addr = os.environ.get(MASTER_ADDR_ENV)
    if not master_addr:
        raise SpecError(
            f"the spec spans nodes={spec.nodes} pods but {MASTER_ADDR_ENV} is not set: the "
            "leader of a pod group needs the address its followers reach it at. Launch "
            "multi-node specs through the k8s launcher (k8s.group builds the group), or set "
            f"{MASTER_ADDR_ENV} and {MASTER_PORT_ENV} and start the followers yourself"
        )
    return {
        "nnodes": spec.nodes,
        "node_rank": 0,
        "master_addr": master_addr,
        "master_port": int(os.environ.get(MASTER_PORT_ENV, DEFAULT_MASTER_PORT)),
        "distributed_executor_backend": "mp",
    }


def load_llm(spec: InferenceSpec) -> tuple[Any, list[Any]]:
    """`vllm.LLM` for `spec`, and the engine processes it started (`EngineWatch` them).

    Raises:
        SpecError: vLLM cannot load the model with these arguments; retrying will not help.
        OSError, ValueError: out of memory (the control plane may step memory down).
    """
    from vllm import LLM

    kwargs = built_engine_kwargs(spec)
    model = os.path.expanduser(spec.model.removeprefix("file://"))
    try:
        return engine_processes_started_by(lambda: LLM(model=model, **kwargs))
    except (OSError, ValueError) as exc:
        current_metrics().model_load_failed(exc)
        message = str(exc)
        if _is_memory_error(message):
            raise  # transient for the control plane: it may step memory knobs down
        raise SpecError(
            f"vLLM could not load model {spec.model!r} with engine arguments {kwargs}: "
            f"{message.splitlines()[0] if message else type(exc).__name__}"
        ) from exc


class InferenceEngine:
    """A vLLM engine configured from the spec, fed one request at a time.

    The worker keeps a bounded window of requests in flight (`submit` while
    `in_flight < window`, `step` to advance and collect the finished ones), across chunk and
    shard boundaries, so the engine never drains to a chunk's slowest row. This is what
    `LLM.generate` does inside (`LLMEngine.add_request` + `LLMEngine.step`), minus the
    barrier at the end of each call.

    Args:
        spec: The job spec; `spec.max_requests_in_flight` sets the window (default
            `WINDOW_PER_MAX_NUM_SEQS` x the engine's `max_num_seqs`).
    """

    WINDOW_PER_MAX_NUM_SEQS = 2

    def __init__(
        self, spec: InferenceSpec, *, on_death: Callable[[str], None] | None = None
    ) -> None:
        check_model_dir(spec)
        started = time.perf_counter()  # the build counts vllm's import (seconds, once)
        self.spec = spec
        self.task = worker_task(spec.task)
        self.watch: EngineWatch | None = None
        # Sequences in flight by request: a row asking for `n` completions is n sequences to
        # the engine's batch, so the window counts them, not rows.
        self._in_flight: dict[str, int] = {}
        self._sequences = 0
        self._binding = 0  # bumped by `bind`: request ids of one binding never meet another's
        self._adapter_ids = AdapterIds()  # LoRA ids for the life of the engine
        self.llm, processes = load_llm(spec)
        self.load_seconds = time.perf_counter() - started
        # The engine's processes run from here on: whatever fails before the engine is handed
        # over shuts them down, so a failed start leaves no engine behind.
        try:
            # A dead engine process fails the worker within seconds (never a wait for ever):
            # `on_death` (default: `lifecycle.engine_died`, which exits) hears of it.
            self.watch = EngineWatch(
                processes, name=f"model {spec.model!r}", on_death=on_death
            ).start()
            self._configure(spec)
        except BaseException:
            self._shutdown_after_failed_start()
            raise
        log.info(
            "engine ready in %.1fs (max_model_len=%d, max_num_seqs=%d, window=%d)",
            self.load_seconds,
            self.max_model_len,
            self.max_num_seqs,
            self.window,
        )

    def _configure(self, spec: InferenceSpec) -> None:
        """What the worker reads from the loaded engine (limits, tokenizer, renderer), then
        what it reads from the spec for it (`_bind_spec`).

        Raises:
            SpecError: the spec asks for what this engine cannot do (a seed on a build
                where seeds are not reproducible).
        """
        from vllm.sampling_params import RequestOutputKind

        current_metrics().model_loaded(
            self.load_seconds,
            max_num_seqs=self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.max_num_seqs = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        # The KV cache's block: the prefix cache reuses whole blocks (`stream.prefix_order`).
        self.block_size = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        self._final_only = RequestOutputKind.FINAL_ONLY
        # vLLM's renderer (input processing: for image tasks the model's HF image processor),
        # for `render` from the render thread; None in a vLLM without one: `submit` renders.
        self._renderer = getattr(self.llm, "renderer", None)
        if self._renderer is not None:
            from vllm.renderers.inputs.preprocess import parse_model_prompt

            self._parse_prompt = parse_model_prompt
        self._bind_spec(spec)
        load_log = os.environ.get(LOAD_LOG_ENV)
        if load_log:
            with open(load_log, "a") as handle:
                handle.write(f"{os.getpid()}\t{spec.model}\n")

    def _bind_spec(self, spec: InferenceSpec) -> None:
        """What the worker reads from the spec for this engine: the task, the request
        builder (sampling defaults, limits), the window, image fit and default params.

        Raises:
            SpecError: a seed on a build where seeds are not reproducible.
        """
        requests = request_builder(spec, self.llm)
        if requests.refuse_seeds and requests.defaults.get("seed") is not None:
            raise SpecError(f"sampling.seed is {requests.defaults['seed']}: {SEED_REFUSED}")
        # LoRA adapters: fetched (s3://) and checked before any row names one; on the CPU
        # build base rows run on a zeroed adapter (`adapters.resolve_cpu_lora`).
        ready = ready_adapters(spec)
        if ready and runs_base_on_zero_adapter(self.llm):
            ready[BASE_ADAPTER] = zeroed_adapter(next(iter(ready.values())))
        self.lora_requests = self._adapter_ids.requests(ready)
        self.spec = spec
        self.task = worker_task(spec.task)
        self.requests = requests
        self.window = (
            spec.max_requests_in_flight or self.WINDOW_PER_MAX_NUM_SEQS * self.max_num_seqs
        )
        # Image tasks: the model's image resize, for the decoder's pool when it is exact.
        self.image_fit = model_image_fit(self.llm) if task_facts(spec.task).images else None
        if self.image_fit is not None:
            log.info("images are resized to the model's input size in the decoder's pool")
        # Tasks that stream (`facts.streams`) submit requests with these defaults; score and
        # classify run whole chunks through `LLM.score` / `LLM.classify` (`run_chunk`).
        self.default_params: Any = self.task.default_params(self)

    def bind(self, spec: InferenceSpec) -> None:
        """Serve `spec` from now on with this built engine (a pool worker's next job):
        sampling defaults, limits, window and task are read from `spec` again; the vLLM
        engine stays as built.

        Raises:
            SpecError: `spec` needs another engine (`same_engine` says why), or asks for
                what this engine cannot do (a seed where seeds are not reproducible). The
                engine stays bound to its previous spec.
            RuntimeError: requests are still in flight (`abort_in_flight` first).
        """
        if self._in_flight:
            raise RuntimeError(
                f"cannot bind a new spec with {len(self._in_flight)} requests in flight; "
                "call abort_in_flight() after a stopped loop"
            )
        problem = same_engine(self.spec, spec)
        if problem is not None:
            raise SpecError(
                f"this pool worker's engine cannot serve the spec: {problem}. The job was "
                "submitted to the wrong pool; submit it under pool_key(spec)"
            )
        bound = {name: getattr(self, name) for name in _BOUND}
        try:
            self._bind_spec(spec)
        except BaseException:
            for name, value in bound.items():  # still bound to the previous spec
                setattr(self, name, value)
            raise
        self._binding += 1

    def abort_in_flight(self) -> int:
        """Abort every request in flight (a loop stopped mid-window left them); returns how
        many. The engine serves the next binding with an empty batch."""
        request_ids = list(self._in_flight)
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)
        self._in_flight.clear()
        self._sequences = 0
        return len(request_ids)

    def _shutdown_after_failed_start(self) -> None:
        """`shutdown`, for an engine whose start failed: a failure of the shutdown itself is
        logged, so the caller sees why the start failed."""
        try:
            self.shutdown()
        except Exception:
            log.exception(
                "could not shut down the engine of model %r after its start failed", self.spec.model
            )

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet finished (a request with `n` > 1 counts n)."""
        return self._sequences

    @property
    def renders(self) -> bool:
        """Whether `render` can prepare requests ahead of `submit` (vLLM 0.32's renderer)."""
        return self._renderer is not None

    def render(self, token_ids: list[int], images: list[Any] | None) -> Any:
        """vLLM's input processing of one prompt (for image prompts the model's image
        processor: resizing, patches, placeholder tokens), done where the caller runs: the
        loop's render thread, off the thread that steps the engine. This is what vLLM's own
        offline pooling does (`Renderer.render_cmpl` in the renderer's executor while the
        engine steps); `submit(..., rendered=...)` then skips it.

        Raises:
            RequestRejected: vLLM refused the prompt (that row is quarantined).
        """
        renderer = self._renderer
        prompt = self._parse_prompt(
            self.llm.llm_engine.model_config, vllm_prompt(token_ids, images)
        )
        try:
            (engine_input,) = renderer.render_cmpl([prompt], renderer.default_cmpl_tok_params)
        except Exception as exc:
            raise _refused(exc) from exc
        return engine_input

    def submit(
        self,
        request_id: str,
        token_ids: list[int],
        params: Any = None,
        images: list[Any] | None = None,
        rendered: Any = None,
        adapter: str | None = None,
    ) -> None:
        """Add one pre-tokenized request to the engine.

        Args:
            request_id: Unique among the requests in flight; `step` returns it back.
            token_ids: The prompt's token ids (the worker tokenized it once, to validate).
            params: This request's `vllm.SamplingParams` (generate, chat) or
                `vllm.PoolingParams` (embed); None takes the spec's.
            images: The row's decoded images (image tasks), sent as `multi_modal_data`.
            rendered: The prompt as `render` returned it (then `token_ids` and `images` are
                not read again).
            adapter: The LoRA adapter the row names (`RowRequest.adapter`); None: the base.
        """
        if params is None:
            params = self.default_params
        elif self.task.facts.samples:
            params.output_kind = self._final_only
        prompt = rendered if rendered is not None else vllm_prompt(token_ids, images)
        engine_id = f"{self._binding}-{request_id}"
        lora = (  # a base row: the zeroed adapter on the CPU build, else none
            self.lora_requests[adapter]
            if adapter is not None
            else self.lora_requests.get(BASE_ADAPTER)
        )
        try:
            self.llm.llm_engine.add_request(engine_id, prompt, params, lora_request=lora)
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":
                raise
            raise _refused(exc) from exc
        sequences = max(int(getattr(params, "n", 1) or 1), 1)
        self._in_flight[engine_id] = sequences
        self._sequences += sequences

    def step(self) -> list[tuple[str, Any]]:
        """One engine step; returns `(request_id, output)` for each request that finished
        (`RequestOutput` for generate and chat, `PoolingRequestOutput` for embed). Outputs
        of requests no longer in flight (aborted) are dropped."""
        finished = []
        for output in self.llm.llm_engine.step():
            if output.finished and output.request_id in self._in_flight:
                self._sequences -= self._in_flight.pop(output.request_id)
                finished.append((output.request_id.split("-", 1)[1], output))
        return finished

    def shutdown(self) -> None:
        """Stop the engine's processes now; left to garbage collection they can hang at exit.

        vLLM sends its engine process SIGTERM and waits up to a grace period (5 s by default)
        before killing it; its CPU engine process never exits within it (measured: every
        shutdown took the full 5 s, then killed it). Every output is committed by now, so the
        worker gives it `SHUTDOWN_GRACE_ENV` seconds (default 1), then vLLM kills the tree.
        """
        if self.watch is not None:
            self.watch.stop()  # the engine's processes now exit on purpose
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            grace = float(os.environ.get(SHUTDOWN_GRACE_ENV, DEFAULT_SHUTDOWN_GRACE_SECONDS))
            try:
                engine_core.shutdown(timeout=grace)
            except TypeError:  # an engine client whose shutdown takes no timeout
                engine_core.shutdown()


# What `_bind_spec` sets from a spec (and `bind` puts back when a spec is refused).
_BOUND = ("spec", "task", "requests", "window", "image_fit", "default_params", "lora_requests")


def same_engine(built: InferenceSpec, other: InferenceSpec) -> str | None:
    """None when the engine built for `built` serves `other` as it is; else what differs
    (the model, or the `vllm.LLM` arguments of `engine_kwargs`, which hold the runner,
    parallel shape and engine settings)."""
    if built.model != other.model:
        return f"it runs model {built.model!r}, the spec asks for {other.model!r}"
    if built.vllm_version != other.vllm_version:
        return f"it runs vLLM {built.vllm_version!r}, the spec pins {other.vllm_version!r}"
    ours, theirs = engine_kwargs(built), engine_kwargs(other)
    if ours != theirs:
        keys = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        return "engine arguments differ: " + ", ".join(
            f"{k}={ours.get(k)!r} here, {theirs.get(k)!r} asked" for k in keys
        )
    return None


def runs_base_on_zero_adapter(llm: Any) -> bool:
    """Whether the built engine runs base rows on a zeroed adapter: LoRA on, on the CPU
    build (`adapters.resolve_cpu_lora` gave it the slot)."""
    from dagster_gpuinfer.worker.loop.cpu_dtype import vllm_on_cpu

    return llm.llm_engine.vllm_config.lora_config is not None and vllm_on_cpu()


def _refused(exc: Exception) -> RequestRejected:
    return RequestRejected(
        f"the engine refused the request ({type(exc).__name__}: {str(exc)[:300]})"
    )


def request_builder(spec: InferenceSpec, llm: Any) -> Any:
    """Builds each row's request from its parameters, checked against this engine."""
    config = llm.llm_engine.vllm_config
    tokenizer = llm.get_tokenizer()

    def verify(params: Any) -> None:
        params.verify(
            config.model_config,
            config.speculative_config,
            config.structured_outputs_config,
            tokenizer,
        )

    samples = task_facts(spec.task).samples
    defaults = spec.sampling.to_vllm_kwargs() if samples else {}
    return RequestBuilder(
        task=spec.task,
        defaults=defaults,
        verify=verify,
        limits=spec.limits,
        refuse_seeds=samples and seeds_unsafe(llm),
        adapters=AdapterNames.of(spec),
    )


def _is_memory_error(message: str) -> bool:
    return memory_problem(message) is not None
