"""The code location of the pools section's batch API part (`bench/pool_batches.py`), loaded
by a real `dagster-daemon`: the batch pipelines of the routing table in
`GPUINFER_BATCH_ROUTES` (one route on an engine pool, one with a worker per run), and the
bench's local resource with its pool on the section's lease queue (`GPUINFER_BENCH_POOL_*`).
"""

import os

import dagster as dg

from bench.platform_run import local_resource
from dagster_gpuinfer.batch_api.pipelines import batch_pipelines
from dagster_gpuinfer.batch_api.routing import load_routing_table
from dagster_gpuinfer.resource import PoolSettings
from dagster_gpuinfer.worker.loop.engine import LOAD_LOG_ENV

batch_api = batch_pipelines(load_routing_table(), minimum_interval_seconds=1)

pool = PoolSettings(
    queue=os.environ["GPUINFER_BENCH_POOL_QUEUE"],
    max_workers=int(os.environ["GPUINFER_BENCH_POOL_MAX_WORKERS"]),
    idle_ttl_s=float(os.environ["GPUINFER_BENCH_POOL_IDLE_TTL"]),
    lease_ttl_s=float(os.environ["GPUINFER_BENCH_POOL_LEASE_TTL"]),
)

defs = dg.Definitions.merge(
    batch_api.defs,
    dg.Definitions(
        resources={
            "gpu": local_resource(
                env={
                    "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_LOGGING_LEVEL": "WARNING",
                    LOAD_LOG_ENV: os.environ[LOAD_LOG_ENV],
                },
                pool=pool,
            )
        },
        executor=dg.in_process_executor,
    ),
)
