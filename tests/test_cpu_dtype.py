"""dtype auto on vLLM's CPU build: a float32 checkpoint stays float32 on a CPU that would
emulate the half precision vLLM picks (worker/loop/cpu_dtype.py); nothing else changes."""

from __future__ import annotations

import json

import pytest

from dagster_gpuinfer.worker.loop.cpu_dtype import checkpoint_dtype, resolve_cpu_dtype


def _checkpoint(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


def test_a_float32_checkpoint_on_a_cpu_without_bf16_loads_as_float32(tmp_path, caplog):
    model = _checkpoint(tmp_path, dtype="float32")
    with caplog.at_level("INFO", logger="dagster_gpuinfer.worker"):
        kwargs = resolve_cpu_dtype({"max_model_len": 256}, model, on_cpu=True, native=False)
    assert kwargs == {"max_model_len": 256, "dtype": "float32"}
    assert "no native bfloat16" in caplog.text and "set engine dtype to override" in caplog.text
    assert resolve_cpu_dtype({"dtype": "auto"}, model, on_cpu=True, native=False)["dtype"] == (
        "float32"
    )


@pytest.mark.parametrize(
    ("config", "kwargs", "on_cpu", "native"),
    [
        ({"dtype": "float32"}, {}, True, True),  # native bf16: vLLM's choice is fast
        ({"dtype": "float32"}, {}, False, False),  # a GPU build: never touched
        ({"dtype": "bfloat16"}, {}, True, False),  # float32 would double its memory
        ({"torch_dtype": "float16"}, {}, True, False),
        ({"dtype": "float32"}, {"dtype": "bfloat16"}, True, False),  # explicit dtype wins
        ({}, {}, True, False),  # the checkpoint names no dtype
    ],
)
def test_everything_else_is_left_as_vllm_loads_it(tmp_path, config, kwargs, on_cpu, native):
    model = _checkpoint(tmp_path, **config)
    assert resolve_cpu_dtype(dict(kwargs), model, on_cpu=on_cpu, native=native) == kwargs


def test_checkpoint_dtype_reads_local_configs_only(tmp_path):
    assert checkpoint_dtype(_checkpoint(tmp_path, torch_dtype="float32")) == "float32"
    assert checkpoint_dtype(f"file://{tmp_path}") == "float32"
    assert checkpoint_dtype("meta-llama/Llama-3.1-8B") is None  # a hub id: not read
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(str(tmp_path)) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert checkpoint_dtype(str(tmp_path)) is None


def test_the_leader_and_its_followers_resolve_one_dtype(tmp_path, monkeypatch):
    """A follower builds its part of the engine from the leader's arguments and resolves
    them the same way, so a group never mixes dtypes."""
    import argparse

    from dagster_gpuinfer.worker import follower
    from dagster_gpuinfer.worker.loop import cpu_dtype

    monkeypatch.setattr(cpu_dtype, "native_bf16", lambda: False)
    model = _checkpoint(tmp_path, dtype="float32")
    args = argparse.Namespace(
        model=model,
        engine_args_json=json.dumps({"max_model_len": 256}),
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        nnodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    command = follower.headless_command(args)
    assert command[command.index("--dtype") + 1] == "float32"
