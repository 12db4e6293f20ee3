"""Ordering rows for the engine's prefix cache, across the worker's read-ahead.

Rows whose prompts share long headers (a system prompt, few-shot examples), in shuffled
order, go through one engine three ways per round, with its KV cache reset before each:

- grouped: the worker's own entry for a partition (`run_partition`: the rows' shard read,
  chunks of `longtail_chunk_sizes[0]` rows inferred, written and committed as in a run),
  rows submitted grouped by shared prefix across the read-ahead (the default,
  `group_prefixes`);
- input order: the same loop with `group_prefixes=False`;
- raw input order: one `LLM.generate` over the rows' texts in input order, prefix caching on
  (what a user calls; vLLM tokenizes, as the worker's loop does).

The KV cache is kept small, as on a busy GPU, so a header computed once can be evicted
before its next use.
"""

from __future__ import annotations

import logging
from typing import Any

from bench.context import BenchContext
from bench.server import ContestantProcess
from bench.stats import paired_ratios, rotations, summarize
from bench.workloads import prefix_texts
from dagster_gpuinfer import EngineArgs, InputSpec, SamplingParams
from dagster_gpuinfer.spec import InferenceSpec, OutputSpec

log = logging.getLogger("bench")
ORDERS = ("grouped", "input order", "raw input order")


def _prefix_spec(ctx: BenchContext, root: Any, resource: Any) -> InferenceSpec:
    """The generation spec the prefix section serves, with prefix caching on and a small
    KV cache, as the environment's resource runs it."""
    sizes = ctx.sizes
    return resource.prepare_spec(
        InferenceSpec(
            model=ctx.generate_model(),
            task="generate",
            engine=EngineArgs(
                max_model_len=512,
                enable_prefix_caching=True,
                extra={"kv_cache_memory_bytes": sizes.prefix_kv_cache_bytes},
            ),
            sampling=SamplingParams(temperature=0.0, max_tokens=sizes.prefix_max_tokens),
            input=InputSpec(uri=str(root / "{partition_key}.parquet")),
            output=OutputSpec(root=str(root / "out"), asset_name="prefix"),
            chunk_size=sizes.prefix_rows,
        )
    )


def run_prefix_cache(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    root = ctx.fresh_dir("prefix")
    from bench.platform_run import local_resource

    resource = local_resource(env=ctx.engine_env())
    spec = _prefix_spec(ctx, root, resource)
    texts = prefix_texts(
        sizes.prefix_rows,
        headers=sizes.prefix_headers,
        header_examples=sizes.prefix_header_examples,
    )
    engine = ContestantProcess(
        "prefix-engine",
        "bench.backends:EngineBackend",
        dict(spec_json=spec.model_dump_json()),
        env=resource.env,
        log_dir=ctx.log_dir,
    )
    chunk_size = sizes.longtail_chunk_sizes[0]
    try:
        token_ids = engine.call("tokenize", texts)
        rates: dict[str, list[float]] = {name: [] for name in ORDERS}
        prompt_rates: dict[str, list[float]] = {name: [] for name in ORDERS}
        cached: dict[str, list[float]] = {name: [] for name in ORDERS}
        fingerprints: dict[str, set[str]] = {name: set() for name in ORDERS}
        for round_index, order in enumerate(rotations(list(ORDERS), sizes.rounds)):
            for name in order:
                if name == "raw input order":
                    out = engine.call("raw_generate", texts)
                else:
                    out = engine.call(
                        "stream", texts, chunk_size=chunk_size, group_prefixes=name == "grouped"
                    )
                rates[name].append(out["rows"] / out["seconds"])
                prompt_rates[name].append(out["prompt_tokens"] / out["seconds"])
                cached[name].append(out["cached_tokens"] / max(out["prompt_tokens"], 1))
                fingerprints[name].add(out["fingerprint"])
                log.info(
                    "prefix round %d %-11s %7.1f rows/s, %4.0f%% prompt tokens cached",
                    round_index,
                    name,
                    rates[name][-1],
                    100 * cached[name][-1],
                )
    finally:
        engine.close()
    prompt_tokens = sum(len(t) for t in token_ids)
    return {
        "rows": len(texts),
        "headers": sizes.prefix_headers,
        "mean_prompt_tokens": prompt_tokens / len(token_ids),
        "kv_cache_mib": sizes.prefix_kv_cache_bytes / (1 << 20),
        "max_tokens": sizes.prefix_max_tokens,
        "orders": {
            name: {
                "rows_per_s": rates[name],
                "rows_per_s_summary": summarize(rates[name]).__dict__,
                "prompt_tokens_per_s_summary": summarize(prompt_rates[name]).__dict__,
                "cached_fraction_summary": summarize(cached[name]).__dict__,
            }
            for name in ORDERS
        },
        "chunk_size": chunk_size,
        "window": engine.info.get("window"),
        "ratio_grouped_over_input": paired_ratios(rates["grouped"], rates["input order"]).__dict__,
        "ratio_grouped_over_raw": paired_ratios(
            rates["grouped"], rates["raw input order"]
        ).__dict__,
        "same_outputs_both_orders": fingerprints["grouped"] == fingerprints["input order"]
        and len(fingerprints["grouped"]) == 1,
        "same_outputs_as_raw": fingerprints["grouped"] == fingerprints["raw input order"],
    }
