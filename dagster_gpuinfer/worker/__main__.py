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

from pydantic import ValidationError

from dagster_gpuinfer.messages import (
    Fatal,
    PartitionCommitted,
    PartitionFailed,
    RunFinished,
    to_payload,
)
from dagster_gpuinfer.secrets import validation_problems
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import Manifest
from dagster_gpuinfer.worker import lifecycle
from dagster_gpuinfer.worker.errors import (
    Drained,
    EngineDied,
    SpecError,
    WorkerError,
    cap_message,
    engine_death_in,
)
from dagster_gpuinfer.worker.metrics import MeteredReporter, start_worker_metrics
from dagster_gpuinfer.worker.run.env_references import apply_env_references
from dagster_gpuinfer.worker.run.job import run_job


class MessageReporter:
    """Sends the worker's messages (`dagster_gpuinfer.messages`) to `emit` (Pipes custom
    messages, or stdout)."""

    def __init__(self, emit: Any) -> None:
        self.emit = emit

    def partition_committed(self, manifest: Manifest, *, computed: bool) -> None:
        self.emit(to_payload(PartitionCommitted(computed=computed, manifest=manifest)))

    def partition_failed(self, exc: WorkerError) -> None:
        self.emit(to_payload(PartitionFailed(**_error_fields(exc))))

    def run_finished(self, summary: dict[str, Any]) -> None:
        self.emit(to_payload(RunFinished.model_validate(summary)))

    def fatal(self, exc: WorkerError) -> None:
        self.emit(to_payload(Fatal(**_error_fields(exc))))


def _error_fields(exc: WorkerError) -> dict[str, Any]:
    return {
        "error_type": exc.error_type,
        "message": cap_message(str(exc)),
        "partition_key": exc.partition_key,
    }


def parse_spec(raw: Any) -> InferenceSpec:
    if raw is None:
        raise SpecError("the worker got no job spec: Pipes extras hold no 'spec'")
    try:
        return InferenceSpec.model_validate(raw)
    except ValidationError as exc:
        # Never `str(exc)`: it would echo a refused value, which may be a credential.
        problems = "; ".join(validation_problems(exc))
        raise SpecError(f"the job spec does not validate: {problems}") from None


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    lifecycle.install_signal_handlers()
    lifecycle.children_die_with_this_process()
    apply_env_references()
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
