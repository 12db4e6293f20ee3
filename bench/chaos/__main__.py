"""`python -m bench.chaos --seed N`: the same backfill twice on one cluster, without faults
and under the seed's fault schedule; writes RESULTS.md and results.json; exits 1 unless
every partition committed with 0 rows lost, 0 duplicated and no process left.
(`make chaos SEED=N`; bench/README.md, section "Chaos backfill".)"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from bench.chaos import cluster as chaos_cluster
from bench.chaos import store_faults
from bench.chaos.faults import KINDS, schedule
from bench.chaos.report import verdict, write
from bench.chaos.run import backfill


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--partitions", type=int, default=50)
    parser.add_argument("--rows", type=int, default=40, help="documents per partition")
    parser.add_argument("--per-run", type=int, default=25, help="max_partitions_per_run")
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--batches", type=int, default=3, help="batch API batches beside it")
    parser.add_argument("--batch-lines", type=int, default=12, help="lines per batch")
    parser.add_argument(
        "--span-s",
        type=float,
        default=None,
        help="faults fall in this span (default: 0.6 x the baseline's wall time, else 300 s)",
    )
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument(
        "--store-down-s",
        type=float,
        default=None,
        help="down time of every store fault (default: the schedule's, 1-5 s)",
    )
    parser.add_argument("--concurrent-runs", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--model-dir", default=None)
    options = parser.parse_args(argv)
    if options.model_dir is None:
        from assets.models import minilm_path

        options.model_dir = minilm_path()
    unknown = set(options.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; known: {','.join(KINDS)}")
    options.command = "python -m bench.chaos " + shlex.join(argv)
    if options.results is None:
        options.results = Path("bench/results") / f"chaos-seed{options.seed}"
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse(sys.argv[1:] if argv is None else argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    logging.getLogger("dagster.daemon").setLevel(logging.WARNING)  # a line per run queue tick
    keys = [f"docs-{i:03d}" for i in range(options.partitions)]
    kinds = tuple(options.kinds.split(","))
    with chaos_cluster.cluster(options.seed) as found, store_faults.postgres() as server:
        found.postgres = server
        chaos_cluster.write_shards(found, "inputs", keys, options.rows, options.seed)
        baseline = None if options.no_baseline else backfill(found, "baseline", keys, [], options)
        if options.span_s is None:  # the faults fall while the backfill is still running
            options.span_s = round(0.6 * baseline.wall_s) if baseline else 300.0
        faults = store_faults.with_down_time(
            schedule(options.seed, options.faults, options.span_s, kinds), options.store_down_s
        )
        chaos = backfill(found, "chaos", keys, faults, options)
    print(write(options.results, options, faults, baseline, chaos))
    return 1 if verdict(chaos) or (baseline and verdict(baseline)) else 0


if __name__ == "__main__":
    sys.exit(main())
