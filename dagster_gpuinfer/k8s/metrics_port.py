"""The worker pod's metrics port: a pure function over the pod manifest `build_worker_pod`
returns, so the PodMonitor in `deploy/observability/` (or `prometheus.io/*` annotation
based scraping) finds the worker's Prometheus endpoint."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

METRICS_PORT_ENV = "GPUINFER_METRICS_PORT"
METRICS_PORT_NAME = "metrics"


def with_metrics_port(pod: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """`pod` with the worker container's `metrics` port and the scrape annotations, when
    `env` sets `GPUINFER_METRICS_PORT` (from `GpuInferenceResource.metrics_port`); else the
    pod unchanged. The environment variable itself is already in the container's env."""
    result = copy.deepcopy(dict(pod))
    port = env.get(METRICS_PORT_ENV)
    if not port:
        return result
    container = result["spec"]["containers"][0]
    ports = [p for p in container.get("ports", []) if p.get("name") != METRICS_PORT_NAME]
    ports.append({"name": METRICS_PORT_NAME, "containerPort": int(port), "protocol": "TCP"})
    container["ports"] = ports
    annotations = result["metadata"].setdefault("annotations", {})
    annotations.update(
        {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }
    )
    return result
