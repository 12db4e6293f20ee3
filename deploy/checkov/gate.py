"""The security gate of `make test`: checkov and strict schema validation, offline.

Scans every manifest and Dockerfile in deploy/ and the worker pods the pod builder makes
from the Helm values (one GPU, tensor parallel, replicas, the PVC cache and the hostPath
cache) with checkov, offline (`--skip-download`, `BC_SKIP_MAPPING=TRUE`), and fails on any
failed check that `ACCEPTED` below does not explain. Then validates the same Kubernetes
objects against the Kubernetes 1.37 schema in strict mode (kubernetes-validate), which
rejects a misspelled field a lenient reader would drop.

    python deploy/checkov/gate.py --checkov .venv-checkov/bin/checkov

Runs with the project's Python (it imports dagster_gpuinfer to build the pods); checkov runs
from its own virtual environment (requirements/checkov.txt), whose pins clash with the
project's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"

# Failed checks that are accepted, each with the reason. Scope: "*" for every file, else the
# files (relative to deploy/, or "pods/" for the generated worker pods) it is accepted for.
ACCEPTED: dict[str, tuple[str, set[str]]] = {
    "CKV_K8S_11": (
        (
            "No CPU limit: GPU batch pods and cache copies should not be throttled by CFS quota; "
            "the CPU request and the Kueue quota bound them."
        ),
        {"*"},
    ),
    "CKV_K8S_15": (
        (
            "imagePullPolicy IfNotPresent: every image is pinned by digest, which cannot change "
            "under a cached copy; Always would pull multi-GB GPU images on every start."
        ),
        {"*"},
    ),
    "CKV_K8S_35": (
        (
            "Secrets as environment variables: the AWS SDKs and Hugging Face read credentials "
            "from the environment; they arrive by secretKeyRef/envFrom, never as values."
        ),
        {"*"},
    ),
    "CKV_K8S_40": (
        (
            "UID 1000, not > 10000: the images create user 1000; non-root is enforced "
            "(runAsNonRoot, Pod Security restricted)."
        ),
        {"*"},
    ),
    "CKV_K8S_8": (
        (
            "No liveness probe: batch pods (workers, the warmer's pause container) serve "
            "nothing to probe; activeDeadlineSeconds and the launcher's monitoring bound them."
        ),
        {"pods/", "model-cache/warmer-daemonset.yaml", "multinode/worker-group-2x8.yaml"},
    ),
    "CKV_K8S_9": (
        "No readiness probe: batch pods take no traffic.",
        {"pods/", "model-cache/warmer-daemonset.yaml", "multinode/worker-group-2x8.yaml"},
    ),
    "CKV_DOCKER_2": (
        "No HEALTHCHECK: Kubernetes ignores Dockerfile HEALTHCHECK; the images run batch jobs.",
        {"*"},
    ),
    "CKV_DOCKER_7": (
        (
            "FROM ${ARG}: checkov does not read the ARG default, which tests/test_deploy_kit.py "
            "checks is pinned by tag and digest."
        ),
        {"worker/Dockerfile", "worker/Dockerfile.cpu", "code-location/Dockerfile"},
    ),
    "CKV_K8S_38": (
        (
            "The batch API mounts its service account token: cancelling a batch terminates its "
            "Dagster run, which the K8sRunLauncher does by deleting the run's Job through the API "
            "server (the chart's run-launcher account)."
        ),
        {"batch-api/batch-api.yaml"},
    ),
}

# A pod that breaks the rules the gate exists for, and the checks that must catch it: the
# gate first proves on it that checkov runs and fails, so a gate that silently scans
# nothing cannot pass.
HOSTILE_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "hostile", "namespace": "gpuinfer"},
    "spec": {
        "containers": [
            {
                "name": "root",
                "image": "registry.example.com/anything:latest",
                "securityContext": {"privileged": True},
                "volumeMounts": [{"name": "host", "mountPath": "/host"}],
            }
        ],
        "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
    },
}
HOSTILE_MUST_FAIL = {"CKV_K8S_16", "CKV_K8S_43", "CKV_K8S_20", "CKV_K8S_23"}


def worker_pods() -> dict[str, dict[str, Any]]:
    """The pods the launcher would create with the Helm values, in each shape that matters."""
    sys.path.insert(0, str(REPO))
    from dagster_gpuinfer.k8s.names import RunIdentity
    from dagster_gpuinfer.k8s.pod import build_worker_pod
    from dagster_gpuinfer.spec import InferenceSpec
    from resources.k8s import k8s_launcher_config

    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    deployment = values["dagster-user-deployments"]["deployments"][0]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    env_host = {**env, "GPUINFER_MODEL_CACHE_HOST_PATH": "/var/lib/gpuinfer/models"}
    env_host.pop("GPUINFER_MODEL_CACHE_PVC", None)
    shapes = {
        "single-gpu-pvc": (env, 1, 1),
        "tensor-parallel-pvc": (env, 4, 1),
        "replicas-pvc": (env, 1, 4),
        "tp-replicas-hostpath": (env_host, 2, 2),
        "single-gpu-hostpath": (env_host, 1, 1),
    }
    pods = {}
    for name, (environ, tp, replicas) in shapes.items():
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
        identity = RunIdentity(run_id="0" * 8 + "-gate-" + name, asset_key="completions")
        pods[name] = build_worker_pod(spec, k8s_launcher_config(environ), identity)
    return pods


def worker_group_objects() -> list[dict[str, Any]]:
    """One engine across two 8-GPU nodes (tensor_parallel_size=8, pipeline_parallel_size=2,
    nodes=2) with the Helm values: the Service, the leader and the follower (k8s.group).
    deploy/multinode/worker-group-2x8.yaml is this, checked in for readers."""
    sys.path.insert(0, str(REPO))
    from dagster_gpuinfer.k8s.group import GroupConfig, build_worker_group
    from dagster_gpuinfer.k8s.names import RunIdentity
    from dagster_gpuinfer.spec import InferenceSpec
    from resources.k8s import k8s_launcher_config

    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    deployment = values["dagster-user-deployments"]["deployments"][0]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/Llama-3.1-405B-Instruct-FP8",
            "task": "generate",
            "input": {"uri": "s3://gpuinfer-data/inputs/{partition_key}.jsonl"},
            "output": {"root": "s3://gpuinfer-data/outputs", "asset_name": "completions"},
            "partition_keys": ["prompts-000"],
            "tensor_parallel_size": 8,
            "pipeline_parallel_size": 2,
            "nodes": 2,
        }
    )
    identity = RunIdentity(run_id="0" * 8 + "-gate-multinode", asset_key="completions")
    group = build_worker_group(spec, k8s_launcher_config(env), identity, GroupConfig())
    return [group.service, *group.pods]


EXAMPLE_POOL_MAX_WORKERS = 4


def pool_objects() -> list[dict[str, Any]]:
    """An engine pool of the 8B model with the Helm values: the KEDA ScaledJob that sizes it
    (deploy/pools/keda-scaledjob.yaml is this, checked in for clusters that run KEDA) and
    one pool worker pod as the reconciler's backend creates it (k8s.pool_pod)."""
    sys.path.insert(0, str(REPO))
    from dagster_gpuinfer.k8s.pool_keda import build_pool_scaled_job
    from dagster_gpuinfer.k8s.pool_pod import build_pool_pod
    from dagster_gpuinfer.pools import pool_key
    from dagster_gpuinfer.spec import InferenceSpec
    from resources.k8s import k8s_launcher_config

    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    deployment = values["dagster-user-deployments"]["deployments"][0]
    config = k8s_launcher_config({item["name"]: item["value"] for item in deployment["env"]})
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/Llama-3.1-8B-Instruct",
            "task": "generate",
            "input": {"uri": "s3://gpuinfer-data/inputs/{partition_key}.jsonl"},
            "output": {"root": "s3://gpuinfer-data/outputs", "asset_name": "completions"},
        }
    )
    key = pool_key(spec)
    scaled_job = build_pool_scaled_job(key, config, max_workers=EXAMPLE_POOL_MAX_WORKERS)
    return [scaled_job, build_pool_pod(key, f"{key}-w0", config)]


def accepted(check_id: str, file_path: str) -> bool:
    reason_scope = ACCEPTED.get(check_id)
    if reason_scope is None:
        return False
    scope = reason_scope[1]
    relative = file_path.lstrip("/").removeprefix("deploy/")
    return "*" in scope or relative in scope or ("pods/" in scope and relative.startswith("pods/"))


def checkov_failures(checkov: str, target: Path, frameworks: list[str]) -> tuple[int, list[dict]]:
    """(checks passed, failed checks) of checkov over the directory `target`, offline."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "ERROR"}
    result = subprocess.run(
        [
            checkov,
            "-d",
            str(target),
            "--framework",
            *frameworks,
            "--skip-download",
            "--compact",
            "--quiet",
            "-o",
            "json",
        ],  # --quiet: only failed checks are listed
        capture_output=True,
        text=True,
        env=env,
        cwd=target,
        check=False,  # exit 1 means failed checks, read from the JSON below
    )
    if result.returncode not in (0, 1) or not result.stdout.strip():
        raise SystemExit(f"checkov failed on {target}:\n{result.stderr[-3000:]}")
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    passed = sum(report.get("summary", {}).get("passed", 0) for report in reports)
    failed = [f for report in reports for f in report.get("results", {}).get("failed_checks", [])]
    return passed, failed


def run_checkov(checkov: str, pod_dir: Path) -> list[str]:
    """checkov over deploy/ and the generated pods; the unexplained failures."""
    problems: list[str] = []
    for target, frameworks, label in (
        (DEPLOY, ["kubernetes", "dockerfile"], "deploy"),
        (pod_dir, ["kubernetes"], "pods"),
    ):
        passed, failures = checkov_failures(checkov, target, frameworks)
        if passed == 0:
            raise SystemExit(f"checkov passed no check on {label}: it scanned nothing")
        before = len(problems)
        for failed in failures:
            where = failed["file_path"]
            if target == pod_dir:
                where = "pods/" + Path(where).name
            if not accepted(failed["check_id"], where):
                problems.append(
                    f"{failed['check_id']} {where} {failed['resource']}: {failed['check_name']}"
                )
        unexplained = len(problems) - before
        print(
            f"checkov {label}: {passed} checks passed, {len(failures) - unexplained} failed and "
            f"accepted, {unexplained} failed unexplained"
        )
    return problems


def self_check(checkov: str) -> None:
    """checkov must fail the hostile pod on the checks the gate relies on."""
    with tempfile.TemporaryDirectory(prefix="gpuinfer-gate-hostile-") as tmp:
        (Path(tmp) / "hostile.yaml").write_text(yaml.safe_dump(HOSTILE_POD))
        _, failures = checkov_failures(checkov, Path(tmp), ["kubernetes"])
    caught = {f["check_id"] for f in failures}
    if not HOSTILE_MUST_FAIL <= caught:
        raise SystemExit(
            f"the gate's self-check failed: checkov did not report {HOSTILE_MUST_FAIL - caught} "
            "on a privileged hostPath pod with a mutable tag"
        )
    print(f"checkov self-check: a privileged hostPath pod fails {sorted(HOSTILE_MUST_FAIL)}")


# YAML in deploy/ that holds no Kubernetes objects (besides Dagster's instance configs,
# dagster.yaml): Helm values and a promtool rule-test file.
NOT_MANIFESTS = {
    Path("helm/values.yaml"),
    Path("observability/dcgm-exporter-values.yaml"),
    Path("observability/rules-test.yaml"),
}
CRD_GROUPS = ("kueue.x-k8s.io/", "monitoring.coreos.com/", "keda.sh/")


def keda_job(scaled_job: dict[str, Any]) -> dict[str, Any]:
    """The batch/v1 Job a KEDA ScaledJob creates from its jobTargetRef (KEDA's CRD ships no
    schema here; its Job does, and checkov reads Jobs)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": scaled_job["metadata"]["name"] + "-x",
            "namespace": scaled_job["metadata"]["namespace"],
            "labels": dict(scaled_job["metadata"]["labels"]),
        },
        "spec": scaled_job["spec"]["jobTargetRef"],
    }


def run_schema_validation(pod_dir: Path) -> list[str]:
    """Every native object, strictly, against the Kubernetes schema (kubernetes-validate)."""
    import kubernetes_validate

    problems = []
    files = [
        p
        for p in DEPLOY.rglob("*.yaml")
        if p.relative_to(DEPLOY) not in NOT_MANIFESTS and p.name != "dagster.yaml"
    ]
    files += sorted(pod_dir.glob("*-*.yaml"))
    checked = 0
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or str(doc.get("apiVersion", "")).startswith(CRD_GROUPS):
                # Kueue's and the Prometheus operator's CRDs ship no schema here:
                # tests/test_deploy_kit.py and tests/test_observability_deploy.py check them
                continue
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                checked += 1
            except Exception as exc:  # noqa: BLE001 - any refusal is a finding to report
                problems.append(f"{path.name} {doc.get('kind')}: {exc}")
    print(f"kubernetes-validate --strict: {checked} objects")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkov", required=True, help="the checkov executable")
    args = parser.parse_args()
    args.checkov = os.path.abspath(args.checkov)  # checkov runs with the scanned dir as cwd
    self_check(args.checkov)
    with tempfile.TemporaryDirectory(prefix="gpuinfer-gate-") as tmp:
        pod_dir = Path(tmp)
        for name, pod in worker_pods().items():
            (pod_dir / f"{name}.yaml").write_text(yaml.safe_dump(pod, sort_keys=False))
        group = worker_group_objects()
        (pod_dir / "multinode-2x8.yaml").write_text(yaml.safe_dump_all(group, sort_keys=False))
        scaled_job, pool_pod = pool_objects()
        (pod_dir / "pool-worker.yaml").write_text(yaml.safe_dump(pool_pod, sort_keys=False))
        (pod_dir / "pool-job.yaml").write_text(
            yaml.safe_dump(keda_job(scaled_job), sort_keys=False)
        )
        # Scanned beside the pods, so checkov sees the NetworkPolicies that select them.
        policies = DEPLOY / "network" / "network-policies.yaml"
        (pod_dir / policies.name).write_text(policies.read_text())
        problems = run_checkov(args.checkov, pod_dir) + run_schema_validation(pod_dir)
    if problems:
        print("security gate: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        print(
            "Fix the manifest, or, if the finding is accepted, add it with its reason to "
            "ACCEPTED in deploy/checkov/gate.py",
            file=sys.stderr,
        )
        return 1
    print("security gate: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
