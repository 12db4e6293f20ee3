"""Long-tailed generation: the platform's streaming worker against raw vLLM and `vllm run-batch`.

Outputs end at random stop tokens: rows are sampled (temperature 1) and `stop_token_ids`
holds `longtail_stop_tokens` random token ids, so each generated token ends its row with a
small fixed chance and lengths run from a few tokens to `max_tokens` (geometric, capped): the
work where a barrier per chunk drains the engine to each chunk's slowest row. Row i is
sampled with seed i (`row_params`: the platform reads it from the shard's params column, the
peers put it in each request), so every contestant generates the same tokens for each row
and rounds do the same work: the tail is the same tail for all. Every contestant gets the
same rows and the same sampling parameters:

- platform cN: a Dagster run of an `inference_assets` pipeline with chunk_size N; its rate is
  generated tokens over the partition's wall time in the worker (starts once the engine is
  built); its end-to-end rate divides by the whole Dagster run instead;
- raw-vllm: one `LLM.generate` over all rows, engine arguments as the worker's, on an engine
  built for the round in a process of its own (`bench.server.run_fresh`), as the platform's
  worker builds one for its run; `raw-vllm warm` is a second call on that engine;
- run-batch: `python -m vllm.entrypoints.openai.run_batch` on the rows as an OpenAI Batch
  file of chat requests (vLLM's own batch runner; 0.32 serves no `/v1/completions` there,
  so each row is one user message); it builds its engine inside, so only its end-to-end rate
  (wall time of the command, engine build included) exists, compared with the platform's;
- ray-data-llm (when Ray is installed, as in the throughput section): Ray Data LLM's own
  processor, `build_processor(vLLMEngineProcessorConfig(...))` (vLLM's async engine, one task
  per row, up to 8 batches of 64 overlapping, about 1.1 x max_num_seqs in flight: it streams
  too); its rate counts the difference of the wall times of all rows and of a probe of 8
  (`RayLlmProcessorBackend`), its end-to-end rate includes the actor's engine build;
- ray-map-batches (only with `--ray-map-batches`): a `map_batches` actor, one `LLM.generate`
  per batch of `RAY_BATCH_SIZE` rows (each batch a barrier, the pattern the streaming loop
  replaced).

Rates are generated tokens per second; each contestant's generated-token total is reported
beside it (`tokens`), and they agree when the seeded rows gave every contestant the same work.
"""

from __future__ import annotations

import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.context import (
    KV_CACHE_BYTES,
    RAY_NAMES,
    REPO_ROOT,
    BenchContext,
    Sizes,
    ray_contestants,
)
from bench.cpu_profile import CpuSteal
from bench.platform_run import PlatformPipeline, local_resource, raw_engine_kwargs
from bench.server import ContestantProcess, FreshEachRound
from bench.stats import paired_ratios, rotations, summarize
from bench.workloads import generate_texts, write_shard
from dagster_gpuinfer import EngineArgs, SamplingParams

log = logging.getLogger("bench")
RAW = "raw-vllm"
RAW_WARM = "raw-vllm warm"  # raw's second call on its round's engine
RUN_BATCH = "run-batch"
RAY_BATCH_SIZE = 512


def platform_name(chunk_size: int) -> str:
    return f"platform c{chunk_size}"


def longtail_workload(sizes: Sizes) -> tuple[list[str], EngineArgs, SamplingParams]:
    """The section's rows, engine arguments and sampling (also `bench.stream_probe
    longtail`'s): outputs end at random stop tokens, so lengths are geometric, capped."""
    texts = generate_texts(sizes.longtail_rows, seed=31)
    # Token ids 0-998 of the BERT vocabulary are [PAD], [unused*] and specials: leave them.
    stop_ids = sorted(random.Random(3).sample(range(999, 30522), sizes.longtail_stop_tokens))
    engine = EngineArgs(max_model_len=512, extra={"kv_cache_memory_bytes": KV_CACHE_BYTES})
    sampling = SamplingParams(
        temperature=1.0, max_tokens=sizes.longtail_max_tokens, extra={"stop_token_ids": stop_ids}
    )
    return texts, engine, sampling


def row_params(rows: int) -> list[str]:
    """Each row's own parameters (the shard's params column): row i's seed is i."""
    return [json.dumps({"seed": i}) for i in range(rows)]


@dataclass
class _Tally:
    """What each contestant's turns gave over the rounds (tokens/s, tokens, the CPU share
    stolen in the turn, end-to-end rates) and the platform's and run-batch's run records."""

    names: list[str]
    rates: dict[str, list[float]]  # generated tokens/s
    generated: dict[str, list[int]]  # tokens a round
    # The CPU share the hypervisor gave other guests in each whole turn (engine builds
    # included; raw's turn holds both its calls, so raw's warm row shows the same share)
    stolen: dict[str, list[float | None]]
    end_to_end: dict[str, list[float]]
    platform_runs: list[dict[str, Any]] = field(default_factory=list)
    run_batch_runs: list[dict[str, Any]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, names: list[str]) -> _Tally:
        every = [*names, RAW_WARM]
        return cls(
            names=names,
            rates={n: [] for n in every},
            generated={n: [] for n in every},
            stolen={n: [] for n in every},
            end_to_end={n: [] for n in names if n != RAW},
        )


@dataclass
class _Contest:
    """What the turns of one long-tail run share."""

    ctx: BenchContext
    root: Path
    model: str
    texts: list[str]
    kwargs: dict[str, Any]
    env: dict[str, str]
    batch_in: Path
    pipelines: dict[int, PlatformPipeline]
    raw: FreshEachRound
    contestants: dict[str, ContestantProcess]
    peers: dict[str, Any]


def _platform_turn(contest: _Contest, name: str, round_index: int, tally: _Tally) -> tuple:
    """One Dagster run of the shard at the name's chunk size: (rows, tokens, seconds)."""
    chunk_size = int(name.split("c")[-1])
    pipeline = contest.pipelines[chunk_size]
    pipeline.clear_outputs()
    timing = pipeline.run(pipeline.keys)
    seconds = timing.partition_seconds["shard-0"]
    tokens = timing.generated_tokens
    tally.end_to_end[name].append(tokens / timing.run_seconds)
    tally.platform_runs.append(
        {
            "round": round_index,
            "chunk_size": chunk_size,
            "run_seconds": timing.run_seconds,
            "model_load_seconds": timing.model_load_seconds,
            "partition_seconds": seconds,
            "fixed_seconds": timing.run_seconds - timing.model_load_seconds - seconds,
            "worker_seconds": timing.worker_seconds,
            # Dagster's run and step start, the Pipes launch and the worker's exit: the
            # run's time outside the worker's job.
            "outside_worker_seconds": timing.run_seconds
            - timing.worker_seconds
            - timing.worker_split.get("start", 0.0),
            "worker_split": timing.worker_split,
        }
    )
    if not tally.lengths:
        tally.lengths = generated_lengths(pipeline)
    return timing.rows, tokens, seconds


def _peer_turn(contest: _Contest, name: str, round_index: int, tally: _Tally) -> tuple:
    """One turn of raw vLLM (its round's fresh engine), a Ray processor or vLLM's
    run-batch: (rows, tokens, seconds)."""
    if name == RAW:
        fresh = contest.raw.run(round_index, contest.texts)
        contest.peers.setdefault(RAW, fresh.info)
        out, warm = fresh.first, fresh.warm
        tally.rates[RAW_WARM].append(warm["generated_tokens"] / warm["seconds"])
        tally.generated[RAW_WARM].append(warm["generated_tokens"])
        return out["rows"], out["generated_tokens"], out["seconds"]
    if name in contest.contestants:
        out = contest.contestants[name].call("run", contest.texts)
        if name in RAY_NAMES:  # its wall time includes the actor's engine build
            tally.end_to_end[name].append(out["generated_tokens"] / out["wall_seconds"])
        return out["rows"], out["generated_tokens"], out["seconds"]
    out = run_vllm_batch(  # RUN_BATCH
        contest.batch_in,
        contest.root / "batch-out.jsonl",
        contest.model,
        contest.kwargs,
        contest.env,
        contest.ctx.log_dir / "longtail-run-batch.log",
    )
    tally.end_to_end[name].append(out["generated_tokens"] / out["wall_seconds"])
    tally.run_batch_runs.append({"round": round_index, **out})
    return out["rows"], out["generated_tokens"], out["wall_seconds"]


def _play_rounds(contest: _Contest, rounds: int, tally: _Tally) -> None:
    for round_index, order in enumerate(rotations(tally.names, rounds)):
        for name in order:
            meter = CpuSteal().start()
            turn = _platform_turn if name.startswith("platform") else _peer_turn
            rows, tokens, seconds = turn(contest, name, round_index, tally)
            if rows != len(contest.texts):
                raise RuntimeError(f"longtail {name}: {rows} rows out of {len(contest.texts)}")
            tally.rates[name].append(tokens / seconds)
            tally.generated[name].append(tokens)
            tally.stolen[name].append(meter.share())
            if name == RAW:
                tally.stolen[RAW_WARM].append(tally.stolen[RAW][-1])
            log.info(
                "longtail round %d %-14s %8.1f generated tokens/s (%d tokens, %.1fs)",
                round_index,
                name,
                tally.rates[name][-1],
                tokens,
                seconds,
            )


def _start_ray(
    ctx: BenchContext, peer_kwargs: dict[str, Any], env: dict[str, str]
) -> tuple[dict[str, ContestantProcess], dict[str, Any]]:
    """Ray Data LLM's processors where Ray is, kept across rounds (in Ray's own process);
    those started are closed if a later one fails."""
    contestants: dict[str, ContestantProcess] = {}
    peers: dict[str, Any] = {}
    for name, (backend, extra) in ray_contestants(ctx, map_batch_size=RAY_BATCH_SIZE).items():
        log.info("longtail: starting %s", name)
        try:
            contestants[name] = ContestantProcess(
                f"longtail-{name}",
                backend,
                {**peer_kwargs, **extra},
                env=env,
                python=ctx.ray_python,
                log_dir=ctx.log_dir,
            )
        except BaseException:
            for contestant in contestants.values():
                contestant.close()
            raise
        peers[name] = contestants[name].info
    return contestants, peers


def _ratios(
    rates: dict[str, list[float]],
    end_to_end: dict[str, list[float]],
    chunks: list[int],
    ray: list[str],
) -> dict[str, Any]:
    ratios = {
        f"{platform_name(c)}/{RAW}": paired_ratios(rates[platform_name(c)], rates[RAW]).__dict__
        for c in chunks
    }
    for c in chunks:  # against raw's second call: the platform's engine never had one
        ratios[f"{platform_name(c)}/{RAW_WARM}"] = paired_ratios(
            rates[platform_name(c)], rates[RAW_WARM]
        ).__dict__
    ratios[f"{RAW_WARM}/{RAW}"] = paired_ratios(rates[RAW_WARM], rates[RAW]).__dict__
    for ray_name in ray:
        for c in chunks:
            ratios[f"{platform_name(c)}/{ray_name}"] = paired_ratios(
                rates[platform_name(c)], rates[ray_name]
            ).__dict__
    for c in chunks:
        ratios[f"{platform_name(c)} end-to-end/{RUN_BATCH}"] = paired_ratios(
            end_to_end[platform_name(c)], end_to_end[RUN_BATCH]
        ).__dict__
    return ratios


def _tally_results(tally: _Tally) -> dict[str, Any]:
    """The contestants' figures, the output lengths and the platform runs' time split."""
    ordered = sorted(tally.lengths)
    runs = tally.platform_runs
    return {
        "lengths": {
            "mean": statistics.mean(ordered) if ordered else None,
            "median": ordered[len(ordered) // 2] if ordered else None,
            "p90": ordered[int(0.9 * len(ordered))] if ordered else None,
            "max": ordered[-1] if ordered else None,
            "min": ordered[0] if ordered else None,
        },
        "contestants": {
            name: {
                "tokens_per_s": tally.rates[name],
                "tokens": tally.generated[name],
                "end_to_end_tokens_per_s": tally.end_to_end.get(name, []),
                "cpu_steal": tally.stolen[name],
                "tokens_per_s_summary": summarize(tally.rates[name]).__dict__,
                "end_to_end_tokens_per_s_summary": summarize(
                    tally.end_to_end.get(name, [])
                ).__dict__,
            }
            for name in [*tally.names, RAW_WARM]
        },
        "platform_runs": runs,
        "run_batch_runs": tally.run_batch_runs,
        "fixed_seconds_summary": summarize([r["fixed_seconds"] for r in runs]).__dict__,
        "outside_worker_seconds_summary": summarize(
            [r["outside_worker_seconds"] for r in runs]
        ).__dict__,
        "worker_split_summary": {
            part: summarize(
                [r["worker_split"].get(part) for r in runs if part in r["worker_split"]]
            ).__dict__
            for part in ("start", "load", "inference", "shutdown")
        },
    }


def run_longtail(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir("longtail")
    model = ctx.generate_model()
    texts, engine, sampling = longtail_workload(sizes)
    write_shard(
        root / "inputs" / "shard-0.parquet", texts, id_prefix="lt", params=row_params(len(texts))
    )
    resource = local_resource(env=ctx.engine_env())
    pipelines = {
        chunk_size: PlatformPipeline(
            name=f"longtail_c{chunk_size}",
            model=model,
            task="generate",
            input_uri=str(root / "inputs" / "{partition_key}.parquet"),
            root=root / f"c{chunk_size}",
            keys=["shard-0"],
            resource=resource,
            engine=engine,
            sampling=sampling,
            chunk_size=chunk_size,
            params_column="params",
        )
        for chunk_size in sizes.longtail_chunk_sizes
    }
    spec = next(iter(pipelines.values())).worker_spec()

    kwargs = raw_engine_kwargs(spec)
    sampling_kwargs = spec.sampling.to_vllm_kwargs()
    batch_in = write_openai_batch(root / "batch-in.jsonl", texts, model, sampling_kwargs)
    env = dict(resource.env)
    # every peer: the worker's engine arguments and sampling, row i seeded i
    peer_kwargs = dict(
        model=model, task="generate", engine_kwargs=kwargs, sampling=sampling_kwargs, row_seeds=True
    )
    raw = FreshEachRound(
        "longtail-raw", "bench.backends:VllmBackend", peer_kwargs, env=env, log_dir=ctx.log_dir
    )
    contestants, peers = _start_ray(ctx, peer_kwargs, env)
    ray = [n for n in RAY_NAMES if n in contestants]
    tally = _Tally.of([platform_name(c) for c in pipelines] + [RAW, RUN_BATCH] + ray)
    contest = _Contest(
        ctx, root, model, texts, kwargs, env, batch_in, pipelines, raw, contestants, peers
    )
    try:
        _play_rounds(contest, sizes.rounds, tally)
    finally:
        for contestant in contestants.values():
            contestant.close()
    runs = tally.run_batch_runs
    return {
        "rows": len(texts),
        "max_tokens": sizes.longtail_max_tokens,
        "stop_tokens": len(sampling.extra["stop_token_ids"]),
        "row_seeds": True,  # row i sampled with seed i (`row_params`)
        "sampling": {k: v for k, v in sampling_kwargs.items() if k != "stop_token_ids"},
        "engine_kwargs": kwargs,
        "peers": {**peers, RUN_BATCH: {"command": runs[0]["command"]}} if runs else peers,
        "raw_engine_seconds": raw.engine_seconds,
        "ratios": _ratios(tally.rates, tally.end_to_end, list(pipelines), ray),
        **_tally_results(tally),
    }


def generated_lengths(pipeline: PlatformPipeline) -> list[int]:
    from dagster_gpuinfer.storage import read_partition

    return read_partition(pipeline.output(), "shard-0").column("generated_tokens").to_pylist()


def write_openai_batch(path: Path, texts: list[str], model: str, sampling: dict[str, Any]) -> Path:
    """The rows as OpenAI Batch API requests, same sampling, row i with seed i. vLLM 0.32's
    run-batch serves `/v1/chat/completions` (not `/v1/completions`), so each row is one user
    message: its prompt gains the chat template's few tokens (so its tokens differ from the
    other contestants'); the generated lengths, which decide the work here, follow the same
    stop tokens."""
    body_params = {k: v for k, v in sampling.items() if v is not None}
    if "max_tokens" in body_params:  # the chat API's name for it
        body_params["max_completion_tokens"] = body_params.pop("max_tokens")
    with open(path, "w") as handle:
        for i, text in enumerate(texts):
            handle.write(
                json.dumps(
                    {
                        "custom_id": f"lt-{i:07d}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": model,
                            "messages": [{"role": "user", "content": text}],
                            **body_params,
                            "seed": i,
                        },
                    }
                )
                + "\n"
            )
    return path


def run_batch_command(
    batch_in: Path, batch_out: Path, model: str, engine_kwargs: dict[str, Any]
) -> list[str]:
    """`python -m vllm.entrypoints.openai.run_batch` with the worker's engine arguments."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.run_batch",
        "-i",
        str(batch_in),
        "-o",
        str(batch_out),
        "--model",
        model,
    ]
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if key == "disable_log_stats":
            # a plain store_true flag in run-batch (there is no --no-disable-log-stats); the
            # worker keeps stats on for its metrics, so run-batch gets them on as well
            command += [flag] if value else []
        elif isinstance(value, bool):
            command.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            command += [flag, str(value)]
    return command


def run_vllm_batch(
    batch_in: Path,
    batch_out: Path,
    model: str,
    engine_kwargs: dict[str, Any],
    env: dict[str, str],
    log_path: Path,
) -> dict[str, Any]:
    batch_out.unlink(missing_ok=True)
    command = run_batch_command(batch_in, batch_out, model, engine_kwargs)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "ab") as log_file:
        done = subprocess.run(
            command,
            env={**os.environ, **env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=str(REPO_ROOT),
            timeout=7200,
        )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"vllm run-batch exited {done.returncode}; see {log_path}")
    rows = tokens = errors = 0
    for line in batch_out.read_text().splitlines():
        record = json.loads(line)
        rows += 1
        if record.get("error"):
            errors += 1
            continue
        tokens += record["response"]["body"]["usage"]["completion_tokens"]
    return {
        "rows": rows - errors,
        "errors": errors,
        "generated_tokens": tokens,
        "wall_seconds": wall,
        "command": " ".join(command[1:4]) + " ...",
    }
