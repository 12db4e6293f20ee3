"""Benchmark: row-level reuse on an incremental change (`--only incremental`).

One embed shard of N rows is materialized; then 10% rows are appended and 1% edited, and
the shard is materialized again: the re-run copies the unchanged rows from the partition's
earlier output and computes only the appended and edited ones. Paired in the same bench
run, the same changed shard is computed in full by a second pipeline (its own output
folder, nothing to copy from). Reported per round: each run's end-to-end wall time (Dagster
run: worker start, model load, reading, inference, writing, commit), the rows each
computed and reused (from its manifest), and how far the re-run's embeddings are from the
full recompute's (ids compared row by row). The order of the two runs alternates by round.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np

from assets.prepare import make_document
from bench.context import KV_CACHE_BYTES, BenchContext
from bench.platform_run import PlatformPipeline, local_resource
from bench.stats import summarize
from bench.workloads import embed_texts, write_shard
from dagster_gpuinfer import EngineArgs, read_partition
from dagster_gpuinfer.storage import filesystem_for, partition_dir, read_manifest

log = logging.getLogger("bench")

KEY = "shard-000"
APPENDED = 0.10
EDITED = 0.01


def changed_texts(texts: list[str], *, seed: int) -> tuple[list[str], int, int]:
    """`texts` with 1% of them edited (at random places) and 10% more appended; returns the
    new texts and how many were edited and appended.

    Every edited and appended text is new: the documents are numbered on from `texts`' own
    (a document's text names its number), so none repeats an earlier row's and none another
    new one's. The re-run then has exactly edited + appended requests no earlier output
    holds, and nothing for in-run dedup (drawn from the same small vocabulary with numbers
    0.., a few appended rows repeated an earlier text: 3 of 1,000 at 10,000 rows, which the
    re-run copied and the full recompute deduplicated)."""
    rows = len(texts)
    edited, appended = max(1, round(rows * EDITED)), max(1, round(rows * APPENDED))
    rng = random.Random(seed + 1000)
    fresh = [make_document(rng, rows + n) for n in range(edited + appended)]
    new = list(texts)
    for n, index in enumerate(random.Random(seed).sample(range(rows), edited)):
        new[index] = f"{fresh[n]} (edited)"
    new += fresh[edited:]
    if len(set(new)) != len(new) or len(set(texts)) != rows:
        raise AssertionError("the incremental workload repeats a text; every row must be new")
    return new, edited, appended


def _pipeline(ctx: BenchContext, root: Path, name: str, resource: Any) -> PlatformPipeline:
    return PlatformPipeline(
        name=name,
        model=ctx.embed_model(),
        task="embed",
        input_uri=str(root / "inputs" / name / "{partition_key}.parquet"),
        root=root / name,
        keys=[KEY],
        resource=resource,
        engine=EngineArgs(dtype="float32", extra={"kv_cache_memory_bytes": KV_CACHE_BYTES}),
        chunk_size=ctx.sizes.chunk_size,
    )


def _figures(pipeline: PlatformPipeline, timing: Any) -> dict[str, Any]:
    fs, path = filesystem_for(partition_dir(pipeline.output(), KEY))
    manifest = read_manifest(fs, path)
    assert manifest is not None
    return {
        "wall_seconds": timing.run_seconds,
        "model_load_seconds": timing.model_load_seconds,
        "rows_out": manifest.rows_out,
        "rows_reused": manifest.rows_reused,
        "rows_deduplicated": manifest.rows_deduplicated,
        "rows_computed": manifest.rows_out - manifest.rows_reused - manifest.rows_deduplicated,
    }


def _compare(rerun: PlatformPipeline, full: PlatformPipeline) -> dict[str, Any]:
    """The re-run's output against the full recompute's, row by row."""
    a, b = read_partition(rerun.output(), KEY), read_partition(full.output(), KEY)
    same_ids = a.column("id").to_pylist() == b.column("id").to_pylist()
    va = np.asarray(a.column("embedding").to_pylist(), np.float32)
    vb = np.asarray(b.column("embedding").to_pylist(), np.float32)
    return {
        "same_ids": same_ids,
        "max_abs_difference": float(np.abs(va - vb).max()) if same_ids and len(va) else None,
        "rows_bitwise_equal": int((va == vb).all(axis=1).sum()) if same_ids else 0,
    }


def _round(ctx: BenchContext, number: int, texts: list[str]) -> dict[str, Any]:
    root = ctx.fresh_dir(f"incremental/round-{number}")
    resource = local_resource(env=ctx.engine_env())
    rerun = _pipeline(ctx, root, "rerun", resource)
    full = _pipeline(ctx, root, "full", resource)
    write_shard(root / "inputs" / "rerun" / f"{KEY}.parquet", texts, id_prefix="doc")
    first = _figures(rerun, rerun.run([KEY]))
    new, edited, appended = changed_texts(texts, seed=number)
    write_shard(root / "inputs" / "rerun" / f"{KEY}.parquet", new, id_prefix="doc")
    write_shard(root / "inputs" / "full" / f"{KEY}.parquet", new, id_prefix="doc")
    runs: dict[str, dict[str, Any]] = {}
    order = ("rerun", "full") if number % 2 == 0 else ("full", "rerun")
    for name in order:
        pipeline = rerun if name == "rerun" else full
        runs[name] = _figures(pipeline, pipeline.run([KEY]))
    row = {
        "order": list(order),
        "edited": edited,
        "appended": appended,
        # What the issue asks: the re-run computes exactly the edited and appended rows.
        "rerun_computes_exactly_the_changed_rows": runs["rerun"]["rows_computed"]
        == edited + appended,
        "first": first,
        **runs,
        "speedup": runs["full"]["wall_seconds"] / runs["rerun"]["wall_seconds"],
        "outputs": _compare(rerun, full),
    }
    log.info(
        "incremental round %d: re-run %.1fs (%d computed, %d reused) vs full %.1fs (%d)",
        number,
        runs["rerun"]["wall_seconds"],
        runs["rerun"]["rows_computed"],
        runs["rerun"]["rows_reused"],
        runs["full"]["wall_seconds"],
        runs["full"]["rows_computed"],
    )
    return row


def run_incremental(ctx: BenchContext) -> dict[str, Any]:
    rows = ctx.sizes.incremental_rows
    texts = embed_texts(rows, seed=29)
    rounds = [_round(ctx, number, texts) for number in range(ctx.sizes.rounds)]
    return {
        "rows": rows,
        "appended_fraction": APPENDED,
        "edited_fraction": EDITED,
        "chunk_size": ctx.sizes.chunk_size,
        "model": "all-MiniLM-L6-v2 (embed)",
        "rerun_wall_seconds": summarize([r["rerun"]["wall_seconds"] for r in rounds]).__dict__,
        "full_wall_seconds": summarize([r["full"]["wall_seconds"] for r in rounds]).__dict__,
        "speedup": summarize([r["speedup"] for r in rounds]).__dict__,
        "rounds": rounds,
    }
