"""Which kubeconfig the real-cluster suite may use: only one named for it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

KUBECONFIG_ENV = "GPUINFER_TEST_KUBECONFIG"
SKIP_REASON = (
    "no kubeconfig given: pass --kubeconfig=PATH (with tests/k8s on the command line) or set "
    "GPUINFER_TEST_KUBECONFIG=PATH to run the real-cluster suite; it never reads KUBECONFIG "
    "or ~/.kube/config"
)


def explicit_kubeconfig(option: str | None, environ: Mapping[str, str]) -> Path | None:
    """The kubeconfig the user named for this suite, or None. Only the `--kubeconfig` option
    and GPUINFER_TEST_KUBECONFIG count; KUBECONFIG and ~/.kube/config never do."""
    chosen = option or environ.get(KUBECONFIG_ENV) or None
    return Path(chosen).expanduser() if chosen else None
