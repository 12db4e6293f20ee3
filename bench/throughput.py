"""Benchmarks 1 and 2: the platform against the raw engine and against the alternatives.

Per workload (`bench.task_workloads`: embed with MiniLM, generate with the tiny Llama), the
same shard goes through:

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
from dataclasses import dataclass, field
from typing import Any

from bench.context import RAY_NAMES, BenchContext, ray_contestants
from bench.platform_run import PlatformPipeline, local_resource, raw_engine_kwargs
from bench.server import ContestantProcess, FreshEachRound
from bench.stats import paired_ratios, rotations, summarize
from bench.task_workloads import sampling_kwargs, workload
from bench.workloads import write_shard

log = logging.getLogger("bench")

PLATFORM = "platform"
RAW = "raw-vllm"
RAW_WARM = "raw-vllm warm"  # raw's second call on its round's engine
HF = "transformers"


@dataclass
class _Tally:
    """Each contestant's rates over the rounds, and what the platform's and Ray's turns add:
    the platform's run figures, Ray's per-execution engine builds and end-to-end rates, the
    outputs' fingerprints."""

    names: list[str]
    rows_per_s: dict[str, list[float]]
    tokens_per_s: dict[str, list[float]]
    fingerprints: dict[str, set[str]]
    platform_runs: list[dict[str, Any]] = field(default_factory=list)
    ray_loads: dict[str, list[float]] = field(default_factory=lambda: {n: [] for n in RAY_NAMES})
    ray_end_to_end: dict[str, list[float]] = field(
        default_factory=lambda: {n: [] for n in RAY_NAMES}
    )

    @classmethod
    def of(cls, names: list[str]) -> _Tally:
        return cls(
            names=names,
            rows_per_s={n: [] for n in [*names, RAW_WARM]},
            tokens_per_s={n: [] for n in [*names, RAW_WARM]},
            fingerprints={n: set() for n in names},
        )

    def add(self, label: str, name: str, rows: int, seconds: float, tokens: int) -> None:
        self.rows_per_s[name].append(rows / seconds)
        self.tokens_per_s[name].append(tokens / seconds)
        log.info(
            "%s %-12s %8.1f rows/s %9.1f tokens/s", label, name, rows / seconds, tokens / seconds
        )

    def pair(self, first: str, second: str) -> dict[str, Any]:
        """Per-round ratios of `first` over `second`, in rows and tokens per second."""
        return {
            "rows_per_s": paired_ratios(self.rows_per_s[first], self.rows_per_s[second]).__dict__,
            "tokens_per_s": paired_ratios(
                self.tokens_per_s[first], self.tokens_per_s[second]
            ).__dict__,
        }


def _platform_turn(
    platform: PlatformPipeline, round_index: int, token_key: str, tally: _Tally
) -> tuple[int, float, int]:
    """One Dagster run of the shard: (rows, partition seconds, tokens)."""
    platform.clear_outputs()
    timing = platform.run(platform.keys)
    seconds = timing.partition_seconds["shard-0"]
    tally.platform_runs.append(
        {
            "round": round_index,
            "run_seconds": timing.run_seconds,
            "model_load_seconds": timing.model_load_seconds,
            "partition_seconds": seconds,
            "inference_seconds": timing.inference_seconds["shard-0"],
            "worker_seconds": timing.worker_seconds,
            "fixed_seconds": timing.run_seconds - seconds,
            "end_to_end_rows_per_s": timing.rows
            / max(timing.run_seconds - timing.model_load_seconds, 1e-9),
        }
    )
    return timing.rows, seconds, getattr(timing, token_key)


def _peer_turn(
    name: str,
    round_index: int,
    texts: list[str],
    call: dict[str, Any],
    token_key: str,
    tally: _Tally,
) -> tuple[int, float, int]:
    """One call of a peer (raw vLLM on its round's fresh engine, transformers, Ray):
    (rows, seconds, tokens). `call` holds `raw` (FreshEachRound), `contestants`, `peers`."""
    if name == RAW:
        fresh = call["raw"].run(round_index, texts)
        call["peers"].setdefault(RAW, fresh.info)
        out, warm = fresh.first, fresh.warm
        tally.rows_per_s[RAW_WARM].append(warm["rows"] / warm["seconds"])
        tally.tokens_per_s[RAW_WARM].append(warm[token_key] / warm["seconds"])
    else:
        out = call["contestants"][name].call("run", texts)
    if name in RAY_NAMES:  # it builds its engine inside each execution
        tally.ray_loads[name].append(out["load_seconds"])
        tally.ray_end_to_end[name].append(out["rows"] / out["wall_seconds"])
    if "fingerprint" in out:
        tally.fingerprints[name].add(out["fingerprint"])
    return out["rows"], out["seconds"], out[token_key]


def _start_peers(
    ctx: BenchContext,
    label: str,
    model: str,
    engine: dict[str, Any],
    env: dict[str, str],
    contestants: dict[str, ContestantProcess],
) -> None:
    """Start the long-lived peers into `contestants` (the caller closes what started, even
    when a later one fails): transformers, and Ray Data LLM's processors where Ray is.
    `engine` holds the raw engine's `task`, `engine_kwargs` and `sampling`; `label` names
    the workload in logs and process names."""
    log.info("%s: starting transformers", label)
    contestants[HF] = ContestantProcess(
        f"{label}-{HF}",
        "bench.backends:TransformersBackend",
        dict(model=model, task=engine["task"], batch_size=64, max_tokens=ctx.sizes.max_tokens),
        env=env,
        log_dir=ctx.log_dir,
    )
    for name, (backend, extra) in ray_contestants(ctx, map_batch_size=ctx.sizes.chunk_size).items():
        log.info("%s: starting %s", label, name)
        contestants[name] = ContestantProcess(
            f"{label}-{name}",
            backend,
            dict(model=model, **engine, **extra),
            env=env,
            python=ctx.ray_python,
            log_dir=ctx.log_dir,
        )


def _contestant_results(tally: _Tally, loads: dict[str, float]) -> dict[str, Any]:
    return {
        name: {
            "rows_per_s": tally.rows_per_s[name],
            "tokens_per_s": tally.tokens_per_s[name],
            "rows_per_s_summary": summarize(tally.rows_per_s[name]).__dict__,
            "tokens_per_s_summary": summarize(tally.tokens_per_s[name]).__dict__,
            "model_load_seconds": loads.get(name),
            **(
                {"end_to_end_rows_per_s": tally.ray_end_to_end[name]}
                if tally.ray_end_to_end.get(name)
                else {}
            ),
        }
        for name in [*tally.names, RAW_WARM]
    }


def _ratios(tally: _Tally, raw_engine_seconds: list[float]) -> dict[str, Any]:
    ratios = {
        f"{PLATFORM}/{other}": tally.pair(PLATFORM, other) for other in [*tally.names[1:], RAW_WARM]
    }
    ratios[f"{RAW}/{HF}"] = tally.pair(RAW, HF)
    ratios[f"{RAW_WARM}/{RAW}"] = tally.pair(RAW_WARM, RAW)
    # Engine build, one span for both (vLLM's import + `LLM(...)`), paired within rounds.
    builds = [r["model_load_seconds"] for r in tally.platform_runs]
    ratios[f"{PLATFORM} engine build/{RAW}"] = {
        "seconds": paired_ratios(builds, raw_engine_seconds).__dict__,
    }
    end_to_end = [r["end_to_end_rows_per_s"] for r in tally.platform_runs]
    ratios[f"{PLATFORM} end-to-end/{RAW}"] = {
        "rows_per_s": paired_ratios(end_to_end, tally.rows_per_s[RAW]).__dict__,
    }
    return ratios


def run_throughput(ctx: BenchContext, task: str) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir(f"throughput-{task}")
    chosen = workload(task)
    model = chosen.model(ctx.work_dir)
    texts, engine, sampling = chosen.rows(sizes)
    write_shard(root / "inputs" / "shard-0.parquet", texts, id_prefix=task)
    resource = local_resource(env=ctx.engine_env())
    platform = PlatformPipeline(
        name=f"bench_{task}",
        model=model,
        task=chosen.task,
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
    raw_sampling = sampling_kwargs(chosen.task, spec.sampling)
    raw_engine = dict(task=chosen.task, engine_kwargs=kwargs, sampling=raw_sampling)
    env = dict(resource.env)
    result: dict[str, Any] = {
        "task": task,
        "model": model,
        "rows": len(texts),
        "rounds": sizes.rounds,
        "model_name": chosen.model_name,
        "engine_kwargs": kwargs,
        "sampling": raw_sampling,
        "chunk_size": sizes.chunk_size,
    }
    raw = FreshEachRound(
        f"{task}-{RAW}",
        "bench.backends:VllmBackend",
        dict(model=model, **raw_engine),
        env=env,
        log_dir=ctx.log_dir,
    )
    contestants: dict[str, ContestantProcess] = {}
    try:
        _start_peers(ctx, task, model, raw_engine, env, contestants)
        loads = {HF: contestants[HF].info["engine_seconds"]}
        peers = {name: c.info for name, c in contestants.items() if name != HF}
        result["peers"] = peers
        names = [PLATFORM, RAW, HF] + [n for n in RAY_NAMES if n in contestants]
        tally = _Tally.of(names)
        token_key = chosen.counted_tokens
        call = {"raw": raw, "contestants": contestants, "peers": peers}
        for round_index, order in enumerate(rotations(names, sizes.rounds)):
            for name in order:
                if name == PLATFORM:
                    rows, seconds, tokens = _platform_turn(platform, round_index, token_key, tally)
                else:
                    rows, seconds, tokens = _peer_turn(
                        name, round_index, texts, call, token_key, tally
                    )
                if rows != len(texts):
                    raise RuntimeError(f"{task} {name}: {rows} rows out of {len(texts)}")
                tally.add(f"{task} round {round_index}", name, rows, seconds, tokens)
        for name, values in tally.ray_loads.items():
            if values:
                loads[name] = summarize(values).median
        loads[PLATFORM] = summarize([r["model_load_seconds"] for r in tally.platform_runs]).median
        loads[RAW] = summarize(raw.engine_seconds).median
        result["contestants"] = _contestant_results(tally, loads)
        result["platform_runs"] = tally.platform_runs
        result["raw_engine_seconds"] = raw.engine_seconds
        result["ratios"] = _ratios(tally, raw.engine_seconds)
        result["fingerprints"] = {k: sorted(v) for k, v in tally.fingerprints.items() if v}
    finally:
        for contestant in contestants.values():
            contestant.close()
    return result
