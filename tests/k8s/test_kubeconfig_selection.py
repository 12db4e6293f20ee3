"""The real-cluster suite only ever uses a kubeconfig named for it (runs without a cluster)."""

from pathlib import Path

from cluster_access import KUBECONFIG_ENV, explicit_kubeconfig


def test_default_kubeconfig_locations_are_never_used():
    environ = {"KUBECONFIG": "/home/dev/.kube/prod-config", "HOME": "/home/dev"}
    assert explicit_kubeconfig(None, environ) is None


def test_option_or_suite_variable_selects_the_kubeconfig():
    assert explicit_kubeconfig("/tmp/kind.yaml", {}) == Path("/tmp/kind.yaml")
    assert explicit_kubeconfig(None, {KUBECONFIG_ENV: "/tmp/kind.yaml"}) == Path("/tmp/kind.yaml")
    assert explicit_kubeconfig("/tmp/a.yaml", {KUBECONFIG_ENV: "/tmp/b.yaml"}) == Path(
        "/tmp/a.yaml"
    )
    assert explicit_kubeconfig(None, {KUBECONFIG_ENV: ""}) is None
