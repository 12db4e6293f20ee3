"""Dagster Components of dagster-gpuinfer, registered with `dg` through the
`dagster_dg_cli.registry_modules` entry point (`dg list components` shows them)."""

from dagster_gpuinfer.components.inference_pipeline import (
    InferencePipelineComponent as InferencePipelineComponent,
)

__all__ = ["InferencePipelineComponent"]
