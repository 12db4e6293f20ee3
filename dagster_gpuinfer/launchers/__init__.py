"""Launchers other than Kubernetes (which lives in `dagster_gpuinfer.k8s`): the local one."""
