"""deploy/observability/: the alert rules under `promtool` (syntax and unit tests of every
alert firing and not firing), the dashboard generated from code, and the names that join
them to what the worker, the launcher, vLLM and DCGM really export."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest

from dagster_gpuinfer.k8s.config import K8sLauncherConfig
from dagster_gpuinfer.k8s.metrics_port import METRICS_PORT_NAME, with_metrics_port
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.pools import JobSubmission, SqliteLeaseQueue, WorkItem
from dagster_gpuinfer.pools.metrics import POOL_METRICS, pool_registry
from dagster_gpuinfer.run_metrics import (
    LAUNCHER_METRICS,
    POOL_LAUNCHER_METRICS,
    launcher_registry,
    metrics_env,
)
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.metrics import PLATFORM_METRICS, WorkerMetrics
from dagster_gpuinfer.worker.telemetry import EngineGauges, GpuSample, TelemetrySampler

ROOT = Path(__file__).resolve().parent.parent
OBSERVABILITY = ROOT / "deploy" / "observability"

# GPU fields in dcgm-exporter's default counters (etc/default-counters.csv and
# dcp-metrics-included.csv of NVIDIA/dcgm-exporter) that the dashboard and rules may use.
DCGM_METRICS = {
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_DEV_POWER_USAGE",
}
# Kueue's own metrics (kueue.x-k8s.io, pkg/metrics), used by the backlog alert.
KUEUE_METRICS = {"kueue_pending_workloads", "kueue_admission_wait_time_seconds"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_NAME = re.compile(
    r"\b(gpuinfer_[a-z0-9_]+|vllm:[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+|kueue_[a-z0-9_]+)"
)


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail(
            "promtool is not installed: run `bash deploy/local/test-prometheus.sh` (it installs "
            "Debian's prometheus package, which ships promtool), or `make test`"
        )
    return found


def vllm_metric_names() -> set[str]:
    """Every `vllm:*` metric the installed vLLM's Prometheus stat logger defines (read from
    its source: importing vllm here would cost seconds and the control plane's test)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    names = set(re.findall(r'"(vllm:[a-z0-9_]+)"', source))
    assert "vllm:num_requests_running" in names and "vllm:kv_cache_usage_perc" in names
    return names


def exported_names() -> set[str]:
    return (
        set(PLATFORM_METRICS)
        | set(LAUNCHER_METRICS)
        | set(POOL_LAUNCHER_METRICS)
        | set(POOL_METRICS)
        | vllm_metric_names()
        | DCGM_METRICS
    )


def base_name(name: str, known: set[str]) -> str:
    if name in known:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in known:
            return name.removesuffix(suffix)
    if name.endswith("_total") and name.removesuffix("_total") in known:  # vLLM counters
        return name.removesuffix("_total")
    return name


def rule_groups() -> dict:
    document = yaml.safe_load((OBSERVABILITY / "prometheus-rule.yaml").read_text())
    assert document["kind"] == "PrometheusRule"
    return document["spec"]


# --------------------------------------------------------------------------- exported names


def test_platform_metric_list_is_what_the_worker_registry_exports():
    sampler = TelemetrySampler(
        gpu_reader=None,
        engine_gauges=lambda: EngineGauges(running=4, waiting=1, kv_cache_usage=0.5),
        clock=lambda: 1.0,
    )
    metrics = WorkerMetrics(asset="a", run_id="r", sampler=sampler)
    metrics._export_sample(SimpleNamespace(gpus=(GpuSample("0", 50.0, 1, 2),), engine=None))
    metrics.model_loaded(1.0, max_num_seqs=8)
    metrics.model_load_failed(ValueError("x"))
    metrics.partition_started("p")
    marker = SimpleNamespace(
        rows_in=2,
        rows_out=1,
        rows_errored=1,
        prompt_tokens=3,
        generated_tokens=4,
        inference_seconds=0.1,
        write_seconds=0.1,
    )
    metrics.chunk_committed("p", marker, [RowError("i", "s", 0, "empty", "m")])
    metrics.partition_telemetry("p", rows_resumed=1)
    metrics.partition_failed("q", "ShardError")
    # a GPU sample to set the GPU gauges
    sampler.gpu_reader = SimpleNamespace(
        read=lambda: (GpuSample("0", 50.0, 1, 2),), close=lambda: None
    )
    sampler.sample_once()
    exported = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in metrics.registry.collect()
        if not family.name.startswith("vllm:")
    }
    assert exported == set(PLATFORM_METRICS)


def test_launcher_metric_list_is_what_the_launcher_pushes():
    result = SimpleNamespace(
        pod_start={
            "queued_seconds": 30.0,
            "scheduling_seconds": 2.0,
            "container_start_seconds": 40.0,
        },
        memory_step_down={"max_num_seqs": {"from": 8, "to": 4}},
        manifests={"p": 1},
        failed={},
    )
    registry = launcher_registry(asset="a", run_id="r", result=result)
    assert {family.name for family in registry.collect()} == set(LAUNCHER_METRICS)
    text = generate_latest(registry).decode()
    assert 'gpuinfer_launcher_queued_seconds{asset="a",run="r"} 30.0' in text
    assert 'gpuinfer_launcher_oom_step_downs{asset="a",run="r"} 1.0' in text


def test_launcher_pushes_warm_and_cold_partitions_of_a_pool_run():
    result = SimpleNamespace(
        pod_start=None,
        memory_step_down=None,
        manifests={"p0": 1, "p1": 1, "p2": 1},
        failed={},
        pool={
            "p0": {"warm": False, "queue_wait_s": 0.5, "leases": 1},
            "p1": {"warm": True, "queue_wait_s": 3.25, "leases": 2},
            "p2": {"warm": True, "queue_wait_s": None, "leases": 1},
        },
    )
    registry = launcher_registry(asset="a", run_id="r", result=result)
    names = {family.name for family in registry.collect()}
    assert set(POOL_LAUNCHER_METRICS) <= names
    text = generate_latest(registry).decode()
    assert 'gpuinfer_launcher_pool_partitions{asset="a",engine="warm",run="r"} 2.0' in text
    assert 'gpuinfer_launcher_pool_partitions{asset="a",engine="cold",run="r"} 1.0' in text
    assert 'gpuinfer_launcher_pool_queue_wait_seconds{asset="a",run="r"} 3.25' in text
    assert 'gpuinfer_launcher_pool_leases{asset="a",run="r"} 4.0' in text


def test_pool_metric_list_is_what_the_pool_collector_exports(tmp_path):
    now = [1000.0]
    with SqliteLeaseQueue(tmp_path / "q.db", clock=lambda: now[0]) as queue:
        queue.submit(JobSubmission("big", "pool-a", [WorkItem(f"p{i}") for i in range(5)]))
        queue.submit(JobSubmission("urgent", "pool-a", [WorkItem("x")], priority=7))
        first = queue.lease("pool-a", worker_id="w1", ttl_s=30)
        queue.lease("pool-a", worker_id="w2", ttl_s=5)
        queue.report_worker("pool-a", "w1", state="busy", ttl_s=60, info={"warm_hits": 3})
        queue.report_worker("pool-a", "w2", state="busy", ttl_s=60, info={"cold_starts": 1})
        queue.report_worker("pool-a", "w3", state="starting", ttl_s=60)
        now[0] += 10  # w2's lease lapsed; w1's is 10 s old
        registry, collector = pool_registry(queue, ["pool-idle"])
        text = generate_latest(registry).decode()
        exported = {family.name for family in registry.collect()}
        assert first is not None
    assert exported == set(POOL_METRICS)
    assert collector.seen == {"pool-a"}  # pool-idle: no backlog, no workers
    for line in (
        'gpuinfer_pool_workers{pool="pool-a",state="busy"} 2.0',
        'gpuinfer_pool_workers{pool="pool-a",state="starting"} 1.0',
        'gpuinfer_pool_workers{pool="pool-idle",state="idle"} 0.0',
        'gpuinfer_pool_queued_items{pool="pool-a",priority="0"} 5.0',  # 4 + the lapsed one
        'gpuinfer_pool_leased_items{pool="pool-a"} 1.0',
        'gpuinfer_pool_oldest_lease_age_seconds{pool="pool-a"} 10.0',
        'gpuinfer_pool_expired_leases{pool="pool-a"} 1.0',
        'gpuinfer_pool_warm_hits{pool="pool-a"} 3.0',
        'gpuinfer_pool_cold_starts{pool="pool-a"} 1.0',
    ):
        assert line in text, line


# --------------------------------------------------------------------------- rules


def test_rules_pass_promtool_check_and_unit_tests(tmp_path):
    tool = promtool()
    (tmp_path / "gpuinfer-rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    shutil.copy(OBSERVABILITY / "rules-test.yaml", tmp_path / "rules-test.yaml")
    checked = subprocess.run(
        [tool, "check", "rules", "gpuinfer-rules.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [tool, "test", "rules", "rules-test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    alerts = {rule["alert"] for group in rule_groups()["groups"] for rule in group["rules"]}
    assert alerts == {
        "GpuinferLowGpuUtilization",
        "GpuinferKueueBacklog",
        "GpuinferRepeatedPartitionFailures",
        "GpuinferModelLoadErrors",
        "GpuinferOutOfMemoryStepDowns",
        "GpuinferPoolLeasesExpiring",
        "GpuinferPoolWaitingWithoutWorkers",
    }
    tests = yaml.safe_load((OBSERVABILITY / "rules-test.yaml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for alert in alerts:
        outcomes = [bool(c["exp_alerts"]) for c in cases if c["alertname"] == alert]
        assert True in outcomes and False in outcomes, f"{alert} lacks a firing or quiet test"


def test_rules_name_only_exported_metrics():
    known = exported_names() | KUEUE_METRICS
    for group in rule_groups()["groups"]:
        for rule in group["rules"]:
            names = METRIC_NAME.findall(rule["expr"])
            assert names, rule["alert"]
            for name in names:
                assert base_name(name, known) in known, f"{rule['alert']}: {name} is not exported"


# --------------------------------------------------------------------------- dashboard


def load_dashboard_module():
    spec = importlib.util.spec_from_file_location(
        "gpuinfer_dashboard", OBSERVABILITY / "dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["gpuinfer_dashboard"] = module
    spec.loader.exec_module(module)
    return module


def dashboard_queries() -> list[tuple[str, str]]:
    import json

    dashboard = json.loads(load_dashboard_module().dashboard_json())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel.get("targets", [])
    ]


def test_committed_dashboard_is_the_generated_one():
    generated = load_dashboard_module().dashboard_json()
    committed = (OBSERVABILITY / "gpuinfer-dashboard.json").read_text()
    assert committed == generated, (
        "regenerate it: python deploy/observability/dashboard.py > "
        "deploy/observability/gpuinfer-dashboard.json"
    )


def test_every_dashboard_query_names_an_exported_metric_and_parses(tmp_path):
    known = exported_names()
    queries = dashboard_queries()
    assert len(queries) >= 15
    panels_with_dcgm = set()
    for title, expr in queries:
        names = METRIC_NAME.findall(expr)
        assert names, f"panel {title!r} queries no known metric: {expr}"
        for name in names:
            assert base_name(name, known) in known, f"panel {title!r}: {name} is not exported"
            if name.startswith("DCGM_"):
                panels_with_dcgm.add(title)
    assert panels_with_dcgm, "no panel shows DCGM's GPU metrics"
    # Prometheus' own parser: each query as a recording rule under `promtool check rules`.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:query_{i}",
                        "expr": expr.replace("$__rate_interval", "5m").replace("$asset", ".*"),
                    }
                    for i, (_, expr) in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "dashboard-rules.yaml").write_text(yaml.safe_dump(rules))
    checked = subprocess.run(
        [promtool(), "check", "rules", "dashboard-rules.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --------------------------------------------------------------------------- scraping


def test_podmonitor_selects_worker_pods_on_their_metrics_port():
    monitor = yaml.safe_load((OBSERVABILITY / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor"
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "embed",
            "input": {"uri": "s3://b/{partition_key}.parquet"},
            "output": {"root": "s3://b/out", "asset_name": "docs"},
            "partition_keys": ["p0"],
        }
    )
    env = metrics_env(9400, None)
    pod = with_metrics_port(
        build_worker_pod(
            spec,
            K8sLauncherConfig(image="w:1", namespace="team-a"),
            RunIdentity(run_id="6633a66a-ab2b-4333-bb5f-adbdffff1812", asset_key="docs"),
            extra_env=env,
        ),
        env,
    )
    labels = pod["metadata"]["labels"]
    for key, value in monitor["spec"]["selector"]["matchLabels"].items():
        assert labels.get(key) == value, f"worker pods lack the PodMonitor's label {key}={value}"
    for key in monitor["spec"]["podTargetLabels"]:
        assert key in labels, f"podTargetLabels names {key}, which worker pods do not carry"
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {METRICS_PORT_NAME}
    assert METRICS_PORT_NAME in ports
