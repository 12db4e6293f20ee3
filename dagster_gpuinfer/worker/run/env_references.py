"""Credentials by reference: the worker copies them from its own environment at start.

The control plane passes `GPUINFER_ENV_REFERENCES`, a JSON object `{"AWS_ACCESS_KEY_ID":
"MINIO_KEY", ...}`: which variable the worker needs, and the name of the variable in its
environment that holds the value (what `dg.EnvVar("MINIO_KEY")` names). Only names travel;
the value is read here, in the worker process, and never leaves it.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping

from dagster_gpuinfer.secrets import ENV_REFERENCES_VARIABLE


def apply_env_references(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each referenced variable from the one it names; returns the variables set.

    Raises:
        RuntimeError: a referenced variable is not set in the worker's environment (the
            message names it, never a value).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_REFERENCES_VARIABLE)
    if not raw:
        return []
    references: dict[str, str] = json.loads(raw)
    missing = sorted(source for source in references.values() if source not in env)
    if missing:
        raise RuntimeError(
            f"the worker's environment lacks {missing}, which GpuInferenceResource."
            "env_references names (dg.EnvVar in the S3Resource): set them where the worker "
            "runs"
        )
    for target, source in references.items():
        env[target] = env[source]
    return sorted(references)
