"""Resource configurations per environment. `GPUINFER_ENV` picks one: local (default) or k8s."""

from __future__ import annotations

import os

import dagster as dg


def resources_for_environment(name: str | None = None) -> dict[str, dg.ConfigurableResource]:
    """The resources of the reference code location for environment `name`."""
    name = name or os.environ.get("GPUINFER_ENV", "local")
    if name == "local":
        from resources.local import local_resources

        return local_resources()
    if name == "k8s":
        from resources.k8s import k8s_resources

        return k8s_resources()
    raise ValueError(f"GPUINFER_ENV={name!r} is not an environment here; use 'local' or 'k8s'")
