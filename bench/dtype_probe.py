"""Raw `LLM.generate` of the tiny Llama in two dtypes, one engine each, on this CPU.

    python -m bench.dtype_probe                    # auto (what vLLM picks) vs float32
    python -m bench.dtype_probe --rows 400 --dtypes auto,float32,bfloat16

Why `worker/loop/cpu_dtype.py` exists: vLLM's CPU build loads a float32 checkpoint in bfloat16
under `dtype: auto`, which a CPU without AVX512_BF16/AMX emulates. Prints one JSON line per
dtype (engine build seconds, rows/s of one timed call after a warm-up, generated tokens) and
the CPU's bfloat16 support, so the figure comes with the machine it was taken on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def probe(model: str, dtype: str, rows: int, max_tokens: int) -> dict:
    """One engine in this process (run it in a fresh one per dtype)."""
    from vllm import LLM, SamplingParams

    from bench.workloads import generate_texts

    texts = generate_texts(rows)
    started = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=256,
        kv_cache_memory_bytes=512 << 20,
        enforce_eager=True,
    )
    build = time.perf_counter() - started
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(texts[:16], sampling, use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(texts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {
        "dtype": dtype,
        "loaded_as": str(llm.llm_engine.model_config.dtype),
        "build_seconds": round(build, 1),
        "rows_per_s": round(len(outputs) / seconds, 1),
        "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="auto,float32")
    parser.add_argument("--model", help="default: the tiny Llama, built in a temporary folder")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: one dtype
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(probe(args.model, args.one, args.rows, args.max_tokens)), flush=True)
        return 0
    from dagster_gpuinfer.worker.loop.cpu_dtype import native_bf16

    with tempfile.TemporaryDirectory(prefix="dtype-probe-") as scratch:
        model = args.model
        if model is None:
            from assets.models import make_tiny_llama

            model = make_tiny_llama(Path(scratch) / "tiny-llama")
        print(json.dumps({"native_bf16": native_bf16()}))
        for dtype in args.dtypes.split(","):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.dtype_probe",
                    "--one",
                    dtype,
                    "--model",
                    model,
                    "--rows",
                    str(args.rows),
                    "--max-tokens",
                    str(args.max_tokens),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines and done.returncode == 0 else done.stderr[-2000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
