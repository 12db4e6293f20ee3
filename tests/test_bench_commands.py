"""The benchmark's `vllm run-batch` command line is one vLLM's own parser accepts.

The long-tail bench gives run-batch the worker's engine arguments; a flag that run-batch does
not know (vLLM 0.32 has `--disable-log-stats` but no `--no-disable-log-stats`) makes it exit 2
and the comparison silently lose its third column, so the command is parsed here with the
very parser `vllm run-batch` builds.
"""

from __future__ import annotations

from pathlib import Path

from bench.longtail import run_batch_command
from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, InputSpec, OutputSpec
from dagster_gpuinfer.worker.loop.engine import engine_kwargs


def _parse(command: list[str]):
    from vllm.entrypoints.launchers.run_batch import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert command[1:3] == ["-m", "vllm.entrypoints.openai.run_batch"]
    return make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])


def test_run_batch_command_carries_the_worker_engine_arguments(tmp_path: Path) -> None:
    spec = InferenceSpec(
        model="/models/tiny",
        task="generate",
        engine=EngineArgs(max_model_len=64, max_num_seqs=32, seed=7),
        input=InputSpec(uri="in/{partition_key}.jsonl"),
        output=OutputSpec(root="out", asset_name="bench"),
    )
    kwargs = engine_kwargs(spec)
    assert kwargs["disable_log_stats"] is False
    args = _parse(run_batch_command(tmp_path / "in.jsonl", tmp_path / "out.jsonl", "/m", kwargs))
    assert args.model == "/m"
    assert args.input_file == str(tmp_path / "in.jsonl")
    assert args.max_model_len == 64
    assert args.max_num_seqs == 32
    assert args.disable_log_stats is False
    assert args.tensor_parallel_size == 1


def test_run_batch_command_turns_stats_off_when_the_engine_has_them_off(tmp_path: Path) -> None:
    command = run_batch_command(
        tmp_path / "in.jsonl",
        tmp_path / "out.jsonl",
        "/m",
        {"disable_log_stats": True, "enforce_eager": True, "enable_prefix_caching": False},
    )
    args = _parse(command)
    assert args.disable_log_stats is True
    assert args.enforce_eager is True
    assert args.enable_prefix_caching is False
