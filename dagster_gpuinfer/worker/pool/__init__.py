"""The pool worker: `python -m dagster_gpuinfer.worker --pool KEY`, a warm engine shared by jobs.

Where the per-run worker builds an engine for one Dagster step and shuts it down at its end,
a pool worker serves the lease queue (`dagster_gpuinfer.pools`) of one pool: it leases the
next work item (one partition of a job, or a range of a big partition's chunks:
`pools/ranges.py`), builds the engine on its first lease and keeps it,
binds each lease's spec to it (`InferenceEngine.bind`: sampling defaults, limits, window,
task; a spec that needs another engine is refused with a `Fatal` message), serves the
partition through the very path a run takes (`worker/run/job.run_partition`: the run's
coordinator, one `EngineLoop`, the chunk markers and the commit), and completes the lease
with the partition's worker messages as its result (`PartitionCommitted`,
`PartitionFailed`, `Fatal`, the dicts Pipes carries for a run) and the pool facts (warm
engine or not, engine load seconds, lease attempt, inference seconds).

Its rooms: `keeper` (the lease heartbeat thread), `lease_work` (one lease's partition:
events, progress, the result) and `loop` (the worker: leases, the engine's life, its
reports, exit codes). `worker/__main__.py` parses the command line.

What happens when:

- a lease is lost (its job was cancelled, or it expired: a heartbeat every `ttl/3` is
  refused): the loop stops at once, chunks not yet written are dropped (their requests are
  aborted in the engine), and the worker goes on to the next lease. The next holder of the
  item skips the committed chunks (the storage markers) and redoes only the rest.
- SIGTERM: no chunk is handed out after it, the chunks in flight finish and commit, the
  lease is released (no attempt counted) and the worker exits 143 (`EXIT_DRAINED`).
- the engine dies (an engine process is gone, or vLLM raised `EngineDeadError`): the lease
  is failed (an attempt counted) and the worker exits 75 (`EXIT_ENGINE_DIED`).
- no lease for `--idle-ttl` seconds: the engine is shut down, the worker's record removed
  (`remove_worker`) and it exits 0.
- a crash serving one lease (a storage error, a bug): the lease is failed with the error,
  the engine's requests are aborted and the worker goes on; the item is leased again until
  its job's `max_attempts`.

The worker reports itself (`report_worker`: starting, loading, idle, busy, draining, with
pid, host, engine load seconds, leases served, warm hits and cold starts) on every poll and
every heartbeat, with the lease TTL as the record's TTL: a worker that stops reporting
drops out of `pool_workers` within it.
"""
