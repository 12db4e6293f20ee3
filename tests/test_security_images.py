"""Images pinned by digest; the GPU image installs from a hash-locked lock.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

import re
from typing import Any

from security_support import DEPLOY, REPO, code_location_env, helm_values, kit_objects

# --------------------------------------------------------------------------- images

DIGEST = re.compile(r"^[^\s@]+:[^:@/\s]+@sha256:[0-9a-f]{64}$")


def images_in(node: Any) -> list[str]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                found.append(value)
            elif key == "image" and isinstance(value, dict) and "repository" in value:
                found.append(f"{value['repository']}:{value['tag']}")
            else:
                found.extend(images_in(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(images_in(value))
    return found


def test_every_image_in_the_kit_is_pinned_by_digest():
    images = [image for _, doc in kit_objects() for image in images_in(doc)]
    values = helm_values()
    images += images_in(values)
    images += [v for k, v in code_location_env().items() if k == "GPUINFER_WORKER_IMAGE"]
    for dockerfile in DEPLOY.rglob("Dockerfile*"):
        images += re.findall(r"^ARG \w+_BASE=(\S+)$", dockerfile.read_text(), flags=re.MULTILINE)
    assert len(images) >= 8
    unpinned = [image for image in images if not DIGEST.match(image)]
    assert unpinned == []
    for bad in ("busybox:1.37.0", "repo/x:latest", "repo/x@sha256:abc", "repo/x"):
        assert not DIGEST.match(bad), bad


def test_the_gpu_image_installs_only_hash_locked_packages():
    dockerfile = (DEPLOY / "worker" / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert installs == [
        "RUN python3 -m pip install --require-hashes --no-deps -r requirements/lock-gpu.txt"
    ]
    lock = (REPO / "requirements" / "lock-gpu.txt").read_text()
    pins = re.findall(
        r"^([A-Za-z0-9_.-]+)==(\S+) \\\n    --hash=sha256:[0-9a-f]{64}$", lock, re.MULTILINE
    )
    entries = [line for line in lock.splitlines() if line and not line.startswith(("#", " "))]
    assert len(pins) == len(entries) > 100, "every entry is pinned with its sha256"
    pinned = {name.lower(): version for name, version in pins}
    for requirement in (REPO / "requirements" / "worker-gpu.in").read_text().splitlines():
        if requirement and not requirement.startswith("#"):
            name, version = requirement.split("==")
            assert pinned[name.lower()] == version, requirement
