"""The chaos backfill's code location: the reference `doc_embeddings` pipeline
(assets/definitions.py: MiniLM embeddings of `docs-*.parquet` shards keyed by `doc_id`, float32,
the reference's `TRANSIENT_RETRIES`) over as many shards as the run asks, on the production
k8s resource (resources/k8s.py, minus the GPU request) whose cluster is the harness's pod
executor. The harness loads this file as an in-process code location (the daemon's and the
run workers'); what it points at comes from `bench.chaos.cluster.current()`.
"""

import dagster as dg

from bench.chaos.cluster import current, k8s_resource
from bench.chaos.store_faults import batch_defs
from dagster_gpuinfer import EngineArgs, InputSpec, inference_assets

TRANSIENT_RETRIES = dg.RetryPolicy(  # assets/definitions.py's, kept equal by a test
    max_retries=2, delay=5, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
)


@dg.definitions
def defs() -> dg.Definitions:
    setup = current()
    pipeline = inference_assets(
        name="doc_embeddings",
        model=setup.model,
        task="embed",
        input=InputSpec(
            uri=f"{setup.input_root}/docs/{{partition_key}}.parquet", id_column="doc_id"
        ),
        input_asset_key="doc_shards",
        output_root=setup.output_root,
        partitions_def=dg.StaticPartitionsDefinition(setup.partition_keys),
        engine=EngineArgs(dtype="float32"),
        chunk_size=setup.chunk_size,
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=setup.per_run),
        retry_policy=TRANSIENT_RETRIES,
        group_name="embeddings",
    )
    pipelines = [pipeline]
    if setup.pools is not None:  # --mode pools: bench/chaos/pool_faults.py
        from bench.chaos.pool_faults import pipelines as pool_pipelines

        pipelines += pool_pipelines(setup, TRANSIENT_RETRIES)
    backfill = dg.Definitions(
        assets=[asset for p in pipelines for asset in p.assets],
        resources={"gpu": k8s_resource(setup)},
        executor=dg.in_process_executor,
    )
    return dg.Definitions.merge(backfill, *batch_defs(setup, TRANSIENT_RETRIES))
