"""The pipelines declared in YAML under `assets/defs/`, loaded as Dagster Components."""

from __future__ import annotations

import importlib

import dagster as dg

from assets.paths import REPO_ROOT


def load_yaml_pipelines() -> dg.Definitions:
    """Build the definitions of every `defs.yaml` under `assets/defs/`."""
    defs_module = importlib.import_module("assets.defs")
    return dg.ComponentTree.from_module(
        defs_module=defs_module, project_root=REPO_ROOT
    ).build_defs()
