"""Seeded sampling on vLLM's CPU build: no chunked prefill, so a seed never ends the engine.

vLLM's model runner drops the token it samples for a prompt that a step prefilled only in
part (chunked prefill) and rewinds that request's random generator with
`Generator.set_offset(get_offset() - 4)`, an offset only CUDA's Philox generators have. On
the CPU build a seeded request (a row's `seed`, OpenAI's `seed` field, or the pipeline's
`sampling.seed`) whose prompt a step splits raises `RuntimeError: CPU Generator does not use
offset` inside the engine, and the engine dies with every request in flight
(`tests/test_seeded_cpu_engine.py` reproduced it: 40 seeded rows of 200 tokens against the
CPU build's 4,096 tokens a step). A GPU build is unaffected.

So on the CPU build the worker turns chunked prefill off for sampling tasks, as vLLM's CPU
platform itself does for MLA models: the scheduler then admits a prompt whole or not in that
step, and vLLM raises `max_num_batched_tokens` to `max_model_len` where it is lower and not
set. Decode and prefill still share steps; on the long-tailed bench workload per-row seeded
rates matched unseeded ones (3,513/3,482 against 3,543/3,290 generated tokens/s, 2,048
rows), and each row's output was the same across calls and row orders.

Where the pipeline sets `enable_chunked_prefill` itself, or a `max_num_batched_tokens` below
`max_model_len` (or without one: vLLM refuses such a budget without chunked prefill), its
setting stands; if chunked prefill is then on, a seeded row is refused as
`unsupported_parameter` on `seed` (`InferenceEngine` checks the built engine, `seeds_unsafe`)
and a pipeline-wide `sampling.seed` fails the job before any row is read.
"""

from __future__ import annotations

import logging
from typing import Any

from dagster_gpuinfer.worker.loop.cpu_dtype import vllm_on_cpu

log = logging.getLogger("dagster_gpuinfer.worker")


def resolve_cpu_chunked_prefill(
    kwargs: dict[str, Any], *, samples: bool, on_cpu: bool | None = None
) -> dict[str, Any]:
    """`kwargs` with `enable_chunked_prefill=False` on vLLM's CPU build for a sampling task
    that leaves `enable_chunked_prefill` unset and sets no `max_num_batched_tokens` below
    `max_model_len`; otherwise `kwargs` as given.

    Args:
        samples: the task samples tokens (generate, chat, vision); pooling tasks never seed.
        on_cpu: vLLM runs on its CPU platform (default: asks vLLM).
    """
    if not samples or "enable_chunked_prefill" in kwargs:
        return kwargs
    budget, longest = kwargs.get("max_num_batched_tokens"), kwargs.get("max_model_len")
    if budget is not None and (longest is None or budget < longest):
        return kwargs  # vLLM admits no prompt over the budget without chunked prefill
    if not (vllm_on_cpu() if on_cpu is None else on_cpu):
        return kwargs
    log.info(
        "enable_chunked_prefill -> False on vLLM's CPU build: a seeded request whose prompt a "
        "step splits ends its engine there; set engine enable_chunked_prefill to override"
    )
    return {**kwargs, "enable_chunked_prefill": False}


def seeds_unsafe(llm: Any, *, on_cpu: bool | None = None) -> bool:
    """The built engine would die on a seeded request: the CPU build with chunked prefill on
    (the pipeline turned it on, or set a `max_num_batched_tokens` that keeps it on)."""
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    if not getattr(scheduler, "enable_chunked_prefill", False):
        return False
    return vllm_on_cpu() if on_cpu is None else on_cpu
