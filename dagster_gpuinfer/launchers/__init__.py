"""Launchers: how a step's job reaches a worker, behind one interface (`Launcher`).

- `local.LocalLauncher`: the worker as a subprocess of the step, in a Pipes session;
- `k8s.K8sLauncher`: the worker in a GPU pod, or a pod group for `nodes > 1`
  (the Kubernetes code lives in `dagster_gpuinfer.k8s`);
- `pool.PoolLauncher`: the job into an engine pool's lease queue, run by warm pool workers.

`GpuInferenceResource` picks one per run (`launcher` and the pipeline's `launch`); each
returns the worker's messages (`dagster_gpuinfer.messages`), which the resource turns into
per-partition results the same way whichever launched them.
"""

from dagster_gpuinfer.launchers.base import Launcher as Launcher
