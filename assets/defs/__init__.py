"""Pipelines of the reference code location declared in YAML (Dagster Components).

Each folder holds a `defs.yaml` of `dagster_gpuinfer.components.InferencePipelineComponent`;
`assets.definitions` loads them with `dg.ComponentTree`.
"""
