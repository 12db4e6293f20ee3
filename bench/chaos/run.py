"""One chaos backfill and its baseline: the backfill daemon plans runs of the code location
(bench/chaos/defs.py), the run queue starts them, their steps launch worker pods on the pod
executor; the injector carries out the seeded schedule meanwhile. Then every partition is
checked against its inputs, straight from S3 (not through the proxy).
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import psutil
import pyarrow.parquet as pq

from bench.chaos import cluster as chaos_cluster
from bench.chaos import daemon as chaos_daemon
from bench.chaos import store_faults
from bench.chaos.faults import Fault, Injector
from bench.chaos.pool_faults import PoolChaos, pool_facts

ASSET = "doc_embeddings"
TERMINAL_RUN = {"SUCCESS", "FAILURE", "CANCELED"}


@dataclass
class Phase:
    label: str
    wall_s: float = 0.0
    backfill_status: str = ""
    runs: int = 0
    runs_failed: int = 0
    run_retries: int = 0
    step_retries: int = 0
    pods: int = 0
    step_down_pods: int = 0
    committed: int = 0
    asked: int = 0
    rows_in: int = 0
    rows_out: int = 0
    rows_errored: int = 0
    lost: int = 0
    duplicated: int = 0
    unexpected: int = 0
    problems: list[str] = field(default_factory=list)
    injected: list[Any] = field(default_factory=list)
    skipped: list[Fault] = field(default_factory=list)
    proxy_hits: dict[str, int] = field(default_factory=dict)
    daemon_errors: list[str] = field(default_factory=list)
    leftover_processes: list[str] = field(default_factory=list)
    batches: dict[str, Any] = field(default_factory=dict)  # store_faults.BatchApi.tally
    extra: dict[str, str] = field(default_factory=dict)  # more summary rows (pool mode)


def backfill(found: Any, label: str, keys: list[str], faults: list[Fault], options: Any) -> Phase:
    """Run the backfill of `keys` under `faults` (none for the baseline) and check it."""
    prefix = f"{label}"
    setup = chaos_cluster.Setup(
        executor=found.executor,
        s3_endpoint=found.proxy.endpoint,
        model=f"/models/{Path(options.model_dir).name}",
        model_cache=str(Path(options.model_dir).parent),
        input_root=f"s3://{found.bucket}/inputs",
        output_root=f"s3://{found.bucket}/{prefix}",
        partition_keys=keys,
        per_run=options.per_run,
        chunk_size=options.chunk_size,
        pools=getattr(options, "pools", None),
    )
    chaos_cluster.use(setup)
    targets = {ASSET: keys, **(setup.pools.targets() if setup.pools else {})}
    phase = Phase(label, asked=sum(len(k) for k in targets.values()))
    pods_before = len(found.executor.created)
    hits_before = Counter(found.proxy.injected)
    with (
        store_faults.phase_stores(found, label, options, setup) as stores,
        tempfile.TemporaryDirectory(prefix=f"chaos-{label}-") as home,
    ):
        overrides = chaos_daemon.instance_overrides(options.concurrent_runs)
        overrides.update(stores.instance_overrides())  # the instance on PostgreSQL
        with dg.instance_for_test(overrides=overrides, temp_dir=home) as instance:
            daemon = chaos_daemon.Daemon(instance)
            injector = Injector(faults, found.executor, found.proxy, daemon, options.seed)
            injector.stores = stores
            injector.pools = pool_chaos(found, prefix, setup.pools)
            if setup.pools:  # a pool kind waits for its pipeline's run, which may come last
                injector.give_up_s = options.timeout_s
            submitted_at = time.time()
            try:
                stores.start_api(home)
                begun = time.monotonic()
                backfill_id = submit_backfill(instance, daemon, targets)
                daemon.start()
                injector.run(begun)
                runs = -(-len(keys) // options.per_run)
                queued = lambda: len(_backfill_runs(instance, backfill_id)) >= runs  # noqa: E731
                stores.submit_batches(queued, options.batches, options.batch_lines)
                wait_for_backfill(instance, backfill_id, options.timeout_s)
                phase.batches = stores.tally(options.timeout_s)
                phase.wall_s = time.monotonic() - begun
            finally:
                injector.stop()
                stores.close()
                daemon.close()
                join_runs(options.timeout_s)
            tally_runs(instance, backfill_id, phase)
            phase.daemon_errors = daemon.errors
            phase.problems += stores.failures
    pods = found.executor.created[pods_before:]
    phase.pods = len(pods)
    phase.step_down_pods = sum(1 for p in pods if _label(p, "/launch") == "1")
    phase.injected, phase.skipped = injector.done, injector.skipped
    phase.proxy_hits = dict(Counter(found.proxy.injected) - hits_before)
    for asset, asset_keys in targets.items():
        verify(found, prefix, asset_keys, phase, asset)
    phase.leftover_processes = leftovers(found.executor)
    if setup.pools is not None:
        phase.extra = pool_facts(setup.pools, submitted_at)
    return phase


def pool_chaos(found: Any, prefix: str, pools: Any) -> Any:
    """The injector's hand for the pool kinds (`--mode pools`), else None."""
    if pools is None:
        return None
    return PoolChaos(pools, found.client, found.bucket, prefix)


def _label(pod: Any, suffix: str) -> str | None:
    return next((v for k, v in pod.labels.items() if k.endswith(suffix)), None)


def submit_backfill(instance: Any, daemon: Any, targets: dict[str, list[str]]) -> str:
    """The UI's launchPartitionBackfill mutation, over the daemon's code location: the
    partitions of each asset in `targets` (asset name -> partition keys)."""
    from dagster._core.test_utils import (
        InProcessTestWorkspaceLoadTarget,
        create_test_daemon_workspace_context,
    )
    from dagster_graphql.client.query import LAUNCH_PARTITION_BACKFILL_MUTATION
    from dagster_graphql.test.utils import execute_dagster_graphql

    load = InProcessTestWorkspaceLoadTarget(daemon._origin())  # noqa: SLF001
    with create_test_daemon_workspace_context(load, instance) as workspace:
        result = execute_dagster_graphql(
            workspace.create_request_context(),
            LAUNCH_PARTITION_BACKFILL_MUTATION,
            variables={"backfillParams": backfill_params(targets)},
        )
    launched = result.data["launchPartitionBackfill"]
    if launched["__typename"] != "LaunchBackfillSuccess":
        raise RuntimeError(f"the backfill was refused: {launched}")
    return launched["backfillId"]


def backfill_params(targets: dict[str, list[str]]) -> dict[str, Any]:
    """One asset: its partition names, as the UI sends them; several (pool mode): each
    asset's partitions (`partitionsByAssets`, one range: the keys are in their order)."""
    if len(targets) == 1:
        [(asset, keys)] = targets.items()
        return {"partitionNames": keys, "assetSelection": [{"path": [asset]}]}
    return {
        "partitionsByAssets": [
            {
                "assetKey": {"path": [asset]},
                "partitions": {"range": {"start": keys[0], "end": keys[-1]}},
            }
            for asset, keys in targets.items()
        ]
    }


def _backfill_runs(instance: Any, backfill_id: str) -> list[Any]:
    from dagster._core.storage.dagster_run import RunsFilter
    from dagster._core.storage.tags import BACKFILL_ID_TAG

    return instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: backfill_id}))


def wait_for_backfill(instance: Any, backfill_id: str, timeout_s: float) -> None:
    """Until the backfill is no longer requested and none of its runs is queued, running or
    about to be retried by the daemon."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = instance.get_backfill(backfill_id).status.value
            runs = _backfill_runs(instance, backfill_id)
        except store_faults.STORE_DOWN:  # the instance's server restarts: ask again
            time.sleep(2)
            continue
        busy = [r for r in runs if r.status.value not in TERMINAL_RUN]
        retrying = [r for r in runs if r.tags.get("dagster/will_retry") == "true"]
        retried = {r.tags.get("dagster/parent_run_id") for r in runs}
        pending = [r for r in retrying if r.run_id not in retried]
        if status != "REQUESTED" and not busy and not pending:
            return
        time.sleep(2)
    raise TimeoutError(f"backfill {backfill_id} not finished after {timeout_s:.0f} s")


def join_runs(timeout_s: float) -> None:
    for thread in list(chaos_daemon.RUN_THREADS):
        thread.join(timeout_s)
    chaos_daemon.RUN_THREADS.clear()


def tally_runs(instance: Any, backfill_id: str, phase: Phase) -> None:
    from dagster._core.events import DagsterEventType

    runs = _backfill_runs(instance, backfill_id)
    phase.backfill_status = instance.get_backfill(backfill_id).status.value
    phase.runs = len(runs)
    phase.runs_failed = sum(1 for r in runs if r.status.value != "SUCCESS")
    phase.run_retries = sum(1 for r in runs if r.tags.get("dagster/parent_run_id"))
    for run in runs:
        records = instance.get_records_for_run(
            run.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY
        ).records
        phase.step_retries += len(records)


def verify(found: Any, prefix: str, keys: list[str], phase: Phase, asset: str = ASSET) -> None:
    """Every input id exactly once in its partition's output or errors, from S3 itself."""
    from dagster_gpuinfer import Manifest

    def read(key: str) -> bytes:
        return found.client.get_object(Bucket=found.bucket, Key=key)["Body"].read()

    for key in keys:
        folder = f"{prefix}/{asset}/{key}/"
        expected = found.inputs[key]
        phase.rows_in += len(expected)
        try:
            manifest = Manifest.model_validate_json(read(folder + "_SUCCESS"))
        except found.client.exceptions.NoSuchKey:
            phase.problems.append(f"{key}: no _SUCCESS manifest")
            phase.lost += len(expected)
            continue
        phase.committed += 1
        seen: Counter[str] = Counter()
        for entry in [*manifest.parts, manifest.errors]:
            table = pq.read_table(io.BytesIO(read(folder + entry.name)), columns=["id"])
            ids = table.column("id").to_pylist()
            if len(ids) != entry.rows:
                phase.problems.append(f"{key}/{entry.name}: {len(ids)} rows, manifest {entry.rows}")
            seen.update(ids)
            if entry is manifest.errors:
                phase.rows_errored += len(ids)
            else:
                phase.rows_out += len(ids)
        phase.lost += sum(1 for i in expected if i not in seen)
        phase.duplicated += sum(n - 1 for i, n in seen.items() if n > 1)
        phase.unexpected += sum(1 for i in seen if i not in set(expected))


# Python's own helpers of this process (multiprocessing's resource tracker, forkserver):
# they live as long as this process does and leave with it, whatever the pods did.
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def leftovers(executor: Any, wait_s: float = 60.0) -> list[str]:
    """Processes of pods still alive, and children of this process (not Python's own
    helpers, `OWN_HELPERS`), after the backfill."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [
            f"{p.pid} {command[:80]}"
            for p in psutil.Process(os.getpid()).children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            for command in [" ".join(p.cmdline())]
            if not any(helper in command for helper in OWN_HELPERS)
        ]
        live_pods = [name for name, pod in executor.pods.items() if not pod.terminated]
        if (not alive and not live_pods) or time.monotonic() > deadline:
            return alive + [f"pod {name} not terminated" for name in live_pods]
        time.sleep(1)
