"""The chaos harness (bench/chaos/): its seeded schedule, its fault proxy in front of a real
loopback S3, and one short seed end to end (`make chaos SEED=n` runs the long ones: a backfill
of 50 partitions through the k8s launcher on the pod executor, baseline and faults).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import boto3
import pytest
from botocore.config import Config
from moto.server import ThreadedMotoServer

from bench.chaos.faults import KINDS, schedule
from bench.chaos.s3_proxy import FaultProxy


def test_the_schedule_is_a_function_of_the_seed_and_names_every_kind():
    count = len(KINDS) + 2
    first = schedule(7, count, 300.0)
    assert first == schedule(7, count, 300.0)
    assert first != schedule(8, count, 300.0)
    assert set(KINDS) <= {fault.kind for fault in first}  # more faults than kinds: each once
    assert [f.at for f in first] == sorted(f.at for f in first)
    assert all(0 < f.at < 300.0 for f in first)
    assert {f.kind for f in schedule(1, 2, 60.0, ("oom",))} == {"oom"}


def test_the_chaos_pipeline_keeps_the_reference_retry_policy():
    from assets.definitions import TRANSIENT_RETRIES
    from bench.chaos.defs import TRANSIENT_RETRIES as CHAOS_RETRIES

    assert CHAOS_RETRIES == TRANSIENT_RETRIES


@pytest.fixture
def proxied(monkeypatch):
    from s3_test_env import S3_TEST_ENV

    for name, value in S3_TEST_ENV.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = FaultProxy("127.0.0.1", server.get_host_and_port(), seed=5).start()
    no_retries = Config(retries={"max_attempts": 1, "mode": "standard"})
    client = boto3.client(
        "s3", endpoint_url=proxy.endpoint, region_name="us-east-1", config=no_retries
    )
    client.create_bucket(Bucket="chaos-proxy")
    try:
        yield proxy, client
    finally:
        proxy.stop()
        server.stop()


def test_the_proxy_passes_requests_unchanged_outside_a_window(proxied):
    proxy, client = proxied
    body = os.urandom(300_000)
    client.put_object(Bucket="chaos-proxy", Key="a/b.bin", Body=body)
    assert client.get_object(Bucket="chaos-proxy", Key="a/b.bin")["Body"].read() == body
    assert client.head_object(Bucket="chaos-proxy", Key="a/b.bin")["ContentLength"] == len(body)
    assert not proxy.injected


@pytest.mark.parametrize(
    ("kind", "variants"),
    [("s3_5xx", {"503-before", "500-after"}), ("s3_reset", {"reset-before", "reset-after",
                                                            "reset-mid-body"})],
)  # fmt: skip
def test_every_request_in_a_full_window_fails_as_the_kind_says(proxied, kind, variants):
    proxy, client = proxied
    client.put_object(Bucket="chaos-proxy", Key="k", Body=b"x" * 50_000)
    proxy.open_window(kind, seconds=600, rate=1.0)
    failed = 0
    for _ in range(30):
        try:
            client.get_object(Bucket="chaos-proxy", Key="k")["Body"].read()
        except Exception:  # noqa: BLE001 - botocore's error classes differ by variant
            failed += 1
    assert failed == 30
    assert set(proxy.injected) == variants
    assert sum(proxy.injected.values()) >= 30


def test_overlapping_windows_each_inject_their_kind(proxied):
    """Seed 3 opened a reset and a 5xx window at once; the second replaced the first."""
    proxy, client = proxied
    client.put_object(Bucket="chaos-proxy", Key="k", Body=b"x" * 1000)
    proxy.open_window("s3_reset", seconds=600, rate=0.5)
    proxy.open_window("s3_5xx", seconds=600, rate=1.0)
    for _ in range(30):
        try:
            client.get_object(Bucket="chaos-proxy", Key="k")["Body"].read()
        except Exception:  # noqa: BLE001,S112 - every request fails one way or the other
            continue
    kinds = {"reset" if v.startswith("reset") else "5xx" for v in proxy.injected}
    assert kinds == {"reset", "5xx"}


def test_a_slow_window_delays_but_answers(proxied):
    proxy, client = proxied
    client.put_object(Bucket="chaos-proxy", Key="k", Body=b"slow")
    proxy.open_window("s3_slow", seconds=600, rate=1.0)
    assert client.get_object(Bucket="chaos-proxy", Key="k")["Body"].read() == b"slow"
    assert proxy.injected == Counter({"slow": 1})


def test_an_unknown_fault_kind_is_refused_by_name(proxied):
    proxy, _ = proxied
    with pytest.raises(ValueError, match="unknown S3 fault 's3_teapot'"):
        proxy.open_window("s3_teapot", 1, 1.0)


@pytest.mark.engine
def test_a_short_chaos_seed_commits_every_partition_once(tmp_path):
    """Four partitions in two runs through the k8s launcher on the pod executor, with a
    preemption, an S3 5xx window and a daemon restart: every row once, nothing left."""
    from bench.chaos.__main__ import main

    kinds = ("pod_delete", "s3_5xx", "daemon_restart")
    argv = ["--seed", "3", "--partitions", "4", "--per-run", "2", "--rows", "12"]
    argv += ["--chunk-size", "4", "--faults", "3", "--kinds", ",".join(kinds)]
    argv += ["--span-s", "60", "--no-baseline", "--results", str(tmp_path), "--batches", "0"]
    code = main(argv)
    report = (tmp_path / "RESULTS.md").read_text()
    assert code == 0, report
    [chaos] = json.loads((tmp_path / "results.json").read_text())["phases"]
    assert sorted(i["fault"]["kind"] for i in chaos["injected"]) == sorted(kinds), report
    assert chaos["committed"] == chaos["asked"] == 4
    assert chaos["rows_out"] + chaos["rows_errored"] == chaos["rows_in"] == 48
    assert chaos["lost"] == chaos["duplicated"] == 0
    assert chaos["leftover_processes"] == []
    assert chaos["step_retries"] + chaos["run_retries"] >= 1  # the preemption was retried
