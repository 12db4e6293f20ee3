"""One partition on the worker's own path against one raw vLLM call on the same engine.

The platform rows of the throughput section are whole Dagster runs; this probe takes the
Dagster run and the Pipes launch away and compares the worker's own entry for a partition
(`run_partition`: the shard read, chunks inferred, written and committed as in a run) against
one `LLM.generate` / `LLM.embed` over the same texts, alternating, on the
throughput section's uniform workloads and engine arguments.

    python -m bench.stream_probe generate --rounds 4 --chunk-size 512
    python -m bench.stream_probe embed
    python -m bench.stream_probe longtail --chunk-size 128   # the long-tailed section's rows

Generation rates are rows/s on the uniform rows and generated tokens/s on the long-tailed
ones. The long-tailed rows are sampled with row i seeded i, as in the section, so both
contestants generate the same tokens and each round says whether their outputs matched
(`--unseeded` samples without seeds: lengths then differ run to run). One untimed raw call
warms the engine first (a fresh engine's first call ran 8% slower than its second on the
long tail, on the Xeon of `bench/results/icx`; `--no-warmup` times it), and the two
contestants swap places every round.

Each run prints the time of day and the share of the CPU the hypervisor took while it ran
(`CpuSteal`): on a shared virtual machine a slow run beside a large share is the host's.
`--control` runs raw against raw instead (an A/A test): the spread of that ratio on one
engine is what the machine and engine give on identical work with nothing of ours in it, the
yardstick for reading the stream's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.backends import EngineBackend
from bench.context import FULL
from bench.cpu_profile import CpuSteal
from bench.task_workloads import WORKLOADS, workload
from dagster_gpuinfer.spec import InferenceSpec, InputSpec, OutputSpec, SamplingParams


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    texts = [name for name, entry in WORKLOADS.items() if not entry.facts.images]
    parser.add_argument("task", choices=texts, help="a text workload of bench.task_workloads")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument(
        "--unseeded", action="store_true", help="long tail: sample without per-row seeds"
    )
    parser.add_argument("--no-warmup", action="store_true", help="time the engine's first call too")
    parser.add_argument(
        "--control", action="store_true", help="raw against raw (A/A): the engine's own spread"
    )
    return parser.parse_args(argv)


def _probe_spec(args: argparse.Namespace, work: str) -> tuple[InferenceSpec, list[str]]:
    """The probe's spec (its model made or found under `work`) and its rows' texts."""
    chosen = workload(args.task)
    texts, engine, sampling = chosen.rows(FULL)
    spec = InferenceSpec(
        model=chosen.model(Path(work)),
        task=chosen.task,
        engine=engine,
        sampling=sampling or SamplingParams(),
        input=InputSpec(uri=f"{work}/in/{{partition_key}}.parquet"),
        output=OutputSpec(root=f"{work}/out", asset_name="probe"),
        chunk_size=args.chunk_size,
    )
    return spec, texts


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    chosen = workload(args.task)
    seeded = chosen.sampled_lengths and not args.unseeded
    with tempfile.TemporaryDirectory(prefix="stream-probe-") as work:
        spec, texts = _probe_spec(args, work)
        backend = EngineBackend(spec_json=spec.model_dump_json())

        def raw() -> dict[str, Any]:
            if chosen.facts.samples:
                return backend.raw_generate(texts, row_seeds=seeded)
            started = time.perf_counter()
            outputs = backend.engine.llm.embed(texts, use_tqdm=False)
            return {"seconds": time.perf_counter() - started, "rows": len(outputs)}

        def stream() -> dict[str, Any]:
            return backend.stream(
                texts, chunk_size=args.chunk_size, group_prefixes=True, row_seeds=seeded
            )

        unit = "generated_tokens" if chosen.sampled_lengths else "rows"
        name = "raw-a" if args.control else "stream"
        order = ((name, raw if args.control else stream), ("raw", raw))
        ratios = []
        try:
            if not args.no_warmup:  # a fresh engine's first call is slower; neither pays it
                out = raw()
                print(f"warm-up raw call {out[unit] / out['seconds']:8.1f} {unit}/s", flush=True)
            for round_index in range(args.rounds):
                rates, outs = {}, {}
                for who, run in order if round_index % 2 == 0 else order[::-1]:
                    meter = CpuSteal().start()
                    out = outs[who] = run()
                    rates[who] = out[unit] / out["seconds"]
                    stolen = meter.share()
                    print(
                        f"{time.strftime('%H:%M:%S')} round {round_index} {who:6s} "
                        f"{rates[who]:8.1f} {unit}/s ({out[unit]} in {out['seconds']:.1f} s, "
                        f"CPU stolen {'n/a' if stolen is None else f'{stolen:.1%}'})",
                        flush=True,
                    )
                if chosen.facts.samples:
                    same = outs[name]["fingerprint"] == outs["raw"]["fingerprint"]
                    print(f"round {round_index} same outputs: {same}", flush=True)
                ratios.append(rates[name] / rates["raw"])
        finally:
            backend.close()
    print(
        f"{name}/raw: median {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} rounds"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
