"""Shared fixtures: real models, real Dagster instances, a loopback S3 server.

Tests marked `engine` start the real vLLM CPU engine (about 25 s a start on 2 cores); they
share runs through module-scoped fixtures so the suite stays within its time budget.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dagster as dg
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each test engine's KV cache, explicit (GiB; the local workers inherit it). Without it vLLM's
# CPU build reserves gpu_memory_utilization (0.2 in the tests) of the machine's memory per
# engine, 4.6 GiB on a 23 GiB box, and the tiny test models need a few MiB: four engines at
# once (two 2-engine tests on the two xdist workers) had the kernel OOM-kill one, and an
# engine starting beside three others refuses to start for want of memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from assets.models import minilm_path

    return minilm_path()


@pytest.fixture(scope="session")
def tiny_llama_dir() -> str:
    from assets.models import make_tiny_llama
    from assets.paths import generation_model_dir

    return make_tiny_llama(generation_model_dir())


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as test_instance:
        yield test_instance


# --------------------------------------------------------------------------- loopback S3
# A real S3 wire protocol on 127.0.0.1 (moto's server, as dagster-aws tests use): boto3,
# pyarrow and the worker subprocess all talk HTTP to it; nothing is patched.

from s3_test_env import S3_TEST_ENV  # noqa: E402  (test modules import it from there)


@dataclass
class LoopbackS3:
    endpoint_url: str
    region: str
    client: Any
    _buckets: Iterator[int]

    def new_bucket(self, stem: str = "gpuinfer") -> str:
        """A fresh, empty bucket, so tests sharing the server never see each other's keys."""
        name = f"{stem}-{next(self._buckets):04d}"
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        return [
            item["Key"]
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", ())
        ]

    def read(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LoopbackS3]:
    """A moto S3 server on a free loopback port, with test credentials in the environment
    (which worker subprocesses inherit, like a pod's mounted secret)."""
    import boto3
    from moto.server import ThreadedMotoServer

    saved = {name: os.environ.get(name) for name in S3_TEST_ENV}
    os.environ.update(S3_TEST_ENV)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        yield LoopbackS3(endpoint, "us-east-1", client, itertools.count())
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --------------------------------------------------------------------------- pods that run
# tests/pod_executor.py: a fake CoreV1Api whose pods run for real (namespaces; needs root).


@pytest.fixture
def pod_executor() -> Iterator[Any]:
    """A `PodExecutor` (set `.secrets`, `.config_maps`, `.claims`, `.plans` before creating
    pods); every process, namespace and link it made is removed after the test, always."""
    from pod_executor import PodExecutor

    executor = PodExecutor()
    try:
        yield executor
    finally:
        executor.close()
