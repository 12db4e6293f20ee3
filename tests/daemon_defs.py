"""A code location that the daemon tests load in-process (sensor, backfill and automation
daemons ticked by hand), configured through environment variables set by each test:

- GPUINFER_TEST_INPUT_URI: the input template, e.g. `s3://bucket/in/{partition_key}.jsonl`
- GPUINFER_TEST_OUTPUT_ROOT: where outputs go
- GPUINFER_TEST_MODEL: the embedding model directory
- GPUINFER_TEST_S3_ENDPOINT: the loopback S3 endpoint, if any
- GPUINFER_TEST_SPLIT_MIN_BYTES / GPUINFER_TEST_SPLIT_BYTES: split JSONL files this large
- GPUINFER_TEST_SQS_QUEUE_URL: the queue of S3 event notifications to read instead of
  listing (`sqs_arrival_sensor`, at GPUINFER_TEST_S3_ENDPOINT)
"""

import os

import dagster as dg

from assets.downstream import embedding_stats_asset
from dagster_gpuinfer import EngineArgs, GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.arrivals import SplitLargeFiles
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.sqs_sensor import sqs_arrival_sensor

PARTITIONS = dg.DynamicPartitionsDefinition(name="doc_files")


@dg.definitions
def defs() -> dg.Definitions:
    env = os.environ
    pipeline = inference_assets(
        name="doc_vectors",
        model=env.get("GPUINFER_TEST_MODEL", "/models/not-loaded-in-this-test"),
        task="embed",
        input=InputSpec(uri=env["GPUINFER_TEST_INPUT_URI"], id_column="id"),
        output_root=env["GPUINFER_TEST_OUTPUT_ROOT"],
        partitions_def=PARTITIONS,
        engine=EngineArgs(dtype="float32"),
        chunk_size=16,
    )
    split = None
    if env.get("GPUINFER_TEST_SPLIT_MIN_BYTES"):
        split = SplitLargeFiles(
            min_bytes=int(env["GPUINFER_TEST_SPLIT_MIN_BYTES"]),
            jsonl_bytes_per_partition=int(env["GPUINFER_TEST_SPLIT_BYTES"]),
        )
    endpoint = env.get("GPUINFER_TEST_S3_ENDPOINT")
    return dg.Definitions(
        assets=[*pipeline.assets, embedding_stats_asset(pipeline)],
        sensors=[
            sqs_arrival_sensor(
                pipeline,
                queue_url=env["GPUINFER_TEST_SQS_QUEUE_URL"],
                endpoint_url=endpoint,
                region="us-east-1",
                wait_time_seconds=0,
                visibility_timeout_seconds=30,
                minimum_interval_seconds=1,
                default_status=dg.DefaultSensorStatus.RUNNING,
            )
            if env.get("GPUINFER_TEST_SQS_QUEUE_URL")
            else arrival_sensor(
                pipeline,
                split=split,
                minimum_interval_seconds=1,
                default_status=dg.DefaultSensorStatus.RUNNING,
            )
        ],
        resources={
            "gpu": GpuInferenceResource(
                launcher="local",
                engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
                env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
                s3_endpoint_url=endpoint,
                s3_region="us-east-1" if endpoint else None,
                s3_allow_http=bool(endpoint),
            )
        },
        executor=dg.in_process_executor,
    )
