"""The data plane: `python -m dagster_gpuinfer.worker`, identical in a pod and on a laptop.

Imports neither Dagster's control plane (only `dagster_pipes`) nor, until an engine is
built, vllm.
"""

WORKER_MODULE = "dagster_gpuinfer.worker"
"""What `python -m` runs, in a pod (`k8s.pod`) and in a local subprocess (`launchers.local`)."""
