"""The data plane: `python -m dagster_gpuinfer.worker`, identical in a pod and on a laptop.

Imports neither Dagster's control plane (only `dagster_pipes`) nor, until an engine is
built, vllm.

Its rooms, lowest first (a room imports only rooms below it; `tests/test_import_graph.py`):

- `errors`, `lifecycle`, `metrics`, `telemetry`: what every stage shares;
- `tasks/`: the task table's worker half and the row formats tasks produce and accept;
- `rows/`: shard readers, row validation, request parameters, output writers;
- `stage_messages`: what the stages hand each other (chunks, results, replica messages);
- `commit`: the worker's side of the commit protocol (`dagster_gpuinfer.storage`);
- `loop/`: the vLLM engine and the engine loop;
- `run/`: the job, replicas, the run's coordinator, and `run_partition` (compute a partition
  on a built engine: what a run, a pool worker and bench/ share);
- `pool/`: the pool worker (`--pool KEY`): one warm engine serving the leases of one pool
  from the lease queue (`dagster_gpuinfer.pools`, which the worker imports beside the
  shared modules);
- `__main__`, `follower`: the entry points.
"""

WORKER_MODULE = "dagster_gpuinfer.worker"
"""What `python -m` runs, in a pod (`k8s.pod`) and in a local subprocess (`launchers.local`)."""
