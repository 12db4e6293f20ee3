"""The worker's life around its engines, without an engine: children die with the worker,
a dead engine process is noticed within seconds, SIGTERM drains (also as PID 1) within a
grace bound. The real-engine cases are in tests/test_engine_faults.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from types import ModuleType, SimpleNamespace

import psutil
import pytest

from dagster_gpuinfer.worker.lifecycle import EXIT_DRAINED, EngineWatch

SPAWNER = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from dagster_gpuinfer.worker import lifecycle

    def sleep():
        time.sleep(600)

    if __name__ == "__main__":
        lifecycle.children_die_with_this_process()
        ctx = multiprocessing.get_context(sys.argv[1])
        child = ctx.Process(target=sleep)
        child.start()
        print(child.pid, os.getpgid(0), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_children_die_when_the_worker_is_killed(tmp_path, method):
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    parent = subprocess.Popen(
        [sys.executable, str(script), method], stdout=subprocess.PIPE, text=True
    )
    try:
        child_pid, parent_group = map(int, parent.stdout.readline().split())
        if method == "spawn":  # a SIGTERM to the worker's group does not reach the engines
            deadline = time.monotonic() + 10
            while os.getpgid(child_pid) == parent_group and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.getpgid(child_pid) != parent_group
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(child_pid, 10), "the child outlived its killed parent"
    finally:
        parent.kill()


def test_a_dead_engine_process_is_reported_within_seconds_naming_it():
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reported: list[str] = []
    watch = EngineWatch([psutil.Process(engine.pid)], name="model 'm'", on_death=reported.append)
    watch.start()
    time.sleep(1.0)
    assert reported == []
    started = time.monotonic()
    engine.kill()
    while not reported and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert reported, "the death was not noticed"
    assert time.monotonic() - started < 5
    assert f"pid {engine.pid}" in reported[0] and "signal 9" in reported[0]
    assert "model 'm'" in reported[0]


DRAINER = textwrap.dedent(
    """
    import os, sys, time
    from dagster_gpuinfer.worker import lifecycle

    lifecycle.install_signal_handlers()
    print("ready", flush=True)
    while not lifecycle.draining():
        time.sleep(0.05)
    print("draining", flush=True)
    if sys.argv[1] == "finish":
        time.sleep(0.5)  # the chunks in flight finish and commit
        print("committed", flush=True)
        sys.exit(0)
    time.sleep(600)  # a drain that never ends: the grace bound stops it
    """
)


def _drainer(tmp_path, mode, *, pid1=False):
    script = tmp_path / "drainer.py"
    script.write_text(DRAINER)
    command = [sys.executable, str(script), mode]
    if pid1:
        command = ["unshare", "--pid", "--fork", "--kill-child", *command]
    env = {**os.environ, "GPUINFER_DRAIN_GRACE_SECONDS": "1.5"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stdout.readline().strip() == "ready"
    target = process.pid
    if pid1:  # the worker is PID 1 of its own namespace: signal it, not unshare
        (inner,) = psutil.Process(process.pid).children()
        target = inner.pid
    return process, target


def test_sigterm_stops_admitting_work_and_lets_the_drain_finish(tmp_path):
    process, target = _drainer(tmp_path, "finish")
    os.kill(target, signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0
    assert out.split() == ["draining", "committed"]
    assert "SIGTERM: the worker stops admitting rows" in err


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace needs root")
def test_a_drain_past_its_grace_exits_with_a_message_also_as_pid_1(tmp_path):
    process, target = _drainer(tmp_path, "hang", pid1=True)
    started = time.monotonic()
    os.kill(target, signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert "draining" in out  # PID 1 ran its handler: the signal was not ignored
    assert "the drain took more than 2 s" in err or "the drain took more than 1 s" in err
    assert process.returncode == EXIT_DRAINED


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_pods_grace_period_leaves_room_for_the_drain():
    from dagster_gpuinfer import InferenceSpec
    from dagster_gpuinfer.k8s.config import K8sLauncherConfig
    from dagster_gpuinfer.k8s.names import RunIdentity
    from dagster_gpuinfer.k8s.pod import build_worker_pod
    from dagster_gpuinfer.worker.lifecycle import DEFAULT_DRAIN_GRACE_SECONDS

    spec = InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "embed",
            "input": {"uri": "s3://b/in/{partition_key}.jsonl"},
            "output": {"root": "s3://b/out", "asset_name": "a"},
            "partition_keys": ["p"],
        }
    )
    pod = build_worker_pod(
        spec, K8sLauncherConfig(image="w:1"), RunIdentity(run_id="r", asset_key="a")
    )
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= DEFAULT_DRAIN_GRACE_SECONDS + 20


class _FakeEngineCore:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns += 1


class _LLMWithoutTokenizer:
    """A stand-in for `vllm.LLM` whose model loads, then whose tokenizer cannot be read."""

    built: list[_LLMWithoutTokenizer] = []
    error: BaseException = OSError("tokenizer.json is unreadable (fake)")

    def __init__(self, model: str, **kwargs) -> None:
        scheduler = SimpleNamespace(max_num_seqs=8)
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(
                scheduler_config=scheduler, cache_config=SimpleNamespace(block_size=16)
            ),
            model_config=SimpleNamespace(max_model_len=64),
            engine_core=_FakeEngineCore(),
        )
        self.built.append(self)

    def get_tokenizer(self):
        raise self.error


@pytest.mark.parametrize(
    "error",
    [OSError("tokenizer.json is unreadable (fake)"), KeyboardInterrupt()],
    ids=["error", "interrupt"],
)
def test_an_engine_whose_start_fails_after_the_model_loaded_is_shut_down(
    tmp_path, monkeypatch, error
):
    from dagster_gpuinfer import InferenceSpec
    from dagster_gpuinfer.worker.loop import engine as engine_module

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = InferenceSpec.model_validate(
        {
            "model": str(model),
            "task": "embed",
            "input": {"uri": str(tmp_path / "in" / "{partition_key}.parquet")},
            "output": {"root": str(tmp_path / "out"), "asset_name": "emb"},
        }
    )
    fake_vllm = ModuleType("vllm")
    fake_vllm.LLM = _LLMWithoutTokenizer
    fake_sampling = ModuleType("vllm.sampling_params")
    fake_sampling.RequestOutputKind = SimpleNamespace(FINAL_ONLY=2)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake_sampling)
    monkeypatch.setattr(engine_module, "built_engine_kwargs", lambda spec: {})
    monkeypatch.setattr(_LLMWithoutTokenizer, "built", [])
    monkeypatch.setattr(_LLMWithoutTokenizer, "error", error)

    with pytest.raises(type(error)):
        engine_module.InferenceEngine(spec)

    (llm,) = _LLMWithoutTokenizer.built
    assert llm.llm_engine.engine_core.shutdowns == 1


# --------------------------------------------------------------------------- EngineDeadError


class _EngineWhoseExecutorDies:
    """A stand-in for `InferenceEngine` whose engine process loses its executor worker
    (`VLLM::Worker` SIGKILL'd): `step` raises vLLM's own `EngineDeadError`, as the real engine
    client does when the engine core reports its worker gone."""

    load_seconds = 0.0
    max_model_len = 64
    max_num_seqs = 2
    window = 4
    requests = None
    shutdowns = 0

    def __init__(self, spec) -> None:
        self.tokenizer = _CharTokenizer()
        self.pending: list[str] = []

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def submit(self, request_id, token_ids, params=None) -> None:
        self.pending.append(request_id)

    def step(self):
        from vllm.v1.engine.exceptions import EngineDeadError

        raise EngineDeadError()

    def shutdown(self) -> None:
        type(self).shutdowns += 1


class _CharTokenizer:
    def __len__(self) -> int:
        return 128

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) % 128 for c in t] for t in texts]}


def _embed_spec(tmp_path, replicas: int = 1) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "in").mkdir()
    table = pa.table({"id": [f"r{i}" for i in range(6)], "text": [f"row {i}" for i in range(6)]})
    pq.write_table(table, tmp_path / "in" / "p0.parquet")
    return {
        "model": str(tmp_path / "model"),
        "task": "embed",
        "input": {"uri": str(tmp_path / "in" / "{partition_key}.parquet")},
        "output": {"root": str(tmp_path / "out"), "asset_name": "emb"},
        "chunk_size": 3,
        "partition_keys": ["p0"],
        "replicas": replicas,
    }


class _Recorder:
    def __init__(self) -> None:
        self.messages: list[dict] = []

    def __call__(self, message: dict) -> None:
        self.messages.append(message)


def test_an_engine_dead_error_from_the_engine_exits_75_naming_it(tmp_path, monkeypatch):
    from dagster_gpuinfer.worker import __main__ as worker_main
    from dagster_gpuinfer.worker import lifecycle
    from dagster_gpuinfer.worker.lifecycle import EXIT_ENGINE_DIED
    from dagster_gpuinfer.worker.run import job

    monkeypatch.setattr(job, "InferenceEngine", _EngineWhoseExecutorDies)
    monkeypatch.setattr(_EngineWhoseExecutorDies, "shutdowns", 0)
    told: list[str] = []
    monkeypatch.setattr(lifecycle, "_notify", [told.append])
    emitted = _Recorder()

    code = worker_main.run(_embed_spec(tmp_path), worker_main.MessageReporter(emitted))

    assert code == EXIT_ENGINE_DIED == 75
    assert [m["type"] for m in emitted.messages] == []  # no `fatal`: a retry can help
    assert told and "EngineDeadError" in told[0] and "exit code 75" in told[0], told
    assert "retry resumes from" in told[0]
    assert _EngineWhoseExecutorDies.shutdowns == 1


def test_a_replica_whose_engine_died_fails_the_worker_as_an_engine_death():
    from dagster_gpuinfer.worker.errors import EngineDied
    from dagster_gpuinfer.worker.lifecycle import EXIT_ENGINE_DIED
    from dagster_gpuinfer.worker.run.job import _ReplicaRun, next_replica_message
    from dagster_gpuinfer.worker.stage_messages import ReplicaCrashed

    class _Results:
        def get(self, timeout):
            import queue

            raise queue.Empty

    replica = SimpleNamespace(name="gpuinfer-replica-1", exitcode=EXIT_ENGINE_DIED)
    with pytest.raises(EngineDied, match="gpuinfer-replica-1"):
        next_replica_message(_Results(), [replica], ["p0"])
    run = _ReplicaRun(None, ["p0"], 2, None, None, None, None)
    crashed = ReplicaCrashed(0, "Traceback ...\nEngineDeadError: ...", engine_died=True)
    with pytest.raises(EngineDied, match="replica 0"):
        run.handle(crashed)
