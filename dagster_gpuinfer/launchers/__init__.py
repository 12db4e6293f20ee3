"""Launchers: how a worker process is started for a Pipes session (local or Kubernetes)."""

WORKER_MODULE = "dagster_gpuinfer.worker"
