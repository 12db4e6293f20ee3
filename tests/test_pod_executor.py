"""The pod executor (tests/pod_executor.py) runs what a pod says, the way a kubelet would.

No engine here: small Python commands in pods, each test a few seconds. The launcher's
end-to-end cases through the executor are in tests/test_k8s_pods_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from pod_executor import PodExecutor, PodPlan

NS = "team-a"


def pod(name: str, script: str, **overrides: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "worker",
        "image": "registry.example.com/gpuinfer-worker:0.1.0",
        "command": ["python3", "-c"],
        "args": [script],
        "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
    }
    container.update(overrides.pop("container", {}))
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 2,
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000},
        "containers": [container],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
    }
    spec.update(overrides.pop("spec", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, **overrides},
        "spec": spec,
    }


def wait_phase(executor: PodExecutor, name: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = executor.read_namespaced_pod(name, NS).status
        if status.phase in ("Succeeded", "Failed"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"pod {name} did not end in {timeout}s: {status}")


def terminated(status: Any) -> Any:
    return status.container_statuses[0].state.terminated


PROBE = """
import json, os, socket, sys
def writable(path):
    try:
        open(os.path.join(path, '.probe'), 'w').close()
        return True
    except OSError:
        return False
print(json.dumps({
    'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),
    'env': {k: os.environ.get(k) for k in ('FROM_SECRET', 'FROM_CM', 'POD_IP', 'NAME', 'BULK_X',
                                           'VLLM_CPU_KVCACHE_SPACE')},
    'hostname': socket.gethostname(), 'python': sys.executable, 'cwd': os.getcwd(),
    'root_writable': writable('/'), 'tmp_writable': writable('/tmp'),
    'shm_writable': writable('/dev/shm'), 'models_writable': writable('/models'),
    'model_file': open('/models/weights.txt').read(),
    'host_tmp_hidden': not os.path.exists('/work/.library'),
    'package': __import__('dagster_gpuinfer').__file__,
}), flush=True)
"""


def test_pod_runs_its_command_with_env_mounts_user_and_network(pod_executor, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "weights.txt").write_text("w")
    pod_executor.secrets["hf"] = {"token": "s3cret"}
    pod_executor.secrets["bulk"] = {"X": "from-env-from"}
    pod_executor.config_maps["cfg"] = {"k": "cm-value"}
    manifest = pod(
        "probe",
        PROBE,
        container={
            "env": [
                {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},  # noqa: E501
                {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NAME", "value": "$(POD_IP)-x"},
            ],
            "envFrom": [{"secretRef": {"name": "bulk"}, "prefix": "BULK_"}],
            "volumeMounts": [
                {"name": "scratch", "mountPath": "/tmp"},
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "cache", "mountPath": "/models", "readOnly": True},
            ],
        },
        spec={
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                {"name": "cache", "hostPath": {"path": str(models), "type": "Directory"}},
            ]
        },
    )  # fmt: skip
    pod_executor.create_namespaced_pod(NS, manifest)
    status = wait_phase(pod_executor, "probe")
    assert status.phase == "Succeeded", pod_executor.logs("probe")
    assert terminated(status).exit_code == 0 and terminated(status).reason == "Completed"
    seen = json.loads(pod_executor.logs("probe").strip().splitlines()[-1])
    ip = status.pod_ip
    assert ip.startswith("10.244.") and ip != pod_executor.gateway
    assert (seen["uid"], seen["gid"], seen["groups"]) == (1000, 1000, [2000])
    assert seen["env"] == {
        "FROM_SECRET": "s3cret",
        "FROM_CM": "cm-value",
        "POD_IP": ip,
        "NAME": f"{ip}-x",
        "BULK_X": "from-env-from",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # the suite's, in the test image's env (conftest.py)
    }
    assert seen["hostname"] == "probe"
    assert not seen["root_writable"] and not seen["models_writable"]
    assert seen["tmp_writable"] and seen["shm_writable"]
    assert seen["model_file"] == "w" and seen["host_tmp_hidden"]
    assert seen["package"].startswith(str(pod_executor.image_for("x").env["PYTHONPATH"]))


CHECKOUT_PROBE = """
import json, os, sys
print(json.dumps({
    'cwd': os.getcwd(), 'prefix': sys.prefix,
    'package': __import__('dagster_gpuinfer').__file__,
}), flush=True)
"""


def test_the_checkout_is_at_one_fixed_path_wherever_it_lies_on_the_host(pod_executor):
    """A checkout under /tmp (where a newcomer clones) is hidden by the pod's /tmp emptyDir
    when the image maps host paths to the same paths: here volumes are mounted over the top
    folders of this checkout and of the venv, whatever they are, and the worker still
    starts, from the image's fixed paths."""
    from pod_executor import POD_SOURCE_TREE, POD_VENV, SOURCE_TREE

    tops = {"/" + Path(p).parts[1] for p in (str(SOURCE_TREE), os.path.realpath(sys.prefix))}
    over = sorted(tops - {"/tmp"})
    manifest = pod(
        "checkout",
        CHECKOUT_PROBE,
        container={
            "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]
            + [{"name": f"over{i}", "mountPath": top} for i, top in enumerate(over)]
        },
        spec={
            "volumes": [{"name": "scratch", "emptyDir": {}}]
            + [{"name": f"over{i}", "emptyDir": {}} for i in range(len(over))]
        },
    )
    pod_executor.create_namespaced_pod(NS, manifest)
    status = wait_phase(pod_executor, "checkout")
    assert status.phase == "Succeeded", pod_executor.logs("checkout")
    seen = json.loads(pod_executor.logs("checkout").strip().splitlines()[-1])
    assert seen["cwd"] == POD_SOURCE_TREE
    assert seen["package"] == f"{POD_SOURCE_TREE}/dagster_gpuinfer/__init__.py"
    assert seen["prefix"] == POD_VENV


SERVER = """
import socket
s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen()
print('listening', flush=True)
c, _ = s.accept(); c.sendall(b'hello from ' + socket.gethostname().encode()); c.close()
"""
CLIENT = """
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(('leader-svc', 7000), timeout=2); break
    except OSError:
        time.sleep(0.1)
print(c.recv(100).decode(), flush=True)
"""


def test_pods_reach_each_other_by_service_name_over_pod_ips(pod_executor):
    pod_executor.create_namespaced_pod(
        NS, pod("leader", SERVER, labels={"role": "leader"}, spec={"hostname": "leader"})
    )
    pod_executor.create_namespaced_service(
        NS,
        {"metadata": {"name": "leader-svc"}, "spec": {"selector": {"role": "leader"}}},
    )
    pod_executor.wait_for_log("leader", "listening", timeout=30)
    pod_executor.create_namespaced_pod(NS, pod("follower", CLIENT))
    assert pod_executor.resolve("leader-svc", NS) == [pod_executor.pod_ip("leader")]
    assert wait_phase(pod_executor, "follower").phase == "Succeeded"
    assert pod_executor.logs("follower").strip() == "hello from leader"
    assert wait_phase(pod_executor, "leader").phase == "Succeeded"
    # the two pods are in different network namespaces
    assert pod_executor.pod_ip("leader") != pod_executor.pod_ip("follower")


GRACE = 6
STUBBORN = """
import os, signal, sys, time
mode = sys.argv[1]
if mode == 'ignore':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: (os.write(1, b'draining\\n'), os._exit(3)))
print('running', flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("mode", "exit_code"), [("drain", 3), ("ignore", 137)])
def test_delete_sends_sigterm_then_sigkill_after_the_grace_period(pod_executor, mode, exit_code):
    manifest = pod(
        "p",
        STUBBORN,
        container={"args": [STUBBORN, mode]},
        spec={"terminationGracePeriodSeconds": GRACE},
    )
    pod_executor.create_namespaced_pod(NS, manifest)
    pod_executor.wait_for_log("p", "running", timeout=30)
    started = time.monotonic()
    pod_executor.delete_namespaced_pod("p", NS)
    if mode == "ignore":  # a deleted pod stays readable while it terminates, then it is gone
        assert pod_executor.read_namespaced_pod("p", NS).metadata.deletion_timestamp is not None
    pod_executor.wait_until_gone("p", timeout=30)
    took = time.monotonic() - started
    record = pod_executor.created[-1]
    assert record.exit_code == exit_code, record.text()
    # drain: its SIGTERM handler's exit code, before the grace period; ignore: SIGKILL after
    assert (took >= GRACE) == (mode == "ignore") and took < GRACE + 10
    assert ("draining" in record.text()) == (mode == "drain")
    assert subprocess.run(["ip", "netns", "pids", record.netns], capture_output=True).stdout == b""
    with pytest.raises(kubernetes.client.ApiException) as error:
        pod_executor.read_namespaced_pod("p", NS)
    assert error.value.status == 404


def test_injected_oom_kill_reads_oomkilled_137(pod_executor):
    pod_executor.plans.append(PodPlan(oom_on_log="allocating"))
    script = "import time; print('allocating', flush=True); time.sleep(600)"
    pod_executor.create_namespaced_pod(NS, pod("oom", script))
    status = wait_phase(pod_executor, "oom", timeout=30)
    assert status.phase == "Failed"
    assert (terminated(status).exit_code, terminated(status).reason) == (137, "OOMKilled")


def test_gated_pod_is_pending_until_admitted(pod_executor):
    pod_executor.plans.append(PodPlan(gated=True))
    pod_executor.create_namespaced_pod(NS, pod("gated", "print('ran')"))
    time.sleep(0.5)
    first = pod_executor.read_namespaced_pod("gated", NS)
    assert first.status.phase == "Pending"
    assert [g.name for g in first.spec.scheduling_gates] == ["kueue.x-k8s.io/admission"]
    assert pod_executor.logs("gated") == ""
    pod_executor.admit("gated")
    assert wait_phase(pod_executor, "gated").phase == "Succeeded"
    assert pod_executor.logs("gated") == "ran\n"


def waiting(executor: PodExecutor, name: str) -> Any:
    time.sleep(0.2)
    status = executor.read_namespaced_pod(name, NS).status
    assert status.phase == "Pending"
    return status.container_statuses[0].state.waiting


def test_pods_that_cannot_start_report_what_a_kubelet_reports(pod_executor):
    pod_executor.broken_images.add("registry.example.com/missing:1")
    pod_executor.create_namespaced_pod(
        NS, pod("no-image", "print(1)", container={"image": "registry.example.com/missing:1"})
    )
    assert waiting(pod_executor, "no-image").reason == "ErrImagePull"

    no_secret = {"name": "T", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}
    pod_executor.create_namespaced_pod(
        NS, pod("no-secret", "print(1)", container={"env": [no_secret]})
    )
    state = waiting(pod_executor, "no-secret")
    assert state.reason == "CreateContainerConfigError" and '"absent" not found' in state.message

    pod_executor.create_namespaced_pod(
        NS, pod("no-command", "", container={"command": ["gpuinfer-missing-binary"]})
    )
    status = wait_phase(pod_executor, "no-command")
    assert status.phase == "Failed"
    assert (terminated(status).exit_code, terminated(status).reason) == (128, "StartError")

    pod_executor.create_namespaced_pod(
        NS, pod("gpu", "print(1)", container={"resources": {"limits": {"nvidia.com/gpu": "1"}}})
    )
    time.sleep(0.2)
    scheduled = pod_executor.read_namespaced_pod("gpu", NS).status.conditions[-1]
    assert (scheduled.reason, scheduled.status) == ("Unschedulable", "False")


def test_close_removes_processes_namespaces_and_links(tmp_path):
    executor = PodExecutor()
    executor.create_namespaced_pod(
        NS, pod("sleeper", "import time; print('up', flush=True); time.sleep(600)")
    )
    executor.wait_for_log("sleeper", "up", timeout=30)
    record = executor.created[0]
    pid = record.process.pid
    executor.close()
    assert record.process.poll() is not None
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert record.netns not in names and executor.network.bridge not in links
    assert not executor.root.exists()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_namespaces_of_a_dead_session_are_swept_by_the_next_executor():
    from pod_executor import sweep_stale_pod_networks

    dead = "3ffffe00"  # pid 0x3ffffe: above any pid this machine hands out
    subprocess.run(["ip", "netns", "add", f"gpn{dead}-2"], check=True)
    subprocess.run(["ip", "link", "add", f"gpb{dead}", "type", "bridge"], check=True)
    sweep_stale_pod_networks()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert f"gpn{dead}-2" not in names and f"gpb{dead}" not in links
