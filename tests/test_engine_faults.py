"""Real engines, on purpose broken: a killed engine process, a SIGTERM mid-shard, hostile lines.

One OpenAI batch shard, its first lines a sample of hostile ones (the classes of issue 17,
other instances than its examples), the rest plain prompts. Run by the worker's own CLI:

1. the engine process is SIGKILL'd mid-shard: the worker exits non-zero within 60 s, naming
   it, and leaves no process behind; the hostile lines were committed (quarantined or
   answered) before, and never ended the worker;
2. the rerun resumes, is SIGTERM'd mid-shard: it exits within the grace with its message,
   having committed more chunks, and no engine process is left 10 s later;
3. (slow) the next rerun completes, every custom_id answered exactly once.

`make test` runs 1 and 2 (two engine starts); 3 is `slow`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import write_jsonl

from dagster_gpuinfer import InferenceSpec, storage
from dagster_gpuinfer.storage import read_chunk_markers
from dagster_gpuinfer.worker.lifecycle import EXIT_DRAINED, EXIT_ENGINE_DIED

ROWS = 900
CHUNK = 12
HOSTILE = [
    {"seed": 2**64 + 3},
    {"max_tokens": -(2**66)},
    {"temperature": 1e400},  # json.dumps writes Infinity
    {"n": 5000},
    {"n": 4, "temperature": 1.0, "logprobs": 20},
    {"structured_outputs": {"regex": "(a+)+b"}, "max_tokens": 6},
    {"structured_outputs": {"regex": r"\p{Lu}\p{Ll}+"}, "max_tokens": 4},
    {"structured_outputs": {"regex": "(?<=q)r"}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "schema": {
                    "type": "object",
                    "properties": {"k": {"type": "string", "pattern": "^(x+x+)+y$"}},
                }
            },
        },
        "max_tokens": 8,
    },
    {"logit_bias": {str(i): 0.5 for i in range(20000)}},
    {"stop": ["z" * 50] * 3000},
    {"tools": [{"type": "function"}]},
]


def _lines() -> list[object]:
    lines: list[object] = []
    for i, params in enumerate(HOSTILE):
        body = {"prompt": f"hostile {i}", **params}
        lines.append(
            json.dumps(
                {"custom_id": f"h{i}", "method": "POST", "url": "/v1/completions", "body": body}
            )
        )
    deep = "[" * 4000 + "]" * 4000
    lines.append(f'{{"custom_id": "deep", "url": "/v1/completions", "body": {{"prompt": {deep}}}}}')
    lines.append(b"\xff not utf-8")
    for i in range(ROWS):
        body = {"prompt": f"Question {i}: what is {i} plus {i}?", "max_tokens": 24}
        body["ignore_eos"] = True
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        )
    return lines


def _spec(root: Path, model: str) -> dict:
    return {
        "model": model,
        "task": "generate",
        "input": {"uri": str(root / "in" / "{partition_key}.jsonl"), "format": "openai_batch"},
        "output": {"root": str(root / "out"), "asset_name": "faults", "format": "openai_batch"},
        "engine": {"max_model_len": 256, "gpu_memory_utilization": 0.2, "enforce_eager": True},
        "sampling": {"max_tokens": 8},
        "partition_keys": ["p"],
        "chunk_size": CHUNK,
        "max_requests_in_flight": 24,
    }


@pytest.fixture(scope="module")
def shard(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("faults")
    write_jsonl(root / "in" / "p.jsonl", _lines())
    spec = _spec(root, tiny_llama_dir)
    (root / "spec.json").write_text(json.dumps(spec))
    where = storage.filesystem_for(str(root / "out" / "faults" / "p"))
    return {"root": root, "spec": spec, "where": where, "hash": InferenceSpec(**spec).spec_hash()}


def _start(shard) -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "GPUINFER_DRAIN_GRACE_SECONDS": "30",
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster_gpuinfer.worker",
            "--spec",
            str(shard["root"] / "spec.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _markers(shard) -> dict:
    fs, path = shard["where"]
    try:
        return read_chunk_markers(fs, path, shard["hash"])
    except OSError:
        return {}


def _wait_for_markers(shard, worker: subprocess.Popen, ready) -> dict:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        markers = _markers(shard)
        if ready(markers):
            return markers
        assert worker.poll() is None, worker.stdout.read()
        time.sleep(0.05)
    raise AssertionError("no chunk was committed in 600 s")


def _engine_processes(worker: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(worker.pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                found.append(child)
        except psutil.Error:
            pass
    return found


def _family(worker: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(worker.pid).children(recursive=True)
    except psutil.Error:
        return []


def _all_gone(processes: list[psutil.Process], seconds: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    return all(p.status() == psutil.STATUS_ZOMBIE for p in alive if p.is_running())


@pytest.mark.engine
def test_killed_engine_fails_the_worker_within_seconds_after_hostile_lines(shard):
    worker = _start(shard)
    try:
        markers = _wait_for_markers(shard, worker, lambda found: {0, 1} <= set(found))
        engines = _engine_processes(worker)
        assert engines, "no EngineCore process found under the worker"
        family = _family(worker)
        killed_at = time.monotonic()
        engines[0].send_signal(signal.SIGKILL)
        output, _ = worker.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        worker.kill()
    assert worker.returncode == EXIT_ENGINE_DIED, output
    assert f"pid {engines[0].pid}" in output and "is gone" in output
    assert _all_gone(family, 10), "a process of the worker outlived it"
    # The hostile lines (chunks 0 and 1) were committed: quarantined or answered, no crash.
    first = {i: m for i, m in _markers(shard).items() if i < 2}
    assert set(first) == {0, 1} and len(markers) < ROWS // CHUNK
    assert sum(m.rows_in for m in first.values()) == 2 * CHUNK
    assert sum(m.rows_errored for m in first.values()) >= 8


@pytest.mark.engine
def test_sigterm_mid_shard_drains_commits_and_leaves_no_engine(shard):
    before = len(_markers(shard))
    assert before >= 2, "runs after test_killed_engine_fails_the_worker_within_seconds..."
    worker = _start(shard)
    try:
        _wait_for_markers(shard, worker, lambda found: len(found) > before)
        family = _family(worker)
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=60)
        assert time.monotonic() - signalled < 30 + 5  # within the grace
    finally:
        worker.kill()
    assert worker.returncode == EXIT_DRAINED, output
    assert "SIGTERM: the worker stops admitting rows" in output
    assert "the worker stopped after SIGTERM" in output
    assert _all_gone(family, 10), "an engine process outlived the drained worker"
    after = _markers(shard)
    assert before < len(after) < ROWS // CHUNK + 2, "the drain must land mid-shard"
    assert not (shard["root"] / "out" / "faults" / "p" / "_SUCCESS").exists()


@pytest.mark.engine
@pytest.mark.slow
def test_rerun_after_kill_and_drain_answers_every_custom_id_exactly_once(shard):
    worker = _start(shard)
    output, _ = worker.communicate(timeout=900)
    assert worker.returncode == 0, output
    out = shard["root"] / "out" / "faults" / "p"
    manifest = storage.Manifest.model_validate_json((out / "_SUCCESS").read_text())
    answered = []
    for part in manifest.parts:
        answered += [
            json.loads(line)["custom_id"] for line in (out / part.name).read_text().splitlines()
        ]
    errors = (out / manifest.openai_errors.name).read_text().splitlines()
    answered += [json.loads(line)["custom_id"] for line in errors]
    expected = (
        [f"h{i}" for i in range(len(HOSTILE))] + ["deep", None] + [f"r{i}" for i in range(ROWS)]
    )
    assert sorted(answered, key=str) == sorted(expected, key=str)
    assert manifest.rows_in == len(expected) == manifest.rows_out + manifest.rows_errored
