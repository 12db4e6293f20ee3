"""`python -m bench.chaos --seed N`: the same backfill twice on one cluster, without faults
and under the seed's fault schedule; writes RESULTS.md and results.json; exits 1 unless
every partition committed with 0 rows lost, 0 duplicated and no process left.
(`make chaos SEED=N`; bench/README.md, section "Chaos backfill".)"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.chaos import cluster as chaos_cluster
from bench.chaos import store_faults
from bench.chaos.faults import KINDS, POOL_KINDS, schedule
from bench.chaos.report import verdict, write
from bench.chaos.run import backfill


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--partitions", type=int, default=50)
    parser.add_argument("--rows", type=int, default=40, help="documents per partition")
    parser.add_argument("--per-run", type=int, default=25, help="max_partitions_per_run")
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--faults", type=int, default=None, help="default: one per kind")
    parser.add_argument("--batches", type=int, default=3, help="batch API batches beside it")
    parser.add_argument("--batch-lines", type=int, default=12, help="lines per batch")
    parser.add_argument(
        "--span-s",
        type=float,
        default=None,
        help="faults fall in this span (default: 0.6 x the baseline's wall time, else 300 s)",
    )
    parser.add_argument("--kinds", default=None, help="default: every kind of the mode")
    parser.add_argument(
        "--store-down-s",
        type=float,
        default=None,
        help="down time of every store fault (default: the schedule's, 1-5 s)",
    )
    parser.add_argument(
        "--mode",
        choices=("run", "pools"),
        default="run",
        help="pools: part of the backfill on an engine pool and a 2-node group, with "
        "their faults too (bench/chaos/pool_faults.py; needs both engine slots)",
    )
    parser.add_argument("--pool-partitions", type=int, default=10, help="--mode pools")
    parser.add_argument("--group-partitions", type=int, default=4, help="--mode pools")
    parser.add_argument(
        "--pool-queue",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="--mode pools: the lease queue in a database of the harness's PostgreSQL server "
        "(restarted by postgres_restart, as deployed), or a SQLite file on the pods' volume",
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
    known = KINDS if options.mode == "run" else (*KINDS, *POOL_KINDS)
    options.kinds = options.kinds or ",".join(known)
    unknown = set(options.kinds.split(",")) - set(known)
    if unknown:
        parser.error(
            f"--kinds: unknown {sorted(unknown)} in --mode {options.mode}; known: "
            f"{','.join(known)}"
            + (" (pool kinds need --mode pools)" if options.mode == "run" else "")
        )
    if options.faults is None:
        options.faults = len(options.kinds.split(","))
    options.command = "python -m bench.chaos " + shlex.join(argv)
    if options.results is None:
        options.results = Path("bench/results") / f"chaos-seed{options.seed}"
    return options


def pool_mode(found: Any, options: argparse.Namespace, work: Path) -> list[str]:
    """The reference pipeline's partition keys; in `--mode pools` also the pool and group
    pipelines' (`options.pools`, bench/chaos/pool_faults.py), whose models are made under
    `work` (then `options.model_dir` is MiniLM's copy there), and their lease queue on the
    harness's PostgreSQL server (`--pool-queue sqlite`: under `work`)."""
    options.pools = None
    if options.mode != "pools":
        return [f"docs-{i:03d}" for i in range(options.partitions)]
    from bench.chaos.pool_faults import prepare, split_keys

    split = split_keys(options.partitions, options.pool_partitions, options.group_partitions)
    work.chmod(0o755)
    queue_url = None
    if options.pool_queue == "postgres":
        # on the pod network's gateway: the pool worker pods lease from it
        queue_url = found.postgres.database("chaos_pool_queue", found.executor.gateway)
    options.pools = prepare(found.executor, work, options.model_dir, split, queue_url)
    options.model_dir = str(work / "models" / "model")
    return split["doc_embeddings"]


def main(argv: list[str] | None = None) -> int:
    options = parse(sys.argv[1:] if argv is None else argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    logging.getLogger("dagster.daemon").setLevel(logging.WARNING)  # a line per run queue tick
    kinds = tuple(options.kinds.split(","))
    with (
        chaos_cluster.cluster(options.seed) as found,
        store_faults.postgres(found.executor.gateway) as server,
        tempfile.TemporaryDirectory() as work,
    ):
        found.postgres = server
        keys = pool_mode(found, options, Path(work))  # the reference pipeline's partitions
        more = options.pools.targets().values() if options.pools else []
        every = [*keys, *(k for ks in more for k in ks)]
        chaos_cluster.write_shards(found, "inputs", every, options.rows, options.seed)
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
