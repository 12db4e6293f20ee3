"""Chunked prefill on vLLM's CPU build (worker/loop/cpu_seeds.py): off for sampling tasks unless
the pipeline decides; where it stays on, a row's seed is refused for that row only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dagster_gpuinfer.worker.loop.cpu_seeds import resolve_cpu_chunked_prefill, seeds_unsafe
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.tasks.params import SEED_REFUSED, ParameterError


def test_a_sampling_task_on_the_cpu_build_runs_without_chunked_prefill(caplog):
    with caplog.at_level("INFO", logger="dagster_gpuinfer.worker"):
        kwargs = resolve_cpu_chunked_prefill({"max_model_len": 256}, samples=True, on_cpu=True)
    assert kwargs == {"max_model_len": 256, "enable_chunked_prefill": False}
    assert "set engine enable_chunked_prefill to override" in caplog.text
    # a budget vLLM accepts without chunked prefill (at least max_model_len) keeps the default
    big = {"max_model_len": 256, "max_num_batched_tokens": 256}
    assert resolve_cpu_chunked_prefill(dict(big), samples=True, on_cpu=True) == {
        **big,
        "enable_chunked_prefill": False,
    }


@pytest.mark.parametrize(
    ("kwargs", "samples", "on_cpu"),
    [
        ({}, True, False),  # a GPU build: its generators rewind
        ({}, False, True),  # pooling tasks never sample
        ({"enable_chunked_prefill": True}, True, True),  # the pipeline's choice stands
        ({"enable_chunked_prefill": False}, True, True),
        # without chunked prefill vLLM refuses a budget under max_model_len (or unknown)
        ({"max_num_batched_tokens": 128, "max_model_len": 256}, True, True),
        ({"max_num_batched_tokens": 128}, True, True),
    ],
)
def test_everything_else_is_left_as_given(kwargs, samples, on_cpu):
    assert resolve_cpu_chunked_prefill(dict(kwargs), samples=samples, on_cpu=on_cpu) == kwargs


def _llm(chunked: bool) -> SimpleNamespace:
    scheduler = SimpleNamespace(enable_chunked_prefill=chunked)
    return SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler))
    )


@pytest.mark.parametrize(
    ("chunked", "on_cpu", "unsafe"),
    [(True, True, True), (False, True, False), (True, False, False), (False, False, False)],
)
def test_only_the_cpu_build_with_chunked_prefill_is_unsafe_for_seeds(chunked, on_cpu, unsafe):
    assert seeds_unsafe(_llm(chunked), on_cpu=on_cpu) is unsafe


def test_a_refused_seed_quarantines_its_row_and_names_the_fix():
    builder = RequestBuilder(task="generate", defaults={"max_tokens": 4}, refuse_seeds=True)
    with pytest.raises(ParameterError) as refused:
        builder.build({"seed": 3, "temperature": 1.0})
    assert refused.value.error_type == "unsupported_parameter"
    assert refused.value.key == "seed"
    assert SEED_REFUSED in str(refused.value)
    assert builder.build({"temperature": 1.0}).sampling.seed is None  # other rows: as before
    assert builder.build({"seed": None}).sampling.seed is None  # null is the default
    allowed = RequestBuilder(task="generate", defaults={"max_tokens": 4})
    assert allowed.build({"seed": 3}).sampling.seed == 3
