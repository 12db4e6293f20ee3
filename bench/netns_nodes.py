"""Network namespaces as "nodes" for bench/multinode.py: each with its own address on one
bridge, the way pods of a group each get a pod IP on the cluster network.

The bridge lives in a namespace of its own, so the host's network is never touched; every
namespace and link is removed on exit. Needs root (`ip netns add`), as CI has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

POD_INTERFACE = "eth0"
"""The interface of each namespace, named as a pod's is."""


def netns_available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Node:
    """One namespace: its name (for `ip netns exec`) and its address on the bridge."""

    netns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@contextmanager
def netns_nodes(count: int, *, subnet: str = "10.231.7") -> Iterator[list[Node]]:
    """`count` namespaces on one bridge, addresses `<subnet>.1`, `<subnet>.2`, ..."""
    tag = uuid.uuid4().hex[:6]
    switch = f"gisw-{tag}"
    nodes = [Node(netns=f"gin{i}-{tag}", address=f"{subnet}.{i + 1}") for i in range(count)]
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("link", "add", "br0", "type", "bridge", netns=switch)
        _ip("link", "set", "br0", "up", netns=switch)
        for i, node in enumerate(nodes):
            _ip("netns", "add", node.netns)
            made.append(node.netns)
            inner, outer = f"v{i}{tag}", f"p{i}{tag}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", outer, "netns", switch)
            _ip("link", "set", inner, "netns", node.netns)
            _ip("link", "set", outer, "master", "br0", netns=switch)
            _ip("link", "set", outer, "up", netns=switch)
            # eth0 inside, as in a pod: GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME name it.
            _ip("link", "set", inner, "name", POD_INTERFACE, netns=node.netns)
            _ip("addr", "add", f"{node.address}/24", "dev", POD_INTERFACE, netns=node.netns)
            _ip("link", "set", POD_INTERFACE, "up", netns=node.netns)
            _ip("route", "add", "default", "dev", POD_INTERFACE, netns=node.netns)
            _ip("link", "set", "lo", "up", netns=node.netns)
        yield nodes
    finally:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
