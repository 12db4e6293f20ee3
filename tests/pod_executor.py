"""A pod executor for the tests: a fake cluster whose pods *run* (a fixture module, not tests).

`tests/k8s_fakes.py` replaces the cluster at `CoreV1Api` with scripted pods. `PodExecutor`
keeps that boundary (it is injected the same way, through
`GpuInferenceResource.kubernetes_client`, see `executor_resource`) but a created pod runs its
container for real, so the worker that starts is the one a cluster would start:

- command and args from the pod's first container (the `V1Pod` the launcher built, with
  dagster-k8s's Pipes bootstrap env already in it);
- env: `value`, `valueFrom.secretKeyRef` / `configMapKeyRef` (from the fake Secrets and
  ConfigMaps given to the executor), `fieldRef` (`metadata.name`, `metadata.namespace`,
  `metadata.labels['k']`, `status.podIP`, `spec.nodeName`), `envFrom` secretRef/configMapRef.
  A missing Secret/key (not optional) leaves the container waiting in
  `CreateContainerConfigError`, as the kubelet does;
- the filesystem: a fresh root (tmpfs) in a private mount namespace holding the "image" (the
  host's /usr, /etc, /lib..., the project's venv and source tree, all read-only), /proc,
  /sys, /dev, and each volume mounted at its `mountPath` (`emptyDir` = a temp dir,
  `medium: Memory` = a tmpfs with its sizeLimit, `hostPath` = that host dir,
  `persistentVolumeClaim` = the host dir given in `claims`, `readOnly` honoured, `subPath`
  too). With `readOnlyRootFilesystem` the root itself is read-only: only volumes are
  writable. A pod sees none of the host's /tmp or /work beyond what it mounts;
- as `runAsUser`/`runAsGroup` (container over pod), `fsGroup` as a supplementary group, no
  new privileges, no capabilities; hostname = the pod's name (its own UTS namespace);
- its own network namespace with a pod IP on a private /24 (10.244.X.0/24, X free on this
  machine) whose gateway `.1` is a bridge the executor creates on the host
  (`executor.gateway`): pods reach each other and the gateway, nothing else. A server the
  pods must reach (the loopback S3 of a test) binds `executor.gateway`;
- name resolution through a per-pod `/etc/hosts` (bind-mounted, rewritten in place on every
  change): every live pod by name (and `hostname.subdomain.ns.svc.cluster.local`), and every
  Service made with `create_namespaced_service` (selector -> the IPs of matching pods, as
  `svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`); `resolve(name)` answers the
  same from the test.

The image maps to the project: `images` maps image names to `Image`s; the default maps every
image except those in `broken_images` to `project_image()` (the running interpreter's venv at
`/venv`, its `python3` on PATH, and this source tree at `/app`, on PYTHONPATH and the working
directory: fixed paths, as a built image has them, wherever the checkout lies on the host).
An image that is not mapped waits in `ErrImagePull`; a command the image lacks ends the
container with `StartError` (exit 128).

Status follows the process: Pending (behind Kueue's scheduling gate while a plan says
`gated`, until `admit(name)`; Unschedulable when it asks for GPUs), Running (ready),
Succeeded / Failed with the exit code (`Completed`, `Error`, `OOMKilled`). Logs are the
process's stdout and stderr, with kubelet timestamps, streamed while it runs (what
`PipesK8sClient` reads Pipes messages from). Delete is asynchronous as on a cluster: SIGTERM to
the container's main process, `terminationGracePeriodSeconds` (or the call's
`grace_period_seconds`), then SIGKILL to every process of the pod; the pod stays readable
(Running, with a deletion timestamp) until its processes are gone, then reads 404.

Faults, by plan or by call:
    `PodPlan(oom_on_log=regex)`  / `executor.oom_kill(name)`: SIGKILL, `OOMKilled`, 137.
    `PodPlan(delete_on_log=regex)` / `executor.delete(name)`: a delete from outside.
    `PodPlan(preempt_on_log=regex)` / `executor.preempt(name)`: a `DisruptionTarget`
        condition (reason `PreemptionByScheduler`), then the delete.
Plans apply to pods in creation order (`PodExecutor(plans=[...])`, or `executor.plans`).

API (what the tests use):
    executor = PodExecutor(secrets={...}, config_maps={...}, claims={...}, plans=[...])
    executor.client()        -> DagsterKubernetesClient (real clock) for the launcher
    executor_resource(executor, **fields) -> GpuInferenceResource using it
    executor.pods            -> {name: RunningPod} (live pods); executor.created (all, in
                                 order; RunningPod.seen: uid/gid/groups/namespaces/argv of
                                 the process, read at its first output line)
    executor.pod_ip(name), executor.resolve(host, namespace), executor.logs(name)
    executor.wait_for_log(name_or_None, regex, timeout) -> (pod name, line)
    executor.wait_until_gone(name, timeout); executor.admit / oom_kill / delete / preempt
    create_namespaced_service / read_ / delete_namespaced_service (selector -> /etc/hosts)
    executor.close()          -> kills every process, removes namespaces, links, temp dirs
                                 (GPUINFER_KEEP_POD_DIRS=1 keeps the dirs: volumes, logs)
    the `pod_executor` fixture (tests/conftest.py) closes it after each test, always.

Needs root (namespaces, mounts, links), as CI has. Linux only.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import json
import os
import re
import secrets as _random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
from dagster_k8s.client import DagsterKubernetesClient
from kubernetes.client import (
    ApiClient,
    CoreV1Event,
    CoreV1EventList,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSchedulingGate,
    V1PodStatus,
)

SOURCE_TREE = Path(__file__).resolve().parent.parent
# Where the project image has its code and its venv, as a built image would: fixed paths,
# not the host's (a checkout under /tmp is hidden by the pod's /tmp emptyDir).
POD_SOURCE_TREE = "/app"
POD_VENV = "/venv"
KUEUE_GATE = "kueue.x-k8s.io/admission"
_API = ApiClient()
_SUBNET_LOCK = "/run/gpuinfer-pod-executor.lock"
_IMAGE_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "opt")


def _now() -> datetime:
    return datetime.now(UTC)


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _not_found(what: str) -> kubernetes.client.ApiException:
    error = kubernetes.client.ApiException(status=404, reason="Not Found")
    error.body = json.dumps({"kind": "Status", "message": f"{what} not found", "code": 404})
    return error


def _to_dict(body: Any) -> dict[str, Any]:
    return body if isinstance(body, dict) else _API.sanitize_for_serialization(body)


def to_model(data: Any, klass: str) -> Any:
    """Deserialise a manifest dict the way the client deserialises API responses."""

    class _Response:
        pass

    response = _Response()
    response.data = json.dumps(data)  # type: ignore[attr-defined]
    return _API.deserialize(response, klass)


# --------------------------------------------------------------------------- images, plans


@dataclass(frozen=True)
class Image:
    """What an image name maps to: host paths the container sees read-only (`paths` at the
    same paths, `mounts` as `(host path, path in the pod)`), besides the system dirs; its
    environment and working directory."""

    paths: tuple[str, ...]
    env: Mapping[str, str]
    workdir: str = "/"
    mounts: tuple[tuple[str, str], ...] = ()

    def host_path(self, pod_path: str) -> str:
        """Where `pod_path` of the image lies on the host (the system dirs and `paths` at
        the same path)."""
        for host, inside in self.mounts:
            if pod_path == inside or pod_path.startswith(inside.rstrip("/") + "/"):
                return host + pod_path[len(inside) :]
        return pod_path


KV_CACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"


def project_image() -> Image:
    """The worker image of this project, with its code at fixed paths as a built image has
    it: this source tree at `POD_SOURCE_TREE` (importable, the working directory) and the
    running interpreter's venv at `POD_VENV` (its `python3` on PATH), wherever they lie on
    the host. A checkout under /tmp would otherwise be hidden by the pod's /tmp emptyDir."""
    prefix = os.path.realpath(sys.prefix)
    base = os.path.realpath(sys.base_prefix)
    paths = () if base in ("/usr", "/usr/local") else (base,)
    env = {
        "PATH": f"{POD_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": POD_SOURCE_TREE,
        "LANG": "C.UTF-8",
    }
    # The suite's KV cache size (tests/conftest.py) as a test image's ENV would carry it: a
    # pod's engine otherwise reserves a fifth of the machine's memory.
    if os.environ.get(KV_CACHE_SPACE):
        env[KV_CACHE_SPACE] = os.environ[KV_CACHE_SPACE]
    return Image(
        paths=paths,
        mounts=((str(SOURCE_TREE), POD_SOURCE_TREE), (prefix, POD_VENV)),
        env=env,
        workdir=POD_SOURCE_TREE,
    )


@dataclass
class PodPlan:
    """What happens to one pod besides running (applied in creation order).

    Attributes:
        gated: Held behind Kueue's admission gate (Pending) until `executor.admit(name)`.
        oom_on_log: When a log line matches this regex, the container is OOMKilled.
        delete_on_log: When a log line matches, the pod is deleted from outside.
        preempt_on_log: When a log line matches, the pod is preempted (DisruptionTarget,
            then deleted).
    """

    gated: bool = False
    oom_on_log: str | None = None
    delete_on_log: str | None = None
    preempt_on_log: str | None = None


@dataclass
class RunningPod:
    """One pod of the executor: its manifest, process, network and state."""

    manifest: dict[str, Any]
    plan: PodPlan
    created_at: datetime
    ip: str
    netns: str
    veth: str
    workdir: Path
    admitted: bool = True
    admitted_at: datetime | None = None
    process: subprocess.Popen[bytes] | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    exit_code: int | None = None
    terminated_reason: str | None = None
    terminated_message: str | None = None
    waiting_reason: str | None = None
    waiting_message: str | None = None
    unschedulable: str | None = None
    deletion_requested_at: datetime | None = None
    disruption: str | None = None
    oom_injected: bool = False
    log: list[tuple[str, bytes]] = field(default_factory=list)
    log_done: bool = False
    seen: dict[str, Any] = field(default_factory=dict)  # the process, read at its first output
    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.manifest["metadata"]["namespace"]

    @property
    def container(self) -> dict[str, Any]:
        return self.manifest["spec"]["containers"][0]

    @property
    def labels(self) -> dict[str, str]:
        return self.manifest["metadata"].get("labels") or {}

    @property
    def terminated(self) -> bool:
        return self.exit_code is not None

    def text(self) -> str:
        return b"".join(line for _, line in self.log).decode(errors="replace")


class PodConfigError(Exception):
    """The kubelet cannot build the container (CreateContainerConfigError)."""


# --------------------------------------------------------------------------- the network

_TOKENS = itertools.count()


def _next_token() -> str:
    """This process's pid (6 hex digits) and a counter: names a stale sweep can trace."""
    return f"{os.getpid():06x}{next(_TOKENS) % 256:02x}"


def _owner_alive(token: str) -> bool:
    try:
        os.kill(int(token[:6], 16), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True


def sweep_stale_pod_networks() -> None:
    """Remove namespaces and links left by executors whose process died without closing
    (a killed test session): their processes, netns `gpn<token>-N`, links `gpv`/`gpb`."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for match in re.finditer(r"^(gpn([0-9a-f]{8})-\d+)", names, re.MULTILINE):
        netns, token = match.group(1), match.group(2)
        if not _owner_alive(token):
            for pid in PodNetwork.pids(netns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for match in re.finditer(r"^\d+: (gp[bv]([0-9a-f]{8})[0-9a-f]*)[@:]", links, re.MULTILINE):
        if not _owner_alive(match.group(2)):
            subprocess.run(["ip", "link", "del", match.group(1)], capture_output=True)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


class PodNetwork:
    """A bridge with a free 10.244.X.0/24 on the host; one netns + veth per pod."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.bridge = f"gpb{token}"
        with open(_SUBNET_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = subprocess.run(
                ["ip", "-o", "-4", "addr"], check=True, capture_output=True, text=True
            ).stdout
            taken = {int(m) for m in re.findall(r"inet 10\.244\.(\d+)\.", used)}
            free = [x for x in range(10, 250) if x not in taken]
            if not free:
                raise RuntimeError("no free 10.244.X.0/24 for the pod network on this machine")
            self.subnet = f"10.244.{free[int(token, 16) % len(free)]}"
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        self.gateway = f"{self.subnet}.1"
        self._next = 2

    def add_pod(self) -> tuple[str, str, str]:
        """A new netns with `eth0` on the bridge: (netns name, host veth name, pod IP)."""
        index = self._next
        self._next += 1
        if index > 254:
            raise RuntimeError("the pod network ran out of addresses (253 pods)")
        netns, veth, ip = f"gpn{self.token}-{index}", f"gpv{self.token}{index:x}", ""
        ip = f"{self.subnet}.{index}"
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        _run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "route", "add", "default", "via", self.gateway)
        return netns, veth, ip

    @staticmethod
    def pids(netns: str) -> list[int]:
        result = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        return [int(p) for p in result.stdout.split()]

    @staticmethod
    def remove_pod(netns: str, veth: str) -> None:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


# --------------------------------------------------------------------------- the executor


class PodExecutor:
    """A fake `CoreV1Api` whose pods run for real (see the module docstring)."""

    def __init__(
        self,
        *,
        secrets: Mapping[str, Mapping[str, str]] | None = None,
        config_maps: Mapping[str, Mapping[str, str]] | None = None,
        claims: Mapping[str, str] | None = None,
        images: Mapping[str, Image] | None = None,
        broken_images: tuple[str, ...] = (),
        plans: list[PodPlan] | None = None,
    ) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "the pod executor needs root (network and mount namespaces); run the cluster "
                "tests as root, as CI does"
            )
        self.secrets = {k: dict(v) for k, v in (secrets or {}).items()}
        self.config_maps = {k: dict(v) for k, v in (config_maps or {}).items()}
        self.claims = dict(claims or {})
        self.images = dict(images or {})
        self.broken_images = set(broken_images)
        self.plans = list(plans or [])
        self.token = _next_token()
        sweep_stale_pod_networks()
        atexit.register(self.close)  # an interrupted session still removes its namespaces
        self.root = Path(tempfile.mkdtemp(prefix=f"gpuinfer-pods-{self.token}-"))
        self.network = PodNetwork(self.token)
        self.gateway = self.network.gateway
        self.pods: dict[str, RunningPod] = {}
        self.created: list[RunningPod] = []
        self.deleted: list[str] = []
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._closed = False

    # ------------------------------------------------------------------ harness API

    def client(self) -> DagsterKubernetesClient:
        """The client the launcher uses (real clock: the pods run in real time)."""
        return DagsterKubernetesClient(
            batch_api=None,
            core_api=self,
            logger=lambda *a, **k: None,
            sleeper=time.sleep,
            timer=time.time,
        )

    def image_for(self, name: str) -> Image | None:
        if name in self.images:
            return self.images[name]
        if name in self.broken_images:
            return None
        return project_image()

    def pod_ip(self, name: str) -> str:
        return self._pod(name).ip

    def logs(self, name: str) -> str:
        with self._lock:
            for pod in self.created:
                if pod.name == name:
                    return pod.text()
        raise KeyError(name)

    def resolve(self, host: str, namespace: str = "default") -> list[str]:
        """What a pod in `namespace` resolves `host` to (its /etc/hosts)."""
        with self._lock:
            found = []
            for ip, names in self._host_entries(namespace):
                if host in names:
                    found.append(ip)
            return found

    def wait_for_log(
        self, name: str | None, pattern: str, timeout: float = 300.0
    ) -> tuple[str, str]:
        """Block until a pod's (`name`, or any pod's) log has a line matching `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for pod in self.created:
                    if name is not None and pod.name != name:
                        continue
                    for _, line in pod.log:
                        text = line.decode(errors="replace")
                        if regex.search(text):
                            return pod.name, text
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no pod log line matched {pattern!r} in {timeout}s")
                self._changed.wait(min(left, 1.0))

    def wait_until_gone(self, name: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while name in self.pods:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"pod {name} still exists after {timeout}s")
                self._changed.wait(min(left, 1.0))

    def admit(self, name: str) -> None:
        """Kueue admits a gated pod: its gate goes and its container starts."""
        with self._lock:
            pod = self._pod(name)
            if not pod.admitted:
                pod.admitted = True
                pod.admitted_at = _now()
                self._start(pod)

    def oom_kill(self, name: str) -> None:
        """The kernel's OOM killer kills the container (exit 137, reason OOMKilled)."""
        with self._lock:
            pod = self._pod(name)
            pod.oom_injected = True
            pod.events.append(("Warning", "OOMKilling", "Memory cgroup out of memory"))
        self._kill_all(pod, signal.SIGKILL)

    def delete(self, name: str, grace: float | None = None) -> None:
        self.delete_namespaced_pod(name, self._pod(name).namespace, grace_period_seconds=grace)

    def preempt(self, name: str, reason: str = "PreemptionByScheduler") -> None:
        """Preemption: the DisruptionTarget condition, then a graceful delete."""
        with self._lock:
            self._pod(name).disruption = reason
        self.delete(name)

    def close(self) -> None:
        """Kill every pod's processes, remove namespaces, links and temp dirs (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pods = list(self.created)
        for pod in pods:
            self._kill_all(pod, signal.SIGKILL)
        for pod in pods:
            if pod.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pod.process.wait(timeout=30)
            PodNetwork.remove_pod(pod.netns, pod.veth)
        self.network.close()
        if os.environ.get("GPUINFER_KEEP_POD_DIRS") != "1":  # keep them to look inside
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PodExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ CoreV1Api: pods

    def create_namespaced_pod(self, namespace: str, body: Any, **kwargs: Any) -> V1Pod:
        manifest = _to_dict(body)
        meta = manifest["metadata"]
        meta.setdefault("namespace", namespace)
        if meta["namespace"] != namespace:
            raise kubernetes.client.ApiException(status=400, reason="namespace mismatch")
        with self._lock:
            if self._closed:
                raise RuntimeError("the pod executor is closed")
            if meta["name"] in self.pods:
                raise kubernetes.client.ApiException(status=409, reason="AlreadyExists")
            meta["uid"] = _random.token_hex(8)
            meta["creationTimestamp"] = _stamp(_now())
            plan = self.plans.pop(0) if self.plans else PodPlan()
            netns, veth, ip = self.network.add_pod()
            workdir = self.root / f"{meta['name']}-{len(self.created)}"
            workdir.mkdir()
            pod = RunningPod(
                manifest=manifest,
                plan=plan,
                created_at=_now(),
                ip=ip,
                netns=netns,
                veth=veth,
                workdir=workdir,
                admitted=not plan.gated,
            )
            self.pods[pod.name] = pod
            self.created.append(pod)
            self._write_hosts_files()
            if pod.admitted:
                pod.admitted_at = pod.created_at
                self._start(pod)
            self._changed.notify_all()
        return to_model(manifest, "V1Pod")

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> V1Pod:
        with self._lock:
            pod = self.pods.get(name)
            if pod is None or pod.namespace != namespace:
                raise _not_found(f'pods "{name}"')
            return self._render(pod)

    def list_namespaced_pod(
        self, namespace: str, field_selector: str = "", label_selector: str = "", **kwargs: Any
    ) -> V1PodList:
        with self._lock:
            pods = [p for p in self.pods.values() if p.namespace == namespace]
            if field_selector.startswith("metadata.name="):
                wanted = field_selector.removeprefix("metadata.name=")
                pods = [p for p in pods if p.name == wanted]
            if label_selector:
                wanted_labels = dict(item.split("=", 1) for item in label_selector.split(","))
                pods = [p for p in pods if _matches(p.labels, wanted_labels)]
            return V1PodList(items=[self._render(p) for p in pods])

    def delete_namespaced_pod(
        self, name: str, namespace: str, grace_period_seconds: float | None = None, **kwargs: Any
    ) -> None:
        with self._lock:
            pod = self.pods.get(name)
            if pod is None or pod.namespace != namespace:
                raise _not_found(f'pods "{name}"')
            if pod.deletion_requested_at is not None:
                return
            pod.deletion_requested_at = _now()
            self.deleted.append(name)
            grace = grace_period_seconds
            if grace is None:
                grace = pod.manifest["spec"].get("terminationGracePeriodSeconds", 30)
        threading.Thread(
            target=self._terminate, args=(pod, float(grace)), name=f"delete-{name}", daemon=True
        ).start()

    def list_namespaced_event(
        self, namespace: str, field_selector: str = "", **kwargs: Any
    ) -> CoreV1EventList:
        name = field_selector.removeprefix("involvedObject.name=")
        with self._lock:
            pod = self.pods.get(name)
            events = list(pod.events) if pod is not None else []
        return CoreV1EventList(
            items=[
                CoreV1Event(
                    metadata=V1ObjectMeta(name=f"{name}.{i}"),
                    involved_object=V1ObjectReference(kind="Pod", name=name, namespace=namespace),
                    type=kind,
                    reason=reason,
                    message=message,
                    count=1,
                )
                for i, (kind, reason, message) in enumerate(events)
            ]
        )

    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        container: str | None = None,
        follow: bool = False,
        timestamps: bool = False,
        tail_lines: int | None = None,
        _preload_content: bool = True,
        **kwargs: Any,
    ) -> Any:
        with self._lock:
            pod = self.pods.get(name)
            if pod is None:
                raise _not_found(f'pods "{name}"')
            if pod.process is None and not pod.terminated:
                raise kubernetes.client.ApiException(
                    status=400, reason=f'container "worker" in pod "{name}" is waiting to start'
                )
            lines = list(pod.log)
        if follow:
            return _LogStream(self._follow(pod, timestamps))
        tail = lines[-tail_lines:] if tail_lines else lines
        text = b"".join(((ts + " ").encode() if timestamps else b"") + ln for ts, ln in tail)
        return text.decode(errors="replace") if _preload_content else _LogStream([], text)

    # ------------------------------------------------------------------ CoreV1Api: services

    def create_namespaced_service(self, namespace: str, body: Any, **kwargs: Any) -> Any:
        manifest = _to_dict(body)
        manifest["metadata"].setdefault("namespace", namespace)
        with self._lock:
            key = (namespace, manifest["metadata"]["name"])
            if key in self.services:
                raise kubernetes.client.ApiException(status=409, reason="AlreadyExists")
            self.services[key] = manifest
            self._write_hosts_files()
        return to_model(manifest, "V1Service")

    def read_namespaced_service(self, name: str, namespace: str, **kwargs: Any) -> Any:
        with self._lock:
            if (namespace, name) not in self.services:
                raise _not_found(f'services "{name}"')
            return to_model(self.services[(namespace, name)], "V1Service")

    def delete_namespaced_service(self, name: str, namespace: str, **kwargs: Any) -> None:
        with self._lock:
            if self.services.pop((namespace, name), None) is None:
                raise _not_found(f'services "{name}"')
            self._write_hosts_files()

    # ------------------------------------------------------------------ running a pod

    def _pod(self, name: str) -> RunningPod:
        with self._lock:
            if name not in self.pods:
                raise KeyError(f"no live pod named {name!r}")
            return self.pods[name]

    def _start(self, pod: RunningPod) -> None:
        """Admitted: schedule (GPUs are refused), pull (the image map), then run."""
        gpus = _gpu_requests(pod.container)
        if gpus:
            pod.unschedulable = f"0/1 nodes are available: 1 Insufficient {gpus}."
            pod.events.append(("Warning", "FailedScheduling", pod.unschedulable))
            return
        pod.events.append(("Normal", "Scheduled", f"assigned {pod.name} to executor-node"))
        image = self.image_for(pod.container["image"])
        if image is None:
            pod.waiting_reason = "ErrImagePull"
            pod.waiting_message = (
                f'failed to pull image "{pod.container["image"]}": not found: manifest unknown'
            )
            pod.events.append(("Warning", "Failed", pod.waiting_message))
            return
        try:
            env = {**image.env, **self._container_env(pod)}
            script = self._launch_script(pod, image)
        except PodConfigError as exc:
            pod.waiting_reason = "CreateContainerConfigError"
            pod.waiting_message = str(exc)
            pod.events.append(("Warning", "Failed", f"Error: {exc}"))
            return
        argv = [*pod.container.get("command", []), *pod.container.get("args", [])]
        if not argv or _which(argv[0], env["PATH"], image) is None:
            pod.started_at = pod.finished_at = _now()
            pod.exit_code = 128
            pod.terminated_reason = "StartError"
            pod.terminated_message = (
                f'failed to create containerd task: exec: "{argv[0] if argv else ""}": '
                "executable file not found in $PATH"
            )
            pod.log_done = True
            pod.events.append(("Warning", "Failed", f"Error: {pod.terminated_message}"))
            return
        pod.process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                pod.netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "/bin/sh",
                str(script),
            ],  # fmt: skip
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        pod.started_at = _now()
        pod.events.append(("Normal", "Started", "Started container worker"))
        threading.Thread(
            target=self._pump, args=(pod,), name=f"log-{pod.name}", daemon=True
        ).start()

    def _container_env(self, pod: RunningPod) -> dict[str, str]:
        """The env as the kubelet resolves it: envFrom first, then env in order."""
        env: dict[str, str] = {}
        for source in pod.container.get("envFrom", []):
            prefix = source.get("prefix", "")
            for kind, store in (("secretRef", self.secrets), ("configMapRef", self.config_maps)):
                if kind in source:
                    ref = source[kind]
                    if ref["name"] not in store:
                        if ref.get("optional"):
                            continue
                        raise PodConfigError(f'{_kind_name(kind)} "{ref["name"]}" not found')
                    env.update({prefix + k: v for k, v in store[ref["name"]].items()})
        for item in pod.container.get("env", []):
            if "valueFrom" not in item:
                env[item["name"]] = _expand(item.get("value", ""), env)
                continue
            value = self._value_from(pod, item["valueFrom"])
            if value is not None:
                env[item["name"]] = value
        return env

    def _value_from(self, pod: RunningPod, source: dict[str, Any]) -> str | None:
        for kind, store in (("secretKeyRef", self.secrets), ("configMapKeyRef", self.config_maps)):
            if kind in source:
                ref = source[kind]
                data = store.get(ref["name"])
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    what = _kind_name(kind)
                    if data is None:
                        raise PodConfigError(f'{what} "{ref["name"]}" not found')
                    raise PodConfigError(f"couldn't find key {ref['key']} in {what} {ref['name']}")
                return data[ref["key"]]
        path = source.get("fieldRef", {}).get("fieldPath", "")
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "status.podIP": pod.ip,
            "spec.nodeName": "executor-node",
            "metadata.uid": pod.manifest["metadata"]["uid"],
        }
        if path in fields:
            return fields[path]
        label = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if label:
            return (pod.manifest["metadata"].get(label.group(1)) or {}).get(label.group(2), "")
        raise PodConfigError(f"unsupported valueFrom {source!r} (the pod executor knows "
                             "secretKeyRef, configMapKeyRef and common fieldRefs)")  # fmt: skip

    def _volume_sources(self, pod: RunningPod) -> dict[str, tuple[str, str]]:
        """Each volume as (kind, host path or tmpfs size): bind | tmpfs."""
        sources: dict[str, tuple[str, str]] = {}
        for volume in pod.manifest["spec"].get("volumes", []):
            name = volume["name"]
            if "emptyDir" in volume:
                empty = volume["emptyDir"] or {}
                if empty.get("medium") == "Memory":
                    sources[name] = ("tmpfs", empty.get("sizeLimit", "64Mi"))
                    continue
                path = pod.workdir / "volumes" / name
                path.mkdir(parents=True)
                path.chmod(0o777)  # the kubelet's emptyDir mode
                sources[name] = ("bind", str(path))
            elif "hostPath" in volume:
                host = volume["hostPath"]["path"]
                if volume["hostPath"].get("type") == "Directory" and not os.path.isdir(host):
                    raise PodConfigError(f"hostPath type check failed: {host} is not a directory")
                sources[name] = ("bind", host)
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in self.claims:
                    raise PodConfigError(f'persistentvolumeclaim "{claim}" not found')
                sources[name] = ("bind", self.claims[claim])
            elif "secret" in volume or "configMap" in volume:
                kind = "secret" if "secret" in volume else "configMap"
                ref = volume[kind].get("secretName") or volume[kind].get("name")
                store = self.secrets if kind == "secret" else self.config_maps
                if ref not in store:
                    raise PodConfigError(f'{kind} "{ref}" not found')
                path = pod.workdir / "volumes" / name
                path.mkdir(parents=True)
                for key, value in store[ref].items():
                    (path / key).write_text(value)
                    (path / key).chmod(0o644)
                sources[name] = ("bind", str(path))
            else:
                raise PodConfigError(f"volume {name!r}: this kind is not emulated ({volume})")
        return sources

    def _launch_script(self, pod: RunningPod, image: Image) -> Path:
        """The shell script that builds the pod's filesystem and execs its command as the
        pod's user; it runs inside the pod's network, mount and UTS namespaces."""
        spec = pod.manifest["spec"]
        pod_security = spec.get("securityContext") or {}
        security = {**pod_security, **(pod.container.get("securityContext") or {})}
        uid, gid = security.get("runAsUser", 0), security.get("runAsGroup", 0)
        if security.get("runAsNonRoot") and uid == 0:
            raise PodConfigError("container has runAsNonRoot and image will run as root")
        root = pod.workdir / "root"
        root.mkdir()
        q = shlex.quote
        lines = [
            "set -eu",
            f"R={q(str(root))}",
            "mount --make-rprivate /",
            'mount -t tmpfs -o mode=0755 pod-root "$R"',
        ]
        for top in _IMAGE_DIRS:
            host = Path("/") / top
            if host.is_symlink():
                lines.append(f'ln -s {q(os.readlink(host))} "$R/{top}"')
            elif host.is_dir():
                lines += [f'mkdir "$R/{top}"', f'mount --rbind /{top} "$R/{top}"']
                lines.append(f'mount -o remount,bind,ro "$R/{top}"')
        for host_path, pod_path in [*((p, p) for p in image.paths), *image.mounts]:
            target = f'"$R"{q(pod_path)}'
            lines += [f"mkdir -p {target}", f"mount --rbind {q(host_path)} {target}"]
            lines.append(f"mount -o remount,bind,ro {target}")
        for top in ("proc", "sys", "dev"):
            lines += [f'mkdir "$R/{top}"', f'mount --rbind /{top} "$R/{top}"']
        lines += ['mkdir -p "$R/tmp" "$R/var/tmp" "$R/run" "$R/home"']
        lines.append('mount -t tmpfs -o size=64m,mode=1777 shm "$R/dev/shm"')
        hosts = pod.workdir / "hosts"
        (pod.workdir / "hostname").write_text(pod.name + "\n")
        lines.append(f'mount --bind {q(str(hosts))} "$R/etc/hosts"')
        lines.append(f'mount --bind {q(str(pod.workdir / "hostname"))} "$R/etc/hostname"')
        sources = self._volume_sources(pod)
        for mount in pod.container.get("volumeMounts", []):
            if mount["name"] not in sources:
                raise PodConfigError(f"volumeMount {mount['name']!r} names no volume of the pod")
            kind, where = sources[mount["name"]]
            target = f'"$R"{q(mount["mountPath"])}'
            lines.append(f"mkdir -p {target}")
            if kind == "tmpfs":
                lines.append(f"mount -t tmpfs -o size={_bytes(where)},mode=1777 tmpfs {target}")
            else:
                source = os.path.join(where, mount.get("subPath", ""))
                lines.append(f"mount --rbind {q(source)} {target}")
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {target}")
        if security.get("readOnlyRootFilesystem"):
            lines.append('mount -o remount,ro "$R"')
        lines.append(f"hostname {q(pod.name)}")
        groups = [str(g) for g in [pod_security.get("fsGroup"), *pod_security.get(
            "supplementalGroups", [])] if g is not None]  # fmt: skip
        group_flag = f"--groups {','.join(groups)}" if groups else "--clear-groups"
        argv = [*pod.container.get("command", []), *pod.container.get("args", [])]
        workdir = pod.container.get("workingDir") or image.workdir
        lines.append(
            f'exec chroot "$R" setpriv --reuid {uid} --regid {gid} {group_flag} '
            "--no-new-privs --inh-caps=-all --bounding-set=-all "
            f'/bin/sh -c \'cd "$0" && exec "$@"\' {q(workdir)} ' + " ".join(q(arg) for arg in argv)
        )
        script = pod.workdir / "start.sh"
        script.write_text("\n".join(lines) + "\n")
        return script

    def _pump(self, pod: RunningPod) -> None:
        """Copy the process's output into the pod log (timestamped), run the plan's log
        triggers, and when the main process exits, end the pod like a kubelet."""
        assert pod.process is not None and pod.process.stdout is not None
        triggers = [
            (re.compile(pattern), action)
            for pattern, action in (
                (pod.plan.oom_on_log, self.oom_kill),
                (pod.plan.delete_on_log, self.delete),
                (pod.plan.preempt_on_log, self.preempt),
            )
            if pattern
        ]
        threading.Thread(target=self._reap, args=(pod,), daemon=True).start()
        for line in iter(pod.process.stdout.readline, b""):
            if not pod.seen:
                pod.seen = _process_facts(pod.process.pid)
            with self._changed:
                pod.log.append((_stamp(_now()), line if line.endswith(b"\n") else line + b"\n"))
                self._changed.notify_all()
            text = line.decode(errors="replace")
            for regex, action in list(triggers):
                if regex.search(text):
                    triggers.remove((regex, action))
                    threading.Thread(target=action, args=(pod.name,), daemon=True).start()
        code = pod.process.wait()
        with self._changed:
            pod.finished_at = _now()
            pod.exit_code = 137 if pod.oom_injected else (code if code >= 0 else 128 - code)
            if pod.oom_injected:
                pod.terminated_reason = "OOMKilled"
            else:
                pod.terminated_reason = "Completed" if pod.exit_code == 0 else "Error"
            pod.log_done = True
            if pod.deletion_requested_at is not None:
                self._remove(pod)
            self._changed.notify_all()

    def _reap(self, pod: RunningPod) -> None:
        """When the main process exits the container ends: its other processes die too
        (which closes the log pipe they may hold)."""
        assert pod.process is not None
        pod.process.wait()
        self._kill_all(pod, signal.SIGKILL)

    def _terminate(self, pod: RunningPod, grace: float) -> None:
        """A delete: SIGTERM to the main process, the grace period, SIGKILL to all."""
        with self._lock:
            process = pod.process
            running = process is not None and not pod.terminated
            if running:
                pod.events.append(("Normal", "Killing", "Stopping container worker"))
        if running and process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._kill_all(pod, signal.SIGKILL)
            return  # _pump sees the exit and removes the pod
        with self._changed:
            self._remove(pod)
            self._changed.notify_all()

    def _remove(self, pod: RunningPod) -> None:
        if self.pods.get(pod.name) is pod:
            del self.pods[pod.name]
            self._write_hosts_files()

    def _kill_all(self, pod: RunningPod, sig: signal.Signals) -> None:
        """Every process of the pod: its session and anything left in its netns."""
        if pod.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pod.process.pid, sig)
        for pid in PodNetwork.pids(pod.netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _follow(self, pod: RunningPod, timestamps: bool) -> Iterator[bytes]:
        sent = 0
        while True:
            with self._changed:
                while sent >= len(pod.log) and not pod.log_done:
                    self._changed.wait(1.0)
                batch = pod.log[sent:]
                done = pod.log_done
            for ts, line in batch:
                yield ((ts + " ").encode() if timestamps else b"") + line
            sent += len(batch)
            if done and sent >= len(pod.log):
                return

    # ------------------------------------------------------------------ names

    def _host_entries(self, namespace: str) -> list[tuple[str, list[str]]]:
        entries: list[tuple[str, list[str]]] = []
        live = [p for p in self.pods.values() if not p.terminated]
        for pod in live:
            names = [pod.name]
            spec = pod.manifest["spec"]
            if spec.get("hostname") and spec.get("subdomain"):
                fqdn = f"{spec['hostname']}.{spec['subdomain']}.{pod.namespace}.svc"
                names += [fqdn, f"{fqdn}.cluster.local"]
                if pod.namespace == namespace:
                    names.append(f"{spec['hostname']}.{spec['subdomain']}")
            entries.append((pod.ip, names))
        for (ns, name), service in self.services.items():
            selector = (service.get("spec") or {}).get("selector") or {}
            names = [f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]
            if ns == namespace:
                names.insert(0, name)
            for pod in live:
                if selector and pod.namespace == ns and _matches(pod.labels, selector):
                    entries.append((pod.ip, names))
        return entries

    def _write_hosts_files(self) -> None:
        """Rewrite every pod's /etc/hosts in place (a bind mount follows the inode)."""
        for pod in self.pods.values():
            lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
            lines += [f"{ip}\t{' '.join(names)}" for ip, names in self._host_entries(pod.namespace)]
            path = pod.workdir / "hosts"
            with open(path, "a+") as handle:
                handle.seek(0)
                handle.truncate()
                handle.write("\n".join(lines) + "\n")
            path.chmod(0o644)

    # ------------------------------------------------------------------ status

    def _render(self, pod: RunningPod) -> V1Pod:
        model = to_model(pod.manifest, "V1Pod")
        container = pod.container
        conditions: list[V1PodCondition] = []
        statuses: list[V1ContainerStatus] = []
        phase, reason, message = "Pending", None, None
        if pod.deletion_requested_at is not None:
            model.metadata.deletion_timestamp = pod.deletion_requested_at
        if pod.disruption:
            conditions.append(
                V1PodCondition(
                    type="DisruptionTarget",
                    status="True",
                    reason=pod.disruption,
                    message=f"{pod.disruption}: the pod was chosen for disruption",
                    last_transition_time=pod.deletion_requested_at,
                )
            )

        def status(state: V1ContainerState, ready: bool = False) -> V1ContainerStatus:
            return V1ContainerStatus(
                name=container["name"],
                image=container["image"],
                image_id="",
                ready=ready,
                restart_count=0,
                state=state,
            )

        if not pod.admitted:
            model.spec.scheduling_gates = [V1PodSchedulingGate(name=KUEUE_GATE)]
            conditions.append(
                V1PodCondition(type="PodScheduled", status="False", reason="SchedulingGated")
            )
        elif pod.unschedulable:
            conditions.append(
                V1PodCondition(
                    type="PodScheduled",
                    status="False",
                    reason="Unschedulable",
                    message=pod.unschedulable,
                )
            )
        else:
            model.spec.node_name = "executor-node"
            conditions.append(
                V1PodCondition(
                    type="PodScheduled", status="True", last_transition_time=pod.admitted_at
                )
            )
            if pod.waiting_reason:
                waiting = V1ContainerStateWaiting(
                    reason=pod.waiting_reason, message=pod.waiting_message
                )
                statuses.append(status(V1ContainerState(waiting=waiting)))
            elif not pod.terminated:
                running = V1ContainerStateRunning(started_at=pod.started_at)
                statuses.append(status(V1ContainerState(running=running), ready=True))
                phase = "Running"
            else:
                terminated = V1ContainerStateTerminated(
                    exit_code=pod.exit_code,
                    reason=pod.terminated_reason,
                    message=pod.terminated_message,
                    started_at=pod.started_at,
                    finished_at=pod.finished_at,
                )
                statuses.append(status(V1ContainerState(terminated=terminated)))
                phase = "Succeeded" if pod.exit_code == 0 else "Failed"
        model.status = V1PodStatus(
            phase=phase,
            reason=reason,
            message=message,
            conditions=conditions,
            container_statuses=statuses or None,
            pod_ip=pod.ip if pod.admitted and not pod.unschedulable else None,
            host_ip=self.gateway,
        )
        return model


class _LogStream:
    """What `read_namespaced_pod_log(..., _preload_content=False)` returns."""

    def __init__(self, chunks: Any, data: bytes = b"") -> None:
        self._chunks = chunks
        self.data = data

    def __iter__(self) -> Any:
        return iter(self._chunks)

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        return iter(self._chunks)

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- helpers


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _kind_name(kind: str) -> str:
    return "secret" if kind.startswith("secret") else "configmap"


def _expand(value: str, env: Mapping[str, str]) -> str:
    """`$(VAR)` references, as the kubelet expands them ($$ escapes)."""
    return re.sub(
        r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def _gpu_requests(container: dict[str, Any]) -> str | None:
    resources = container.get("resources") or {}
    for key, value in {**resources.get("requests", {}), **resources.get("limits", {})}.items():
        if key.endswith("/gpu") and str(value) not in ("0", ""):
            return key
    return None


def _process_facts(pid: int) -> dict[str, Any]:
    """Who the pod's main process runs as and where: uid/gid/groups, namespaces, root."""
    facts: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text()
        for key in ("Uid", "Gid", "Groups", "NoNewPrivs", "CapEff"):
            match = re.search(rf"^{key}:\s*(.*)$", status, re.MULTILINE)
            facts[key.lower()] = match.group(1).split() if match else []
        facts["netns"] = os.readlink(f"/proc/{pid}/ns/net")
        facts["mntns"] = os.readlink(f"/proc/{pid}/ns/mnt")
        facts["argv"] = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    return facts


def _which(command: str, path: str, image: Image) -> str | None:
    """Whether the image has `command` (on its PATH, or at its path), looked up on the host
    through the image's mounts."""
    if "/" in command:
        return command if os.access(image.host_path(command), os.X_OK) else None
    host_path = os.pathsep.join(image.host_path(entry) for entry in path.split(os.pathsep))
    return shutil.which(command, path=host_path)


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def _bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT])?", quantity)
    if match is None:
        raise PodConfigError(f"sizeLimit {quantity!r} is not a quantity the executor reads")
    return int(float(match.group(1)) * _UNITS.get(match.group(2) or "", 1))


def executor_resource(executor: PodExecutor, **resource_fields: Any) -> Any:
    """A `GpuInferenceResource` (launcher k8s) whose cluster is `executor`."""
    from dagster_gpuinfer import GpuInferenceResource

    class ExecutorClusterResource(GpuInferenceResource):
        def kubernetes_client(self) -> DagsterKubernetesClient:
            return executor.client()

    return ExecutorClusterResource(launcher="k8s", **resource_fields)


@contextlib.contextmanager
def s3_on_pod_network(bucket: str) -> Iterator[tuple[PodExecutor, str, Any]]:
    """A pod executor and a loopback S3 server (moto) that its pods reach at the pod
    network's gateway, with `bucket` created: `(executor, endpoint_url, boto3 client)`.

    The pods get the S3 credentials from the fake Secret `gpuinfer-s3` (envFrom in the
    launcher's config); this process gets them in its environment for the test's duration.
    """
    import boto3
    import pytest
    from moto.server import ThreadedMotoServer
    from s3_test_env import S3_TEST_ENV

    executor = PodExecutor(secrets={"gpuinfer-s3": dict(S3_TEST_ENV)})
    with pytest.MonkeyPatch.context() as patch:
        for name, value in S3_TEST_ENV.items():
            patch.setenv(name, value)
        server = ThreadedMotoServer(ip_address=executor.gateway, port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket=bucket)
            yield executor, endpoint, client
        finally:
            server.stop()
            executor.close()
