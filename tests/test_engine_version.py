"""A spec may pin the engine (`vllm_version`): a worker whose vLLM does not match refuses
before it loads anything, naming both; the versions a partition was computed with are in its
manifest and metadata."""

from __future__ import annotations

import pytest

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.worker.errors import SpecError
from dagster_gpuinfer.worker.run.engine_version import (
    VLLM_DISTRIBUTIONS,
    check_engine_version,
    engine_versions,
    installed_version,
)
from dagster_gpuinfer.worker.run.job import run_job

INSTALLED = installed_version(*VLLM_DISTRIBUTIONS)


def _spec(tmp_path, pin: str | None) -> InferenceSpec:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return InferenceSpec.model_validate(
        {
            "model": str(model),
            "task": "embed",
            "input": {"uri": str(tmp_path / "{partition_key}.jsonl")},
            "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
            "partition_keys": ["p"],
            "vllm_version": pin,
        }
    )


def test_a_pin_is_a_version_or_a_specifier_and_nothing_else(tmp_path):
    assert _spec(tmp_path, "0.32.0").vllm_version == "0.32.0"
    assert _spec(tmp_path, ">=0.32,<0.33").vllm_version == ">=0.32,<0.33"
    with pytest.raises(ValueError, match="neither a version"):
        _spec(tmp_path, "latest please")


def test_a_pin_changes_the_spec_hash_only_when_set(tmp_path):
    unpinned = _spec(tmp_path, None)
    assert "vllm_version" not in unpinned._results_payload()  # earlier hashes stay valid
    assert _spec(tmp_path, "0.32.0").spec_hash() != unpinned.spec_hash()
    assert _spec(tmp_path, "0.32.0").code_version() != unpinned.code_version()


@pytest.mark.skipif(INSTALLED is None, reason="needs the worker extra (vLLM's CPU build)")
def test_the_installed_engine_meets_its_own_version_and_a_range_around_it(tmp_path):
    major, minor = INSTALLED.split(".")[:2]
    check_engine_version(_spec(tmp_path, INSTALLED.split("+")[0]))
    check_engine_version(_spec(tmp_path, f">={major}.{minor},<{major}.{int(minor) + 1}"))
    check_engine_version(_spec(tmp_path, None))


@pytest.mark.skipif(INSTALLED is None, reason="needs the worker extra (vLLM's CPU build)")
def test_a_worker_whose_vllm_differs_from_the_pin_refuses_before_loading_weights(
    tmp_path, monkeypatch
):
    from dagster_gpuinfer.worker.run import job

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built for a spec this worker cannot run")

    monkeypatch.setattr(job, "InferenceEngine", no_engine)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "text": "x"}\n')
    with pytest.raises(SpecError) as refused:
        run_job(_spec(tmp_path, "==0.1.0"), reporter=None)  # type: ignore[arg-type]
    assert "vllm_version='==0.1.0'" in str(refused.value)
    assert f"runs vLLM {INSTALLED}" in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(INSTALLED is None, reason="needs the worker extra (vLLM's CPU build)")
def test_the_engine_versions_are_read_without_importing_vllm():
    import subprocess
    import sys

    code = (
        "import sys; from dagster_gpuinfer.worker.run.engine_version import engine_versions; "
        "print(engine_versions()['vllm']); print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [INSTALLED, "False"]
    assert engine_versions()["torch"] is not None
