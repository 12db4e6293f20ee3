"""Template variables for the YAML pipelines in `assets/defs` (`{{ embedding_model }}`, ...):
the same locations the Python pipelines use, from `assets.paths`."""

from __future__ import annotations

import dagster as dg

from assets import paths


@dg.template_var
def embedding_model() -> str:
    return paths.embedding_model_dir()


@dg.template_var
def input_root() -> str:
    return paths.input_root()


@dg.template_var
def output_root() -> str:
    return paths.output_root()
