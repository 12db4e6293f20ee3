"""The control plane never imports torch/vllm; the worker never imports Dagster's control plane.

Checked in fresh interpreters, the way dagster-sling checks its import time.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers")


def modules_after_import(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_control_plane_imports_no_torch_or_vllm():
    loaded = modules_after_import(
        "import dagster_gpuinfer\n"
        "from dagster_gpuinfer import inference_assets, GpuInferenceResource\n"
        "import dagster_gpuinfer.asset_factory, dagster_gpuinfer.checks\n"
        "import dagster_gpuinfer.metadata, dagster_gpuinfer.launchers.local\n"
        "import dagster_gpuinfer.k8s.pod, dagster_gpuinfer.k8s.failures\n"
        "import dagster_gpuinfer.k8s.memory, dagster_gpuinfer.k8s.group\n"
        "import dagster_gpuinfer.pools\n"
        "import assets.definitions"
    )
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"control plane imported {heavy[:5]}"
    kubernetes = sorted(m for m in loaded if m.split(".")[0] in ("kubernetes", "dagster_k8s"))
    assert not kubernetes, f"kubernetes is imported before a pod is launched: {kubernetes[:5]}"


def test_kubernetes_client_imports_no_torch_or_vllm_and_nothing_above_it():
    loaded = modules_after_import("import dagster_gpuinfer.k8s.client, resources.k8s")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"the Kubernetes client imported {heavy[:5]}"
    loaded = modules_after_import("import dagster_gpuinfer.k8s.client")
    above = {"dagster_gpuinfer.resource", "dagster_gpuinfer.asset_factory"} & loaded
    assert not above, f"dagster_gpuinfer.k8s imports the modules that use it: {above}"


def test_worker_imports_no_dagster_control_plane():
    loaded = modules_after_import(
        "import dagster_gpuinfer.worker.__main__, dagster_gpuinfer.worker.run.job\n"
        "import dagster_gpuinfer.worker.commit, dagster_gpuinfer.worker.rows.validate\n"
        "import dagster_gpuinfer.worker.follower"
    )
    assert "dagster" not in loaded
    assert not any(m.startswith("dagster.") for m in loaded)


def test_pools_import_neither_dagster_nor_torch_nor_a_database_driver():
    """The pool worker and the control plane both import `dagster_gpuinfer.pools`; a store's
    driver (psycopg2) loads only when that store is opened."""
    loaded = modules_after_import("import dagster_gpuinfer.pools")
    top = {m.split(".")[0] for m in loaded}
    kept_out = {"dagster", *HEAVY, "psycopg2"}
    assert not top & kept_out, f"dagster_gpuinfer.pools imported {sorted(top & kept_out)}"
