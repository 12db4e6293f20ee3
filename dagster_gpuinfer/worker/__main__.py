"""Entry point: `python -m dagster_gpuinfer.worker`.

Under Dagster (local subprocess or Kubernetes pod) the job spec arrives in Dagster Pipes
extras (`spec`), and progress goes back as Pipes messages (the models in
`dagster_gpuinfer.messages`):

- `{"type": "partition", "computed": bool, "manifest": {...}}` for each committed partition;
- `{"type": "partition_failed", "error_type", "message", "partition_key"}` for each shard that
  cannot be processed (missing, unreadable, missing a column); the other partitions go on;
- `{"type": "run", ...}` once, with the model loads and timings of the run, and its
  `telemetry` (GPU utilization, engine saturation: worker/telemetry.py);
- `{"type": "fatal", "error_type", "message", "partition_key"}` when the spec cannot run
  (model directory, arguments). The process then exits `lifecycle.EXIT_SPEC_REFUSED` (78,
  EX_CONFIG; a refused job never reads as succeeded), and the control plane raises a
  non-retryable Dagster `Failure`. Any other non-zero exit is a crash, which Dagster's retry
  policy may retry.

Without Pipes, `python -m dagster_gpuinfer.worker --spec spec.json` runs the same job and
prints the same messages as JSON lines (for debugging a spec by hand).

`python -m dagster_gpuinfer.worker --pool POOL_KEY [--queue LOCATION] [--worker-id ID]
[--idle-ttl SECONDS] [--lease-ttl SECONDS] [--poll SECONDS]` runs a pool worker instead
(`worker/pool/`): it serves the pool's leases from the lease queue (`--queue`, else the
`GPUINFER_LEASE_QUEUE` environment variable: a PostgreSQL URL holds a password, so pods take
it from a Secret) with one warm engine, and exits 0 after `--idle-ttl` seconds without a
lease, 143 after a SIGTERM (the lease released), 75 when its engine died (the lease failed).

Exit codes besides 0: `lifecycle.EXIT_DRAINED` (143) after a SIGTERM drain (the chunks in
flight were committed; the Pipes log says so), `lifecycle.EXIT_ENGINE_DIED` (75) when an
engine process died or vLLM reported its engine dead (`EngineDeadError`, e.g. after its
executor worker `VLLM::Worker` was killed; the Pipes log names it); both are retryable,
and a retry resumes from the committed chunks. Engine processes never outlive the worker
(`worker/lifecycle.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from dagster_gpuinfer.pools import QUEUE_ENV
from dagster_gpuinfer.worker import lifecycle
from dagster_gpuinfer.worker.errors import (
    Drained,
    EngineDied,
    WorkerError,
    cap_message,
    engine_death_in,
)
from dagster_gpuinfer.worker.metrics import MeteredReporter, start_worker_metrics
from dagster_gpuinfer.worker.pool.loop import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_POLL_S,
    run_pool_worker,
)
from dagster_gpuinfer.worker.run.env_references import apply_env_references
from dagster_gpuinfer.worker.run.job import run_job
from dagster_gpuinfer.worker.run.reporting import MessageReporter, parse_spec


def run(
    raw_spec: Any, reporter: MessageReporter, *, run_id: str = "", retry_number: int = 0
) -> int:
    """Run the job; returns the exit code: 0, `lifecycle.EXIT_SPEC_REFUSED` after a `fatal`
    message, `lifecycle.EXIT_DRAINED` after SIGTERM, or
    `lifecycle.EXIT_ENGINE_DIED` when an engine died under it (vLLM's `EngineDeadError`,
    e.g. its executor worker `VLLM::Worker` was killed)."""
    metrics = None
    try:
        spec = parse_spec(raw_spec)
        metrics = start_worker_metrics(
            asset=spec.output.asset_name, run_id=run_id or "local", retry_number=retry_number
        )
        run_job(spec, MeteredReporter(reporter, metrics))
    except WorkerError as exc:
        logging.getLogger("dagster_gpuinfer.worker").error("%s", exc)
        reporter.fatal(exc)
        return lifecycle.EXIT_SPEC_REFUSED
    except Drained as exc:
        logging.getLogger("dagster_gpuinfer.worker").warning("%s", exc)
        lifecycle.tell(str(exc))
        return lifecycle.EXIT_DRAINED
    except Exception as exc:
        death = engine_death_in(exc)
        if death is None:
            raise  # a crash: exit 1 with its traceback, retryable
        return lifecycle.report_engine_death(_engine_death(death))
    finally:
        if metrics is not None:
            metrics.close()  # the last push: a finished worker cannot be scraped
    return 0


def _engine_death(death: BaseException) -> str:
    """What died, for the message: the engine death's type and first line."""
    first = str(death).splitlines()[0] if str(death) else "no message"
    if isinstance(death, EngineDied):
        return cap_message(first, 600)
    return (
        f"the vLLM engine of this worker died ({type(death).__name__}: {cap_message(first, 300)})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dagster_gpuinfer.worker")
    parser.add_argument("--spec", help="a job spec JSON file, to run without Dagster Pipes")
    _pool_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    lifecycle.install_signal_handlers()
    lifecycle.children_die_with_this_process()
    apply_env_references()
    if args.pool:
        return run_pool_worker(
            args.pool,
            location=args.queue,
            worker_id=args.worker_id,
            idle_ttl_s=args.idle_ttl,
            lease_ttl_s=args.lease_ttl,
            poll_s=args.poll,
        )
    if args.spec:
        with open(args.spec) as handle:
            raw = json.load(handle)
        return run(raw, MessageReporter(lambda message: print(json.dumps(message), flush=True)))
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        lifecycle.on_notice(pipes.log.warning)
        return run(
            pipes.extras.get("spec"),
            MessageReporter(pipes.report_custom_message),
            run_id=pipes.run_id,
            retry_number=pipes.retry_number,
        )


def _pool_arguments(parser: argparse.ArgumentParser) -> None:
    pool = parser.add_argument_group("pool worker (instead of one run's job)")
    pool.add_argument("--pool", metavar="POOL_KEY", help="serve this pool's leases")
    pool.add_argument(
        "--queue",
        metavar="LOCATION",
        help=f"the lease queue: a SQLite file or a postgresql:// URL (default: ${QUEUE_ENV})",
    )
    pool.add_argument("--worker-id", help="this worker's id in the queue (default: host-pid)")
    pool.add_argument(
        "--idle-ttl",
        type=float,
        default=DEFAULT_IDLE_TTL_S,
        metavar="SECONDS",
        help="exit 0 after this long without a lease",
    )
    pool.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_LEASE_TTL_S,
        metavar="SECONDS",
        help="each lease's TTL (heartbeats every third of it)",
    )
    pool.add_argument(
        "--poll",
        type=float,
        default=DEFAULT_POLL_S,
        metavar="SECONDS",
        help="seconds between polls for a lease while idle",
    )


def exit_now(code: int, *, grace_seconds: float = 5.0) -> None:
    """Leave without the interpreter's teardown, once every message is out.

    After the job, the Pipes messages are written and the engine was shut down; what is
    left is torch's and vLLM's atexit work and the garbage collection of a large heap,
    seconds per run that every partition of a small-partition backfill pays. Children that
    are still alive (an engine process that did not stop) are terminated first, so nothing
    outlives the worker and holds a GPU. Only for `python -m`: `main()` itself returns.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # The resource tracker stays: it unlinks leaked shared memory when it sees us exit.
    lifecycle.kill_children(grace_seconds)
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
