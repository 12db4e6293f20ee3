"""Multi-node tensor parallel vs one pod: `python -m bench.multinode` (root: namespaces).

The same generation partition through the real worker, timed by the worker's own
`inference_seconds` (model load excluded):

- **one pod, TP=2**: one worker process, vLLM's two ranks on cores 0 and 1
  (`VLLM_CPU_OMP_THREADS_BIND=0|1`), talking through shared memory;
- **two pods, TP=2**: the leader worker (rank 0, core 0) and a follower
  (`worker/follower.py`, rank 1, core 1), each in its own network namespace with its own
  address on a bridge (`bench/netns_nodes.py`), so the ranks' collectives go over TCP
  (gloo) as between two nodes.

Writes `bench/results/multinode.json` (rows/s of each, their ratio, how many greedy outputs
of the two runs are equal, the load average at start). On loopback the
"interconnect" is a veth pair through the kernel; between real nodes it is the NIC
(NCCL over TCP at 10-100 Gb/s, or RDMA/InfiniBand at 200-400 Gb/s per GPU), with far more
data per step (a real model's hidden size, 8 GPUs per node): TP across nodes pays an
all-reduce per layer over that link, which is why the usual shape is TP inside a node and
PP (or DP) across nodes.

    sudo .venv/bin/python -m bench.multinode --rows 256 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.netns_nodes import netns_nodes

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "multinode.json"


def _spec(model: str, root: Path, rows: int, max_tokens: int, nodes: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, InputSpec, OutputSpec

    shard = root / "in" / "p0.parquet"
    if not shard.exists():
        shard.parent.mkdir(parents=True, exist_ok=True)
        texts = [f"request {i}: summarise item {i * 13} of the catalogue" for i in range(rows)]
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "text": texts}), shard)
    spec = InferenceSpec(
        model=model,
        task="generate",
        engine=EngineArgs(gpu_memory_utilization=0.2, enforce_eager=True),
        sampling={"max_tokens": max_tokens, "min_tokens": max_tokens},
        input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
        output=OutputSpec(root=str(root / f"out-{nodes}"), asset_name="gen"),
        partition_keys=["p0"],
        tensor_parallel_size=2,
        nodes=nodes,
    )
    path = root / f"spec-{nodes}.json"
    path.write_text(spec.model_dump_json())
    return path


def _summary(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith("{") and '"type": "run"' in line:
            return json.loads(line)
    raise RuntimeError(f"the worker printed no run summary:\n{stdout[-2000:]}")


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
        **extra,
    }


def one_pod(spec: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "dagster_gpuinfer.worker", "--spec", str(spec)],
        env=_env(VLLM_CPU_OMP_THREADS_BIND="0|1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    return _summary(out.stdout)


def two_pods(spec: Path, model: str, port: int = 29517) -> dict[str, Any]:
    from dagster_gpuinfer.k8s.group import follower_engine_args
    from dagster_gpuinfer.spec import InferenceSpec

    engine = json.dumps(follower_engine_args(InferenceSpec.model_validate_json(spec.read_text())))
    with netns_nodes(2, subnet="10.231.9") as (leader, follower):
        common = {
            "GPUINFER_MASTER_ADDR": leader.address,
            "GPUINFER_MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "eth0",
        }
        follower_cmd = [sys.executable, "-m", "dagster_gpuinfer.worker.follower", "--model", model]
        follower_cmd += ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]
        follower_cmd += ["--engine-args-json", engine, "--probe-interval", "2"]
        f = subprocess.Popen(
            follower.command(follower_cmd),
            env=_env(**common, VLLM_CPU_OMP_THREADS_BIND="1", VLLM_HOST_IP=follower.address),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            out = subprocess.run(
                leader.command(
                    [sys.executable, "-m", "dagster_gpuinfer.worker", "--spec", str(spec)]
                ),
                env=_env(**common, VLLM_CPU_OMP_THREADS_BIND="0", VLLM_HOST_IP=leader.address),
                capture_output=True,
                text=True,
                timeout=900,
            )
            summary = _summary(out.stdout)
            started = time.monotonic()
            f.wait(timeout=120)
            summary["follower_exit_seconds_after_leader"] = round(time.monotonic() - started, 1)
            return summary
        finally:
            if f.poll() is None:
                os.killpg(f.pid, signal.SIGKILL)


def _texts(root: Path, nodes: int) -> dict[str, str]:
    """The committed partition's generated text by row id (one pod's or two pods' run)."""
    import pyarrow.parquet as pq

    texts: dict[str, str] = {}
    for part in sorted((root / f"out-{nodes}" / "gen" / "p0").glob("part-*.parquet")):
        table = pq.read_table(part, columns=["id", "text"])
        ids, text = table.column("id").to_pylist(), table.column("text").to_pylist()
        texts.update(zip(ids, text, strict=True))
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multinode")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from assets.models import make_tiny_llama

    load = [round(x, 2) for x in os.getloadavg()]

    with tempfile.TemporaryDirectory(prefix="gpuinfer-multinode-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        model = make_tiny_llama(root / "tiny-llama")
        single = one_pod(_spec(model, root, args.rows, args.max_tokens, nodes=1))
        multi = two_pods(_spec(model, root, args.rows, args.max_tokens, nodes=2), model)
        one_texts, two_texts = _texts(root, 1), _texts(root, 2)
    equal = sum(1 for k, v in two_texts.items() if one_texts.get(k) == v)
    rate = {
        name: args.rows / s["inference_seconds"] for name, s in (("one", single), ("two", multi))
    }
    result = {
        "command": "python -m bench.multinode " + " ".join(argv or sys.argv[1:]),
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "one_pod_tp2_rows_per_s": round(rate["one"], 2),
        "two_pods_tp2_rows_per_s": round(rate["two"], 2),
        "ratio_two_pods_over_one": round(rate["two"] / rate["one"], 3),
        "one_pod_inference_seconds": single["inference_seconds"],
        "two_pods_inference_seconds": multi["inference_seconds"],
        "follower_exit_seconds_after_leader": multi.get("follower_exit_seconds_after_leader"),
        "rows_committed": {"one_pod": len(one_texts), "two_pods": len(two_texts)},
        "greedy_rows_equal_two_pods_vs_one_pod": equal,
        "load_average_at_start": load,
        "machine": f"{os.cpu_count()} cores (shared), loopback veth between namespaces",
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
