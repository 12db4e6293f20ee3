"""Everything Kubernetes: the worker pod, the failure table, the memory step-down, the client.

- `pod`: `K8sLauncherConfig` and the pure builder `build_worker_pod` (no `kubernetes` import).
- `failures`: what went wrong with a pod, as a table matched in order (pure).
- `memory`: the out-of-memory step-down policy (pure).
- `pool_pod`, `pool_keda`: the pure builders of engine pool worker pods and of the KEDA
  `ScaledJob` that sizes a pool; `pool_backend`: `K8sPoolBackend`, which creates pool pods
  for the reconciler and counts them by label.
- `client`: `GpuWorkerPipesClient`, a `dagster_k8s.PipesK8sClient` that creates, watches,
  diagnoses and deletes worker pods; the only module here that imports `kubernetes`.

Modules here import `dagster_gpuinfer.spec`, `.out_of_memory`, `.pools` (pool keys, the
backlog query) and `.worker` (for the module name), never the resource or the asset factory
above them.
"""
