"""Seeded sampling on vLLM's CPU build, through a real Dagster run.

vLLM's model runner rewinds a seeded request's random generator when it drops the token
sampled for a prompt that is only partly prefilled (chunked prefill), with
`Generator.set_offset`, which only CUDA generators have: on the CPU build that raises
`RuntimeError: CPU Generator does not use offset` in the engine and the whole engine dies
(every row in flight with it). The worker therefore runs sampling tasks on the CPU build
without chunked prefill (`worker/cpu_build.py`); these rows are long enough that the first
step's token budget ends inside one of them, which is what used to end the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster as dg
import pytest
from support import cpu_resource, failure_message, materialize_partitions, write_parquet

from dagster_gpuinfer import InputSpec, OutputSpec, inference_assets, read_partition
from dagster_gpuinfer.storage import read_errors

pytestmark = pytest.mark.engine

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS = "river stone cloud maple lantern harbor meadow copper violet thunder".split()


def long_prompts(rows: int, words: int) -> list[str]:
    """Distinct from their first word (no prefix-cache hits), `words` words each."""
    return [
        " ".join([f"row{i}"] + [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)])
        for i in range(rows)
    ]


def seeded_pipeline(tmp_path: Path, model: str, params: list[str | None], **overrides):
    """40 rows of ~200 tokens (8,000 prompt tokens against the CPU build's 4,096 a step: with
    chunked prefill the first step ends inside a row's prompt), each with its `params`."""
    prompts = long_prompts(len(params), 190)
    ids = [f"r{i:02d}" for i in range(len(prompts))]
    write_parquet(tmp_path / "in" / "p0.parquet", {"id": ids, "prompt": prompts, "params": params})
    options = dict(
        name="seeded",
        model=model,
        task="generate",
        input=InputSpec(
            uri=str(tmp_path / "in" / "{partition_key}.parquet"),
            id_column="id",
            text_column="prompt",
            params_column="params",
        ),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["p0"]),
        engine={"max_model_len": 256},
        sampling={"temperature": 1.0, "max_tokens": 6, "extra": {"ignore_eos": True}},
        chunk_size=40,
    )
    return inference_assets(**{**options, **overrides}), ids, prompts


def test_seeded_rows_longer_than_a_steps_budget_keep_the_worker_alive(tmp_path, tiny_llama_dir):
    seeds = [1000 + i for i in range(40)]
    pipeline, ids, prompts = seeded_pipeline(
        tmp_path, tiny_llama_dir, [json.dumps({"seed": seed}) for seed in seeds]
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p0"], resource=cpu_resource(), instance=instance, raise_on_error=False
        )
        assert result.success, failure_message(result)
    table = read_partition(OutputSpec(**pipeline.spec["output"]), "p0")
    assert table.num_rows == len(prompts)
    ours = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True))
    # The same seeds through raw vLLM, rows in reverse order, in batches of one: a seeded
    # row's text depends on its prompt and seed only.
    raw = raw_seeded_texts(tmp_path, tiny_llama_dir, prompts[::-1], seeds[::-1])
    assert [ours[i] for i in ids] == raw[::-1]
    assert len(set(raw)) > 1


def raw_seeded_texts(tmp_path: Path, model: str, prompts: list[str], seeds: list[int]) -> list[str]:
    script = textwrap.dedent(
        f"""
        import json, sys
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, InputSpec, OutputSpec
            from dagster_gpuinfer.worker.loop.engine import built_engine_kwargs
            spec = InferenceSpec(model={model!r}, task="generate",
                engine=EngineArgs(max_model_len=256, gpu_memory_utilization=0.2,
                                  enforce_eager=True),
                input=InputSpec(uri="unused/{{partition_key}}.parquet"),
                output=OutputSpec(root="unused", asset_name="raw"))
            llm = LLM(model={model!r}, **built_engine_kwargs(spec))
            prompts, seeds = json.load(open(sys.argv[1]))
            params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True)
                      for s in seeds]
            out = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
            json.dump([o.outputs[0].text for o in out], open(sys.argv[2], "w"))
            llm.llm_engine.engine_core.shutdown()
        """
    )
    (tmp_path / "raw.py").write_text(script)
    (tmp_path / "raw-in.json").write_text(json.dumps([prompts, seeds]))
    done = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "raw.py"),
            str(tmp_path / "raw-in.json"),
            str(tmp_path / "raw.json"),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "raw.json").read_text())


# Chunked prefill kept on by the pipeline; rows 3, 13, 23 and 33 carry a seed.
CHUNKED = {"max_model_len": 256, "extra": {"enable_chunked_prefill": True}}
SOME_SEEDED = [json.dumps({"seed": i}) if i % 10 == 3 else None for i in range(40)]


def test_with_chunked_prefill_kept_on_seeded_rows_are_refused_not_fatal(tmp_path, tiny_llama_dir):
    pipeline, ids, _ = seeded_pipeline(
        tmp_path, tiny_llama_dir, SOME_SEEDED, engine=CHUNKED, max_error_rate=0.5
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p0"], resource=cpu_resource(), instance=instance, raise_on_error=False
        )
        assert result.success, failure_message(result)
    output = OutputSpec(**pipeline.spec["output"])
    produced = read_partition(output, "p0").column("id").to_pylist()
    errors = read_errors(output, "p0").to_pylist()
    seeded = [ids[i] for i in range(len(ids)) if i % 10 == 3]
    assert sorted(e["id"] for e in errors) == seeded
    assert {e["error_type"] for e in errors} == {"unsupported_parameter"}
    assert all(
        "CPU build" in e["message"] and "enable_chunked_prefill" in e["message"] for e in errors
    )
    assert sorted(produced) == sorted(set(ids) - set(seeded))


def test_a_pipeline_seed_with_chunked_prefill_kept_on_fails_before_any_row(
    tmp_path, tiny_llama_dir
):
    pipeline, _, _ = seeded_pipeline(
        tmp_path,
        tiny_llama_dir,
        SOME_SEEDED,
        engine=CHUNKED,
        sampling={"temperature": 1.0, "max_tokens": 4, "seed": 7},
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p0"], resource=cpu_resource(), instance=instance, raise_on_error=False
        )
    assert not result.success
    message = failure_message(result)
    assert "sampling.seed is 7" in message and "enable_chunked_prefill=False" in message
    assert not list((tmp_path / "out").rglob("*.parquet"))  # no row was read, none written
