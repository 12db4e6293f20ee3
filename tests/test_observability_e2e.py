"""A real worker run through Dagster, pushed to a real Pushgateway that a real Prometheus
server scrapes: Prometheus' HTTP API then holds the run's rows and tokens with the run's
labels, and the partitions' Dagster metadata holds their telemetry and the run's time split.

The servers come from `deploy/local/test-prometheus.sh` (Debian's prometheus and
prometheus-pushgateway on loopback), which `make test` starts; without them these tests
fail and say how to start them, never skip.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request
from typing import Any

import dagster as dg
import pytest
from support import (
    cpu_resource,
    gen_pipeline,
    materialize_partitions,
    partition_metadata,
    write_prompts,
)

pytestmark = pytest.mark.engine

ROWS = {"p0": 24, "p1": 16}


def server_url(name: str) -> str:
    url = os.environ.get(name)
    if not url:
        pytest.fail(
            f"{name} is not set: run the suite with `make test`, or start the servers with "
            '`eval "$(bash deploy/local/test-prometheus.sh)"` first'
        )
    return url


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def query_until(prometheus: str, promql: str, *, expect: float, timeout: float = 60) -> list:
    """Prometheus scrapes the Pushgateway every second: wait for the pushed value to land."""
    deadline = time.monotonic() + timeout
    result: list = []
    while time.monotonic() < deadline:
        result = query(prometheus, promql)
        if result and float(result[0]["value"][1]) == expect:
            return result
        time.sleep(1)
    return result


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, tiny_llama_dir):
    prometheus = server_url("GPUINFER_TEST_PROMETHEUS_URL")
    pushgateway = server_url("GPUINFER_TEST_PUSHGATEWAY_URL")
    root = tmp_path_factory.mktemp("observed")
    for key, rows in ROWS.items():
        write_prompts(root / "in" / f"{key}.jsonl", rows)
    pipeline = gen_pipeline(root, tiny_llama_dir, chunk_size=8, retries=0, partitions=tuple(ROWS))
    resource = cpu_resource(pushgateway_url=pushgateway, env={"GPUINFER_TELEMETRY_INTERVAL": "0.2"})
    with dg.instance_for_test() as instance:
        result = materialize_partitions(pipeline, list(ROWS), resource=resource, instance=instance)
        assert result.success
        metadata = {
            key: partition_metadata(instance, pipeline.output_asset.key, key) for key in ROWS
        }
        yield {"run_id": result.run_id, "metadata": metadata, "prometheus": prometheus}


def test_prometheus_holds_the_runs_rows_and_tokens_with_its_labels(observed_run):
    prometheus, run_id = observed_run["prometheus"], observed_run["run_id"]
    for key, rows in ROWS.items():
        found = query_until(
            prometheus,
            f'gpuinfer_rows_out_total{{run="{run_id}",asset="gen",partition="{key}"}}',
            expect=rows,
        )
        assert found, f"Prometheus has no rows_out for run {run_id} partition {key}"
        assert float(found[0]["value"][1]) == rows
        assert found[0]["metric"]["job"] == "gpuinfer_worker"
    metadata = observed_run["metadata"]
    generated = sum(m["generated_tokens"] for m in metadata.values())
    prompt = sum(m["prompt_tokens"] for m in metadata.values())
    assert generated > 0
    found = query_until(
        prometheus,
        f'sum(gpuinfer_generated_tokens_total{{run="{run_id}",asset="gen"}})',
        expect=generated,
    )
    assert found and float(found[0]["value"][1]) == generated
    found = query_until(
        prometheus,
        f'sum(gpuinfer_prompt_tokens_total{{run="{run_id}",asset="gen"}})',
        expect=prompt,
    )
    assert found and float(found[0]["value"][1]) == prompt
    # vLLM's own counter, relabelled with the run: the engine saw the same generated tokens
    found = query_until(
        prometheus,
        f'sum(vllm:generation_tokens_total{{run="{run_id}",asset="gen"}})',
        expect=generated,
    )
    assert found and float(found[0]["value"][1]) == generated
    # the worker finished: its last push says so
    found = query_until(prometheus, f'gpuinfer_worker_up{{run="{run_id}"}}', expect=0)
    assert found
    # the launcher's own group (local launcher: no pod start, no step-down)
    found = query_until(
        prometheus,
        f'gpuinfer_launcher_partitions{{run="{run_id}",outcome="committed"}}',
        expect=len(ROWS),
    )
    assert found


def test_partition_metadata_shows_telemetry_and_the_runs_time_split(observed_run):
    for metadata in observed_run["metadata"].values():
        assert metadata["gpu_utilization_mean"] == "n/a"  # no NVIDIA GPU here
        assert metadata["gpu_utilization_p95"] == "n/a"
        saturation = metadata["engine_saturation_mean"]
        assert isinstance(saturation, float) and 0.0 <= saturation <= 1.0, saturation
        kv = metadata["kv_cache_usage_p95"]
        assert isinstance(kv, float) and 0.0 <= kv <= 1.0, kv  # vLLM's gauge was read
        assert metadata["telemetry"]["samples"] >= 1
        assert metadata["commit_seconds"] > 0
        assert metadata["run_queued_seconds"] == "n/a"  # local launcher: no queue
        assert metadata["run_pod_start_seconds"] == "n/a"
        assert metadata["run_load_seconds"] > 0
        assert metadata["run_inference_seconds"] > 0
        assert metadata["run_commit_seconds"] > 0
