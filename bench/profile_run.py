"""Where a platform run's seconds go, beside raw vLLM on the same rows.

    python -m bench.profile_run generate            # the throughput section's uniform workload
    python -m bench.profile_run embed --rate 40
    python -m bench.profile_run image_embed         # the images section's shard and tiny CLIP
    python -m bench.profile_run longtail            # the long-tailed section's rows, chunk 512
    python -m bench.profile_run generate --smoke    # tiny rows: checks the harness runs

One Dagster run of the throughput section's pipeline (800 prompts x 32 tokens on the tiny
Llama, or 1,000 MiniLM rows), then one raw `LLM.generate` / `LLM.embed` call with the very
same engine arguments, both under `ProcSampler` (CPU seconds of every process, /proc) and
py-spy (Python stacks per thread). Printed per contestant, for the window its rate is measured
over (the platform: the partition's time in the worker, from engine ready to commit; raw: the
call):

- CPU seconds per process: the engine core, the worker (or the raw client), the Dagster run
  process, py-spy itself, and every other process on the machine (`/proc/stat`);
- idle: the machine's cores x window minus all of that;
- the worker's and the engine core's CPU split by py-spy bucket (read, prepare, write,
  commit, engine loop, vLLM output processing; forward pass, scheduler).

A run of the whole Dagster run is split the same way (`whole run`), with the worker's own
start / load / inference / shutdown seconds. `--json FILE` keeps every number. The numbers
mean what the machine's load lets them mean: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.context import FULL, SMOKE, BenchContext
from bench.cpu_profile import (
    ENGINE_CORE,
    PROFILER,
    RAW_CLIENT,
    RUN_PROCESS,
    WORKER,
    ProcSampler,
    PySpy,
    parse_pyspy_raw,
)
from bench.task_workloads import WORKLOADS, Workload, sampling_kwargs, workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=tuple(WORKLOADS), help="a workload of bench.task_workloads")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks it runs")
    parser.add_argument(
        "--rate",
        type=int,
        default=20,
        help="py-spy samples per second (50 Hz cost 12-14 CPU s per minute of run here)",
    )
    parser.add_argument("--no-raw", action="store_true", help="profile the platform run only")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="profile-run-") as scratch:
        work = (args.work or Path(scratch)).resolve()
        ctx = BenchContext(
            sizes=SMOKE if args.smoke else FULL,
            work_dir=work,
            results_dir=work / "results",
            smoke=args.smoke,
        )
        report = profile(ctx, args.task, rate=args.rate, with_raw=not args.no_raw)
    if args.json:  # first: a rendering error loses no measurement
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(render(report))
    return 0


def profile(ctx: BenchContext, task: str, *, rate: int, with_raw: bool) -> dict[str, Any]:
    """Profile one platform run and (optionally) one raw vLLM call on the same rows."""
    from bench.platform_run import raw_engine_kwargs
    from dagster_gpuinfer.storage import MANIFEST_NAME, partition_dir

    root = ctx.fresh_dir(f"profile-{task}")
    pipeline, raw_contestant, rows = _workload(ctx, task, root)
    spec = pipeline.worker_spec()
    report: dict[str, Any] = {
        "task": task,
        "rows": rows,
        "cores": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "pyspy_rate": rate,
        "engine_kwargs": raw_engine_kwargs(spec),
    }
    sampler = ProcSampler(os.getpid()).start()
    spy = PySpy(os.getpid(), root / "platform.pyspy.txt", rate=rate)
    run_started = time.time()
    timing = pipeline.run(pipeline.keys)
    run_ended = time.time()
    stacks = parse_pyspy_raw(spy.stop(), root_pid=os.getpid())
    sampler.stop()
    manifest_path = Path(partition_dir(pipeline.output(), "shard-0")) / MANIFEST_NAME
    committed_at = manifest_path.stat().st_mtime
    window = (committed_at - timing.partition_seconds["shard-0"], committed_at)
    ready = window[0]
    report["platform"] = {
        "build": split(sampler, ready - timing.model_load_seconds, ready),
        "rows": timing.rows,
        "partition_seconds": timing.partition_seconds["shard-0"],
        "run_seconds": timing.run_seconds,
        "model_load_seconds": timing.model_load_seconds,
        "worker_split": timing.worker_split,
        "window": split(sampler, *window),
        "whole_run": split(sampler, run_started, run_ended),
        "pyspy_seconds": {k: v / rate for k, v in sorted(stacks.items())},
    }
    if workload(task).sampled_lengths:  # rates compare generated tokens
        from bench.longtail import generated_lengths

        report["platform"]["generated_tokens"] = sum(generated_lengths(pipeline))
    if with_raw:
        report["raw"] = profile_raw(ctx, task, raw_contestant(report["engine_kwargs"], spec), rate)
    report["load_average_at_end"] = list(os.getloadavg())
    return report


def _workload(ctx: BenchContext, task: str, root: Path) -> tuple[Any, Any, int]:
    """`(platform pipeline, raw contestant factory, rows)` of workload `task`: its text rows
    (`Workload.rows`), or the images section's shard where its task takes images. The
    factory takes the platform's engine kwargs and worker spec, so raw runs the same engine
    on the same rows, and gives `(start the contestant, its run argument)`."""
    chosen = workload(task)
    if chosen.facts.images:
        return _image_workload(ctx, chosen, root)
    return _text_workload(ctx, chosen, root)


def _image_workload(ctx: BenchContext, chosen: Workload, root: Path) -> tuple[Any, Any, int]:
    """The images section's shard, its platform pipeline and raw `ImageVllmBackend`."""
    from bench.images import _platform_pipeline, write_image_shard
    from bench.server import ContestantProcess

    model = chosen.model(ctx.work_dir)
    shard = root / "inputs" / "shard-0.parquet"
    rows = write_image_shard(shard, 64 if ctx.smoke else 960)["rows"]
    pipeline = _platform_pipeline(model, root)

    def raw_images(kwargs: dict[str, Any], spec: Any) -> tuple[Any, Any]:
        def start() -> ContestantProcess:
            return ContestantProcess(
                f"profile-{chosen.name}-raw",
                "bench.images:ImageVllmBackend",
                {"model": model, "engine_kwargs": kwargs},
                env=ctx.engine_env(),
                log_dir=ctx.log_dir,
            )

        return start, str(shard)

    return pipeline, raw_images, rows


def _text_workload(ctx: BenchContext, chosen: Workload, root: Path) -> tuple[Any, Any, int]:
    """The workload's text rows as one shard, its platform pipeline and raw `VllmBackend`."""
    from bench.platform_run import PlatformPipeline, local_resource
    from bench.server import ContestantProcess
    from bench.workloads import write_shard

    task = chosen.name
    model = chosen.model(ctx.work_dir)
    texts, engine, sampling = chosen.rows(ctx.sizes)
    write_shard(root / "inputs" / "shard-0.parquet", texts, id_prefix=task)
    pipeline = PlatformPipeline(
        name=f"profile_{task}",
        model=model,
        task=chosen.task,
        input_uri=str(root / "inputs" / "{partition_key}.parquet"),
        root=root,
        keys=["shard-0"],
        resource=local_resource(env=ctx.engine_env()),
        engine=engine,
        sampling=sampling,
        chunk_size=chosen.chunk_size(ctx.sizes),
    )

    def raw_text(kwargs: dict[str, Any], spec: Any) -> tuple[Any, Any]:
        sampling = sampling_kwargs(chosen.task, spec.sampling)

        def start() -> ContestantProcess:
            return ContestantProcess(
                f"profile-{task}-raw",
                "bench.backends:VllmBackend",
                dict(model=model, task=chosen.task, engine_kwargs=kwargs, sampling=sampling),
                env=ctx.engine_env(),
                log_dir=ctx.log_dir,
            )

        return start, texts

    return pipeline, raw_text, len(texts)


def profile_raw(ctx: BenchContext, task: str, contestant: tuple[Any, Any], rate: int) -> dict:
    """One raw `LLM.generate` / `LLM.embed` call in a contestant process, profiled over the
    seconds the call itself times (image rows: decoded before its clock starts)."""
    sampler = ProcSampler(os.getpid()).start()
    spy = PySpy(os.getpid(), ctx.work_dir / f"profile-{task}-raw.pyspy.txt", rate=rate)
    try:
        start, rows = contestant
        raw = start()  # builds its engine
        built = time.time()
        try:
            out = raw.call("run", rows)
            ended = time.time()
        finally:
            raw.close()
    finally:
        stacks = parse_pyspy_raw(spy.stop(), root_pid=os.getpid())
        sampler.stop()
    return {
        "rows": out["rows"],
        "generated_tokens": out.get("generated_tokens"),
        "seconds": out["seconds"],
        "engine_seconds": raw.info.get("engine_seconds"),
        "import_seconds": raw.info.get("import_seconds"),
        "build": split(sampler, built - raw.info["engine_seconds"], built),
        "window": split(sampler, ended - out["seconds"], ended),
        "pyspy_seconds": {k: v / rate for k, v in sorted(stacks.items())},
    }


def split(sampler: ProcSampler, start: float, end: float) -> dict[str, float]:
    """CPU seconds per process kind in [start, end], the rest of the machine, and idle."""
    wall = end - start
    ours = sampler.cpu_by_kind(start, end)
    machine = sampler.machine_busy(start, end)
    capacity = wall * (os.cpu_count() or 1)
    others = max(machine - sum(ours.values()), 0.0)
    return {
        "wall_seconds": wall,
        **{f"cpu {kind}": seconds for kind, seconds in sorted(ours.items())},
        "cpu other processes on the machine": others,
        # the /proc sampler's own thread, inside the Dagster run process's figure (whole run)
        "cpu of which the /proc sampler (whole profile)": sampler.own_cpu,
        "idle": max(capacity - machine, 0.0),
        "capacity": capacity,
    }


def render(report: dict[str, Any]) -> str:
    """The split as text tables, platform beside raw."""
    lines = [
        f"{report['task']}: {report['rows']} rows, {report['cores']} cores, load average "
        f"{report['load_average_at_start'][0]:.1f} at start, "
        f"{report['load_average_at_end'][0]:.1f} at end; py-spy at {report['pyspy_rate']} Hz",
        "",
    ]
    platform = report["platform"]
    columns = [
        ("platform build", platform["build"]),
        ("platform partition", platform["window"]),
        ("platform whole run", platform["whole_run"]),
    ]
    if "raw" in report:
        columns += [("raw build", report["raw"]["build"]), ("raw call", report["raw"]["window"])]
    keys = ["wall_seconds"]
    for _, col in columns:
        keys += [k for k in col if k not in keys and k != "capacity"]
    lines.append(f"{'seconds':40s}" + "".join(f"{name:>19s}" for name, _ in columns))
    for key in keys:
        cells = "".join(f"{col.get(key, 0.0):19.1f}" for _, col in columns)
        lines.append(f"{key:40s}{cells}")
    lines += ["", "worker split: " + json.dumps(platform["worker_split"])]
    for name, block in (("platform run", platform), ("raw call", report.get("raw"))):
        if not block:
            continue
        lines += ["", f"py-spy, {name} (seconds a Python thread was runnable, not CPU):"]
        for bucket, seconds in sorted(block["pyspy_seconds"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {bucket:56s}{seconds:8.1f}")
    lines += ["", *interpret(report)]
    return "\n".join(lines)


def interpret(report: dict[str, Any]) -> list[str]:
    """The few sentences the split supports: engine CPU per row in each contestant, and what
    ran beside the engine on the same cores."""
    window = report["platform"]["window"]
    load = report["platform"]["model_load_seconds"]
    out = [f"engine build (import vllm + LLM(...)): platform {load:.1f} s"]
    if "raw" in report:
        raw_block = report["raw"]
        out[0] += f", raw {raw_block['engine_seconds']:.1f} s"
        if raw_block.get("import_seconds") is not None:
            out[0] += f" (of which import {raw_block['import_seconds']:.1f} s)"
    engine = window.get(f"cpu {ENGINE_CORE}", 0.0)
    beside = window.get(f"cpu {WORKER}", 0.0) + window.get(f"cpu {RUN_PROCESS}", 0.0)
    out.append(
        f"platform: engine core {engine:.1f} CPU s in {window['wall_seconds']:.1f} s; worker + "
        f"Dagster run process {beside:.1f} CPU s beside it; py-spy "
        f"{window.get(f'cpu {PROFILER}', 0.0):.1f}; other processes "
        f"{window['cpu other processes on the machine']:.1f}; idle {window['idle']:.1f}"
    )
    out += _token_rates(report)
    if "raw" in report:
        raw = report["raw"]["window"]
        raw_engine = raw.get(f"cpu {ENGINE_CORE}", 0.0)
        out.append(
            f"raw: engine core {raw_engine:.1f} CPU s in {raw['wall_seconds']:.1f} s; client "
            f"{raw.get(f'cpu {RAW_CLIENT}', 0.0):.1f} CPU s beside it; other processes "
            f"{raw['cpu other processes on the machine']:.1f}; idle {raw['idle']:.1f}"
        )
    return out


def _token_rates(report: dict[str, Any]) -> list[str]:
    """Generated tokens/s of each side, where lengths are sampled (the long tail)."""
    platform, raw = report["platform"], report.get("raw") or {}
    if not platform.get("generated_tokens"):
        return []
    line = (
        f"generated tokens/s: platform {platform['generated_tokens']:,} in "
        f"{platform['partition_seconds']:.1f} s = "
        f"{platform['generated_tokens'] / platform['partition_seconds']:,.0f}"
    )
    if raw.get("generated_tokens"):
        line += (
            f"; raw {raw['generated_tokens']:,} in {raw['seconds']:.1f} s = "
            f"{raw['generated_tokens'] / raw['seconds']:,.0f}"
        )
    return [line]


if __name__ == "__main__":
    raise SystemExit(main())
