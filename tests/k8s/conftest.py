"""The real-cluster suite: runs only against a kubeconfig passed explicitly.

    GPUINFER_TEST_KUBECONFIG=/path/to/kubeconfig pytest tests/k8s
    pytest tests/k8s --kubeconfig=/path/to/kubeconfig

It never falls back to `KUBECONFIG` or `~/.kube/config`: a developer's production context
must not receive test pods by accident. Without an explicit kubeconfig every test here is
skipped with the reason; a kubeconfig that is given but missing is an error, not a skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_access import SKIP_REASON, explicit_kubeconfig


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kubeconfig",
        default=None,
        help="kubeconfig of the cluster for tests/k8s (the suite is skipped without it)",
    )


@pytest.fixture(scope="session")
def kubeconfig(request: pytest.FixtureRequest) -> Path:
    path = explicit_kubeconfig(request.config.getoption("--kubeconfig", default=None), os.environ)
    if path is None:
        pytest.skip(SKIP_REASON)
    if not path.is_file():
        pytest.fail(f"the kubeconfig given for tests/k8s does not exist: {path}")
    return path


@pytest.fixture(scope="session")
def core_api(kubeconfig: Path):
    import kubernetes

    return kubernetes.client.CoreV1Api(
        kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    )


@pytest.fixture(scope="session")
def test_namespace(core_api) -> Iterator[str]:
    """A namespace of its own for this session, deleted afterwards."""
    import kubernetes

    name = f"gpuinfer-test-{uuid.uuid4().hex[:8]}"
    core_api.create_namespace(
        kubernetes.client.V1Namespace(
            metadata=kubernetes.client.V1ObjectMeta(
                name=name, labels={"app.kubernetes.io/part-of": "dagster-gpuinfer-tests"}
            )
        )
    )
    try:
        yield name
    finally:
        core_api.delete_namespace(name)
