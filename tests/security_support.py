"""What the security tests (`test_security_*.py`, the findings of issue 12) share: the deploy
kit's objects, the Helm values and the worker pods they make."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
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


# --------------------------------------------------------------------------- admission policies


class CelAdmissionPolicy:
    """A ValidatingAdmissionPolicy of deploy/admission evaluated with cel-python as the API
    server does: its match conditions (if any), then the variables in order, then every
    validation; an expression that errors rejects the request (failurePolicy: Fail)."""

    def __init__(self, path: Path) -> None:
        import celpy

        docs = load_all(path)
        self.policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
        self.binding = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding")
        self.env = celpy.Environment()

    def _evaluate(self, expression: str, activation: dict[str, Any]) -> Any:
        return self.env.program(self.env.compile(expression)).evaluate(activation)

    def _checked(self, expression: str, activation: dict[str, Any]) -> Any:
        value = self._evaluate(expression, activation)
        if isinstance(value, Exception):
            raise value
        return value

    def admit(self, pod: dict[str, Any], request: dict[str, Any]) -> list[str]:
        """Messages of the failed validations for `pod` in `request` (e.g. `userInfo`,
        `namespace`, `operation`); empty when the pod is admitted."""
        import celpy

        activation: dict[str, Any] = {
            "object": celpy.json_to_cel(pod),
            "request": celpy.json_to_cel(request),
        }
        for condition in self.policy["spec"].get("matchConditions", []):
            if not bool(self._evaluate(condition["expression"], activation)):
                return []  # the policy does not apply to this request
        variables: dict[str, Any] = {}
        for variable in self.policy["spec"].get("variables", []):
            activation["variables"] = celpy.json_to_cel(variables)
            variables[variable["name"]] = _cel_to_json(
                self._checked(variable["expression"], activation)
            )
        activation["variables"] = celpy.json_to_cel(variables)
        failures = []
        for validation in self.policy["spec"]["validations"]:
            try:
                allowed = bool(self._checked(validation["expression"], activation))
            except Exception as exc:  # noqa: BLE001 - an evaluation error fails closed
                failures.append(f"{validation['message'].strip()} (error: {exc})")
                continue
            if not allowed:
                failures.append(validation["message"].strip())
        return failures


def _cel_to_json(value: Any) -> Any:
    """A CEL value as plain JSON, to bind a variable for the next expressions."""
    import celpy

    if isinstance(value, celpy.celtypes.BoolType):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _cel_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cel_to_json(v) for v in value]
    if isinstance(value, int):
        return int(value)
    return value
