"""What the security tests (`test_security_*.py`, the findings of issue 12) share: the deploy
kit's objects, the Helm values and the worker pods they make."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dagster_gpuinfer.k8s.pod import (
    RunIdentity,
    build_worker_pod,
)
from dagster_gpuinfer.spec import InferenceSpec
from resources.k8s import k8s_launcher_config

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
LAUNCHER = "system:serviceaccount:dagster:gpuinfer-launcher"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kit_objects() -> list[tuple[Path, dict[str, Any]]]:
    skip = {
        DEPLOY / "helm" / "values.yaml",
        DEPLOY / "dagster.yaml",
        # Helm values of the DCGM exporter chart and a promtool test file: no Kubernetes objects
        DEPLOY / "observability" / "dcgm-exporter-values.yaml",
        DEPLOY / "observability" / "rules-test.yaml",
    }
    return [
        (path, doc)
        for path in sorted(DEPLOY.rglob("*.yaml"))
        if path not in skip and "local" not in path.relative_to(DEPLOY).parts
        for doc in load_all(path)
    ]


def helm_values() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())


def code_location_env(**overrides: str | None) -> dict[str, str]:
    deployment = helm_values()["dagster-user-deployments"]["deployments"][0]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def worker_pod(tp: int = 1, replicas: int = 1, **env_overrides: str | None) -> dict[str, Any]:
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/Llama-3.1-8B-Instruct",
            "task": "generate",
            "input": {"uri": "s3://gpuinfer-data/inputs/{partition_key}.jsonl"},
            "output": {"root": "s3://gpuinfer-data/outputs", "asset_name": "completions"},
            "partition_keys": ["prompts-000"],
            "tensor_parallel_size": tp,
            "replicas": replicas,
        }
    )
    config = k8s_launcher_config(code_location_env(**env_overrides))
    return build_worker_pod(spec, config, RunIdentity(run_id="r" * 36, asset_key="completions"))


def hostpath_worker_pod(tp: int = 2, replicas: int = 2) -> dict[str, Any]:
    return worker_pod(
        tp,
        replicas,
        GPUINFER_MODEL_CACHE_HOST_PATH="/var/lib/gpuinfer/models",
        GPUINFER_MODEL_CACHE_PVC=None,
        GPUINFER_HF_TOKEN_SECRET="hf-token",
    )


def worker_spec() -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "embed",
            "input": {"uri": "s3://b/in/{partition_key}.jsonl"},
            "output": {"root": "s3://b/out", "asset_name": "a"},
            "partition_keys": ["p"],
        }
    )
