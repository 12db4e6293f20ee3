"""A pool worker on a fake engine: the engine of `test_engine_loop.FakeEngine` (no vLLM) with
the pool surface (`bind`, `abort_in_flight`, `shutdown`, `load_seconds`), plus shards, specs
and jobs for it. Shards, chunk files, markers, the commit and the lease queue are real.

Run as a script it is a pool worker process on that fake engine (`python
tests/pool_worker_fakes.py QUEUE POOL WORKER_ID STEP_SECONDS IDLE_TTL LEASE_TTL`): with the
real signal handlers, so SIGTERM and SIGKILL tests hit a real process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_engine_loop import FakeEngine  # noqa: E402

from dagster_gpuinfer.pools import JobSubmission, WorkItem  # noqa: E402
from dagster_gpuinfer.spec import InferenceSpec  # noqa: E402
from dagster_gpuinfer.worker.errors import SpecError  # noqa: E402
from dagster_gpuinfer.worker.loop.engine import LOAD_LOG_ENV, same_engine  # noqa: E402

POOL = "pool-fake"


class FakePoolEngine(FakeEngine):
    """`FakeEngine` as a pool worker holds it: bound to a spec, rebound per lease; every
    build appends a line to `GPUINFER_MODEL_LOAD_LOG`, as the real engine does."""

    load_seconds = 0.05

    def __init__(self, spec: InferenceSpec, *, step_seconds: float = 0.0, **kwargs: Any) -> None:
        super().__init__(window=4, step_seconds=step_seconds, **kwargs)
        self.spec = spec
        self.binds: list[InferenceSpec] = []
        self.aborted = 0
        self.shutdowns = 0
        load_log = os.environ.get(LOAD_LOG_ENV)
        if load_log:
            with open(load_log, "a") as handle:
                handle.write(f"{os.getpid()}\t{spec.model}\n")

    def bind(self, spec: InferenceSpec) -> None:
        assert not self.pending, "bound with requests in flight"
        problem = same_engine(self.spec, spec)
        if problem is not None:
            raise SpecError(f"this pool worker's engine cannot serve the spec: {problem}")
        self.spec = spec
        self.binds.append(spec)

    def abort_in_flight(self) -> int:
        aborted = len(self.pending)
        self.pending.clear()
        self.aborted += aborted
        return aborted

    def shutdown(self) -> None:
        self.shutdowns += 1


def make_model(root: Path) -> str:
    """A local model folder (config.json only: the fake engine loads nothing)."""
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    return str(model)


def text(partition: int, row: int) -> str:
    return f"row {partition}{row:04d}"


def write_shards(root: Path, keys: list[str], rows: int) -> None:
    (root / "in").mkdir(parents=True, exist_ok=True)
    for p, key in enumerate(keys):
        table = pa.table(
            {
                "id": [f"{key}-{i}" for i in range(rows)],
                "text": [text(p + 1, i) for i in range(rows)],
            }
        )
        pq.write_table(table, root / "in" / f"{key}.parquet")


def spec_dict(root: Path, keys: list[str], *, asset: str = "emb", **changes: Any) -> dict:
    """An embed spec over `root/in/{key}.parquet`, chunks of 4, as the step would send it."""
    spec = {
        "model": make_model(root),
        "task": "embed",
        "input": {"uri": str(root / "in" / "{partition_key}.parquet")},
        "output": {"root": str(root / "out"), "asset_name": asset},
        "chunk_size": 4,
        "partition_keys": keys,
    }
    spec.update(changes)
    return InferenceSpec.model_validate(spec).model_dump(mode="json")


def submission(job_id: str, spec: dict, **kwargs: Any) -> JobSubmission:
    """The job a step submits for `spec` (contract section 2): one item per partition."""
    keys = spec["partition_keys"]
    return JobSubmission(
        job_id,
        POOL,
        [WorkItem(key, {"partition_key": key}) for key in keys],
        payload={"spec": spec, "run_id": job_id, "asset": spec["output"]["asset_name"]},
        **kwargs,
    )


def main(argv: list[str]) -> int:
    from dagster_gpuinfer.pools import open_lease_queue
    from dagster_gpuinfer.worker import lifecycle
    from dagster_gpuinfer.worker.pool.loop import PoolWorkerLoop

    location, pool, worker_id, step_seconds, idle_ttl, lease_ttl = argv
    lifecycle.install_signal_handlers()
    with open_lease_queue(location) as queue:
        return PoolWorkerLoop(
            queue,
            pool,
            worker_id=worker_id,
            idle_ttl_s=float(idle_ttl),
            lease_ttl_s=float(lease_ttl),
            poll_s=0.05,
            engine_builder=lambda spec, on_death: FakePoolEngine(
                spec, step_seconds=float(step_seconds)
            ),
        ).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
