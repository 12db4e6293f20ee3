"""Benchmarks 1 and 2: the platform against the raw engine and against the alternatives.

Per task (embed with MiniLM, generate with the tiny Llama), the same shard goes through:

- platform: a Dagster run of an `inference_assets` pipeline (local launcher, worker over
  Pipes, Parquet in and out); its rate is rows / the partition's wall time in the worker
  (read, validate and tokenize, infer, write, commit), which starts after the engine is built;
  the run's fixed cost (Dagster, worker start, engine build, shutdown) is reported apart;
- raw-vllm: `vllm.LLM(...)` with the very engine arguments and environment the worker gets,
  one `.embed(texts)` / `.generate(texts, ...)` call, on an engine built for the round in a
  process of its own (`bench.server.run_fresh`), as the platform's worker builds one for its
  run; `raw-vllm warm` is a second call on that engine;
- transformers: a plain batched Hugging Face loop;
- ray-data-llm: Ray Data LLM's own processor, `build_processor(vLLMEngineProcessorConfig(
  ...))` with the same engine arguments (when Ray is installed; `bench.backends`);
- ray-map-batches (only with `--ray-map-batches`): a hand-written `map_batches` actor calling
  `LLM.generate` per batch;

Rounds interleave the contestants in rotating order; the headline is the per-round ratio.
"""

from __future__ import annotations

import logging
from typing import Any

from bench.context import KV_CACHE_BYTES, RAY_NAMES, BenchContext, Sizes, ray_contestants
from bench.platform_run import PlatformPipeline, local_resource, raw_engine_kwargs
from bench.server import ContestantProcess, FreshEachRound
from bench.stats import paired_ratios, rotations, summarize
from bench.workloads import embed_texts, generate_texts, write_shard
from dagster_gpuinfer import EngineArgs, SamplingParams

log = logging.getLogger("bench")

PLATFORM = "platform"
RAW = "raw-vllm"
RAW_WARM = "raw-vllm warm"  # raw's second call on its round's engine
HF = "transformers"


def uniform_workload(
    task: str, sizes: Sizes
) -> tuple[list[str], EngineArgs, SamplingParams | None]:
    """The section's rows, engine arguments and sampling for `task` (also the workload of
    `bench.stream_probe`)."""
    if task == "embed":
        engine = EngineArgs(dtype="float32", extra={"kv_cache_memory_bytes": KV_CACHE_BYTES})
        return embed_texts(sizes.embed_rows), engine, None
    engine = EngineArgs(max_model_len=256, extra={"kv_cache_memory_bytes": KV_CACHE_BYTES})
    sampling = SamplingParams(temperature=0.0, max_tokens=sizes.max_tokens)
    return generate_texts(sizes.generate_rows), engine, sampling


def run_throughput(ctx: BenchContext, task: str) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir(f"throughput-{task}")
    model = ctx.embed_model() if task == "embed" else ctx.generate_model()
    texts, engine, sampling = uniform_workload(task, sizes)
    write_shard(root / "inputs" / "shard-0.parquet", texts, id_prefix=task)
    resource = local_resource(env=ctx.engine_env())
    platform = PlatformPipeline(
        name=f"bench_{task}",
        model=model,
        task=task,
        input_uri=str(root / "inputs" / "{partition_key}.parquet"),
        root=root,
        keys=["shard-0"],
        resource=resource,
        engine=engine,
        sampling=sampling,
        chunk_size=sizes.chunk_size,
    )
    spec = platform.worker_spec()
    kwargs = raw_engine_kwargs(spec)
    sampling_kwargs = spec.sampling.to_vllm_kwargs() if task != "embed" else None
    env = dict(resource.env)
    contestants: dict[str, ContestantProcess] = {}
    loads: dict[str, float] = {}
    result: dict[str, Any] = {
        "task": task,
        "model": model,
        "rows": len(texts),
        "rounds": sizes.rounds,
        "model_name": "all-MiniLM-L6-v2" if task == "embed" else "tiny Llama (2 layers, random)",
        "engine_kwargs": kwargs,
        "sampling": sampling_kwargs,
        "chunk_size": sizes.chunk_size,
    }
    raw = FreshEachRound(
        f"{task}-{RAW}",
        "bench.backends:VllmBackend",
        dict(model=model, task=task, engine_kwargs=kwargs, sampling=sampling_kwargs),
        env=env,
        log_dir=ctx.log_dir,
    )
    try:
        log.info("%s: starting transformers", task)
        contestants[HF] = ContestantProcess(
            f"{task}-{HF}",
            "bench.backends:TransformersBackend",
            dict(model=model, task=task, batch_size=64, max_tokens=sizes.max_tokens),
            env=env,
            log_dir=ctx.log_dir,
        )
        loads[HF] = contestants[HF].info["engine_seconds"]
        peers: dict[str, Any] = {}
        ray_peers = ray_contestants(ctx, map_batch_size=sizes.chunk_size)
        for name, (backend, extra) in ray_peers.items():
            log.info("%s: starting %s", task, name)
            contestants[name] = ContestantProcess(
                f"{task}-{name}",
                backend,
                dict(
                    model=model,
                    task=task,
                    engine_kwargs=kwargs,
                    sampling=sampling_kwargs,
                    **extra,
                ),
                env=env,
                python=ctx.ray_python,
                log_dir=ctx.log_dir,
            )
            peers[name] = contestants[name].info
        result["peers"] = peers
        names = [PLATFORM, RAW, HF] + [n for n in RAY_NAMES if n in contestants]
        rows_per_s: dict[str, list[float]] = {n: [] for n in [*names, RAW_WARM]}
        tokens_per_s: dict[str, list[float]] = {n: [] for n in [*names, RAW_WARM]}
        platform_runs: list[dict[str, Any]] = []
        ray_loads: dict[str, list[float]] = {n: [] for n in RAY_NAMES}
        ray_end_to_end: dict[str, list[float]] = {n: [] for n in RAY_NAMES}
        fingerprints: dict[str, set[str]] = {n: set() for n in names}
        token_key = "prompt_tokens" if task == "embed" else "generated_tokens"
        for round_index, order in enumerate(rotations(names, sizes.rounds)):
            for name in order:
                if name == PLATFORM:
                    platform.clear_outputs()
                    timing = platform.run(platform.keys)
                    seconds = timing.partition_seconds["shard-0"]
                    tokens = getattr(timing, token_key)
                    rows = timing.rows
                    platform_runs.append(
                        {
                            "round": round_index,
                            "run_seconds": timing.run_seconds,
                            "model_load_seconds": timing.model_load_seconds,
                            "partition_seconds": seconds,
                            "inference_seconds": timing.inference_seconds["shard-0"],
                            "worker_seconds": timing.worker_seconds,
                            "fixed_seconds": timing.run_seconds - seconds,
                            "end_to_end_rows_per_s": rows
                            / max(timing.run_seconds - timing.model_load_seconds, 1e-9),
                        }
                    )
                else:
                    if name == RAW:
                        fresh = raw.run(round_index, texts)
                        peers.setdefault(RAW, fresh.info)
                        out, warm = fresh.first, fresh.warm
                        rows_per_s[RAW_WARM].append(warm["rows"] / warm["seconds"])
                        tokens_per_s[RAW_WARM].append(warm[token_key] / warm["seconds"])
                    else:
                        out = contestants[name].call("run", texts)
                    seconds, rows, tokens = out["seconds"], out["rows"], out[token_key]
                    if name in RAY_NAMES:  # it builds its engine inside each execution
                        ray_loads[name].append(out["load_seconds"])
                        ray_end_to_end[name].append(rows / out["wall_seconds"])
                    if "fingerprint" in out:
                        fingerprints[name].add(out["fingerprint"])
                if rows != len(texts):
                    raise RuntimeError(f"{task} {name}: {rows} rows out of {len(texts)}")
                rows_per_s[name].append(rows / seconds)
                tokens_per_s[name].append(tokens / seconds)
                log.info(
                    "%s round %d %-12s %8.1f rows/s %9.1f tokens/s",
                    task,
                    round_index,
                    name,
                    rows / seconds,
                    tokens / seconds,
                )
        for name, values in ray_loads.items():
            if values:
                loads[name] = summarize(values).median
        loads[PLATFORM] = summarize([r["model_load_seconds"] for r in platform_runs]).median
        loads[RAW] = summarize(raw.engine_seconds).median
        result["contestants"] = {
            name: {
                "rows_per_s": rows_per_s[name],
                "tokens_per_s": tokens_per_s[name],
                "rows_per_s_summary": summarize(rows_per_s[name]).__dict__,
                "tokens_per_s_summary": summarize(tokens_per_s[name]).__dict__,
                "model_load_seconds": loads.get(name),
                **(
                    {"end_to_end_rows_per_s": ray_end_to_end[name]}
                    if ray_end_to_end.get(name)
                    else {}
                ),
            }
            for name in [*names, RAW_WARM]
        }
        result["platform_runs"] = platform_runs
        result["raw_engine_seconds"] = raw.engine_seconds
        result["ratios"] = {}
        for other in [*names[1:], RAW_WARM]:
            result["ratios"][f"{PLATFORM}/{other}"] = {
                "rows_per_s": paired_ratios(rows_per_s[PLATFORM], rows_per_s[other]).__dict__,
                "tokens_per_s": paired_ratios(tokens_per_s[PLATFORM], tokens_per_s[other]).__dict__,
            }
        result["ratios"][f"{RAW}/{HF}"] = {
            "rows_per_s": paired_ratios(rows_per_s[RAW], rows_per_s[HF]).__dict__,
            "tokens_per_s": paired_ratios(tokens_per_s[RAW], tokens_per_s[HF]).__dict__,
        }
        result["ratios"][f"{RAW_WARM}/{RAW}"] = {
            "rows_per_s": paired_ratios(rows_per_s[RAW_WARM], rows_per_s[RAW]).__dict__,
            "tokens_per_s": paired_ratios(tokens_per_s[RAW_WARM], tokens_per_s[RAW]).__dict__,
        }
        # Engine build, one span for both (vLLM's import + `LLM(...)`), paired within rounds.
        result["ratios"][f"{PLATFORM} engine build/{RAW}"] = {
            "seconds": paired_ratios(
                [r["model_load_seconds"] for r in platform_runs], raw.engine_seconds
            ).__dict__,
        }
        end_to_end = [r["end_to_end_rows_per_s"] for r in platform_runs]
        result["ratios"][f"{PLATFORM} end-to-end/{RAW}"] = {
            "rows_per_s": paired_ratios(end_to_end, rows_per_s[RAW]).__dict__,
        }
        result["fingerprints"] = {k: sorted(v) for k, v in fingerprints.items() if v}
    finally:
        for contestant in contestants.values():
            contestant.close()
    return result
