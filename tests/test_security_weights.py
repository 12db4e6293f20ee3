"""Weights load from safetensors unless a spec opts in to pickle.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

import os

import pytest
from security_support import worker_spec

from dagster_gpuinfer.spec import EngineArgs

# --------------------------------------------------------------------------- weights


def test_weights_load_from_safetensors_unless_the_spec_opts_in_to_pickle():
    assert EngineArgs().to_vllm_kwargs()["load_format"] == "safetensors"
    assert "allow_pickle_weights" not in EngineArgs().to_vllm_kwargs()
    for unsafe in ("auto", "pt", "npcache", "hf"):
        with pytest.raises(ValueError, match="pickle.*allow_pickle_weights=True"):
            EngineArgs(load_format=unsafe)
        assert (
            EngineArgs(load_format=unsafe, allow_pickle_weights=True).to_vllm_kwargs()[
                "load_format"
            ]
            == unsafe
        )
    with pytest.raises(ValueError, match="engine.load_format"):
        EngineArgs(extra={"load_format": "pt"})
    # The load format decides nothing about results: it stays out of the spec hash.
    spec = worker_spec()
    opted = spec.model_copy(
        update={"engine": EngineArgs(load_format="pt", allow_pickle_weights=True)}
    )
    assert opted.spec_hash() == spec.spec_hash()


def test_the_test_models_ship_safetensors(minilm_dir, tiny_llama_dir):
    for directory in (minilm_dir, tiny_llama_dir):
        files = os.listdir(directory)
        assert any(f.endswith(".safetensors") for f in files), files
        assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files), files
