"""`build_worker_group`: one vLLM engine across several pods, as a pure function.

A spec with `nodes=N > 1` runs one engine of `tensor_parallel_size x pipeline_parallel_size`
ranks split evenly over N pods:

- the **leader** (node rank 0) is the ordinary worker pod of `build_worker_pod`, whose
  engine gets vLLM's `nnodes`, `node_rank=0`, `master_addr`, `master_port` and the `mp`
  executor (`worker.loop.engine.leader_kwargs`); it reads the shards, drives the engine and
  commits, and the launcher reads its Pipes messages from its log with `PipesK8sClient`;
- N-1 **followers** (`python -m dagster_gpuinfer.worker.follower`) run vLLM's headless
  workers for their rank and end themselves when the leader's port closes;
- a **headless Service** (`clusterIP: None`, `publishNotReadyAddresses`) selects the leader,
  so followers reach it at `<service>.<namespace>.svc` before it is ready (the master port
  opens while the engine loads, long before any readiness). The leader binds its own pod IP
  (downward API `status.podIP`), and every pod announces its pod IP to vLLM and gloo/NCCL
  (`VLLM_HOST_IP`, `GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`).

**The gang: Kueue plain pod groups.** Every pod carries `kueue.x-k8s.io/pod-group-name` and
the annotation `kueue.x-k8s.io/pod-group-total-count`: Kueue holds all of them behind its
scheduling gate until the group's whole quota (N x GPUs per pod) fits, then admits all of
them at once, or none. Why this and not the others:

- the launcher keeps creating plain pods, so the leader runs through `PipesK8sClient` exactly
  as a one-pod worker does (log streaming, post-mortem, failure table) and nothing new reads
  logs or status;
- Kueue is already the project's admission layer (deploy/kueue), so the gang costs no new
  controller; LeaderWorkerSet and JobSet need their own controllers and put a
  StatefulSet/Job between the launcher and the pod it must read;
- the native `scheduling.k8s.io` PodGroup of the 1.37 schemas is alpha (a feature gate) and
  would bypass the Kueue quotas the GPU fleet is shared by.
  With `kueue.x-k8s.io/retriable-in-group: "false"` Kueue finishes the group's workload on the
  first failed pod instead of waiting for a replacement: the launcher, not Kueue, retries it
  (a new group, from committed chunks).

**Topology.** Followers must sit near the leader (same zone, or same rack with a rack label
such as `topology.kubernetes.io/rack` or a cloud's placement group label): every follower has
a required `podAffinity` to the group's pods on `GroupConfig.topology_key`; the leader has
none (it is the anchor). `None` turns it off.

This module imports only the standard library, pydantic and dagster (like `k8s.pod`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dagster as dg
from pydantic import Field

from dagster_gpuinfer.k8s.config import LABEL_PREFIX, K8sLauncherConfig, PodSpecError
from dagster_gpuinfer.k8s.names import RunIdentity, dns_label, worker_pod_name
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.follower import FOLLOWER_MODULE

POD_GROUP_NAME_LABEL = "kueue.x-k8s.io/pod-group-name"
POD_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE_IN_GROUP_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
GROUP_LABEL = f"{LABEL_PREFIX}/group"
ROLE_LABEL = f"{LABEL_PREFIX}/group-role"
RANK_LABEL = f"{LABEL_PREFIX}/node-rank"
MASTER_ADDR_ENV = "GPUINFER_MASTER_ADDR"  # read by worker.loop.engine.leader_kwargs
MASTER_PORT_ENV = "GPUINFER_MASTER_PORT"


class GroupConfig(dg.Config):
    """How the pods of one engine across nodes find each other and where they run."""

    topology_key: str | None = Field(
        "topology.kubernetes.io/zone",
        description="Node label the group's pods must share (required podAffinity of the "
        "followers to the group): the zone, or a rack / placement-group label for a fast "
        "interconnect. None: no affinity.",
    )
    master_port: int = Field(
        29500, ge=1024, le=65535, description="vLLM's master port on the leader (its store)."
    )
    socket_ifname: str | None = Field(
        "eth0",
        description="Network interface gloo and NCCL use between pods (GLOO_SOCKET_IFNAME, "
        "NCCL_SOCKET_IFNAME): the pod network's. None leaves them to autodetection.",
    )
    follower_join_timeout: float = Field(
        900.0,
        gt=0,
        description="Seconds a follower waits for the leader's port before it fails.",
    )
    follower_probe_interval: float = Field(
        5.0, gt=0, description="Seconds between a follower's probes of the leader's port."
    )
    node_env: list[dict[str, str]] = Field(
        default_factory=list,
        description="Extra plain env per node rank (index 0 is the leader), e.g. CPU "
        "binding (VLLM_CPU_OMP_THREADS_BIND) on a CPU test cluster.",
    )


@dataclass(frozen=True)
class WorkerGroup:
    """The objects of one group: created together, deleted together."""

    name: str
    service: dict[str, Any]
    leader: dict[str, Any]
    followers: list[dict[str, Any]]

    @property
    def pods(self) -> list[dict[str, Any]]:
        return [self.leader, *self.followers]


def group_name(identity: RunIdentity) -> str:
    """The group's name: the leader pod's name (unique per launch)."""
    return worker_pod_name(identity)


def follower_engine_args(spec: InferenceSpec) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments the followers build their part of the engine with:
    the leader's (`worker.loop.engine.engine_kwargs`) minus the ones each node sets itself."""
    kwargs = spec.engine.to_vllm_kwargs()
    if task_facts(spec.task).pooling:
        kwargs["runner"] = task_facts(spec.task).runner
    return kwargs


def build_worker_group(
    spec: InferenceSpec,
    config: K8sLauncherConfig,
    identity: RunIdentity,
    group: GroupConfig,
    *,
    extra_env: Mapping[str, str] | None = None,
) -> WorkerGroup:
    """The Service, leader pod and follower pods of the engine `spec` spans.

    A pure function: no I/O, no cluster. Each pod requests `spec.ranks_per_node()` GPUs.

    Args:
        spec: A spec with `nodes > 1` (`InferenceSpec` validated the rank split).
        config: The launcher configuration every pod of the group shares.
        identity: Run id, asset and attempt numbers; they name the group.
        group: Topology, port, interface and per-rank env of the group.
        extra_env: Plain environment of the resource (`GpuInferenceResource.env`).

    Raises:
        PodSpecError: the spec is not multi-node, or the configuration cannot make the group.
    """
    if spec.nodes < 2:
        raise PodSpecError(
            f"build_worker_group needs a spec with nodes > 1 (got nodes={spec.nodes}); one "
            "node is one pod: build_worker_pod"
        )
    if len(group.node_env) > spec.nodes:
        raise PodSpecError(
            f"k8s group node_env has {len(group.node_env)} entries for nodes={spec.nodes}; "
            "give at most one per node rank (0 is the leader)"
        )
    name = group_name(identity)
    service_name = dns_label(f"{name}-leader")
    master_dns = f"{service_name}.{config.namespace}.svc"
    env = dict(extra_env or {})
    base = build_worker_pod(spec, config, identity, extra_env=env)
    _per_node_gpus(base, config, spec.ranks_per_node())
    leader = _group_member(base, spec, group, name=name, rank=0, master_addr=None)
    followers = []
    for rank in range(1, spec.nodes):
        pod = _group_member(base, spec, group, name=name, rank=rank, master_addr=master_dns)
        pod["metadata"]["name"] = dns_label(f"{name}-n{rank}")
        container = pod["spec"]["containers"][0]
        container["command"] = [config.command[0], "-m", FOLLOWER_MODULE]
        container["args"] = _follower_args(spec, group, rank, master_dns)
        _follower_affinity(pod, group, name)
        followers.append(pod)
    return WorkerGroup(
        name=name,
        service=_leader_service(service_name, name, config, group),
        leader=leader,
        followers=followers,
    )


def _per_node_gpus(pod: dict[str, Any], config: K8sLauncherConfig, gpus: int) -> None:
    resource = config.placement.gpu_resource_name
    resources = pod["spec"]["containers"][0]["resources"]
    if resource:
        resources["requests"][resource] = str(gpus)
        resources["limits"][resource] = str(gpus)
    pod["metadata"]["labels"][f"{LABEL_PREFIX}/gpus"] = str(gpus)


def _group_member(
    base: dict[str, Any],
    spec: InferenceSpec,
    group: GroupConfig,
    *,
    name: str,
    rank: int,
    master_addr: str | None,
) -> dict[str, Any]:
    """A copy of the worker pod labelled and annotated into the group, with the env that
    tells vLLM and gloo/NCCL where the leader and this pod are."""
    pod = copy.deepcopy(base)
    labels = pod["metadata"]["labels"]
    labels[POD_GROUP_NAME_LABEL] = name
    labels[GROUP_LABEL] = name
    labels[ROLE_LABEL] = "leader" if rank == 0 else "follower"
    labels[RANK_LABEL] = str(rank)
    annotations = pod["metadata"]["annotations"]
    annotations[POD_GROUP_COUNT_ANNOTATION] = str(spec.nodes)
    annotations[RETRIABLE_IN_GROUP_ANNOTATION] = "false"
    pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    env: list[dict[str, Any]] = [
        {"name": MASTER_ADDR_ENV, **({"value": master_addr} if master_addr else pod_ip)},
        {"name": MASTER_PORT_ENV, "value": str(group.master_port)},
        {"name": "VLLM_HOST_IP", **pod_ip},
    ]
    if group.socket_ifname:
        env += [
            {"name": "GLOO_SOCKET_IFNAME", "value": group.socket_ifname},
            {"name": "NCCL_SOCKET_IFNAME", "value": group.socket_ifname},
        ]
    if rank < len(group.node_env):
        env += [{"name": k, "value": v} for k, v in sorted(group.node_env[rank].items())]
    container = pod["spec"]["containers"][0]
    names = {item["name"] for item in env}
    container["env"] = [item for item in container["env"] if item["name"] not in names] + env
    if rank == 0:
        container["ports"] = [
            {"name": "vllm-master", "containerPort": group.master_port, "protocol": "TCP"}
        ]
    return pod


def _follower_args(
    spec: InferenceSpec, group: GroupConfig, rank: int, master_dns: str
) -> list[str]:
    return [
        "--model",
        spec.model.removeprefix("file://"),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(spec.pipeline_parallel_size),
        "--nnodes",
        str(spec.nodes),
        "--node-rank",
        str(rank),
        "--master-addr",
        master_dns,
        "--master-port",
        str(group.master_port),
        "--engine-args-json",
        json.dumps(follower_engine_args(spec), sort_keys=True, separators=(",", ":")),
        "--join-timeout",
        f"{group.follower_join_timeout:g}",
        "--probe-interval",
        f"{group.follower_probe_interval:g}",
    ]


def _follower_affinity(pod: dict[str, Any], group: GroupConfig, name: str) -> None:
    """Followers go where the group's leader is: same value of the topology label."""
    if not group.topology_key:
        return
    term = {
        "labelSelector": {"matchLabels": {GROUP_LABEL: name, ROLE_LABEL: "leader"}},
        "topologyKey": group.topology_key,
    }
    affinity = pod["spec"].setdefault("affinity", {})
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)


def _leader_service(
    service_name: str, name: str, config: K8sLauncherConfig, group: GroupConfig
) -> dict[str, Any]:
    """A headless Service whose DNS name resolves to the leader pod, ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name,
            "namespace": config.namespace,
            "labels": {
                "app.kubernetes.io/name": "dagster-gpuinfer",
                "app.kubernetes.io/component": "worker-group",
                "app.kubernetes.io/managed-by": "dagster-gpuinfer",
                GROUP_LABEL: name,
            },
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {GROUP_LABEL: name, ROLE_LABEL: "leader"},
            "ports": [
                {
                    "name": "vllm-master",
                    "port": group.master_port,
                    "targetPort": group.master_port,
                    "protocol": "TCP",
                }
            ],
        },
    }
