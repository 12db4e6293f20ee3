"""Engine pools: warm engines shared across runs, fed from one durable queue of leases.

This package holds the foundation both sides import (no dagster, torch or vllm):

- `pool_key(spec)`: which pool a spec runs on (keys.py).
- `LeaseQueue`: the durable queue of work leases with fair sharing across jobs
  (lease_queue.py), stored in SQLite (`SqliteLeaseQueue`, the embedded default) or
  PostgreSQL (`PostgresLeaseQueue`); `open_lease_queue(location)` picks by location,
  `default_queue_location()` is the one used when none is given (stores.py).
  Beside the leases it keeps the jobs' events (`JobEvent`: worker logs, progress, each
  item's result) and the pool workers' reports (`PoolWorker`).
"""

from __future__ import annotations

from dagster_gpuinfer.pools.keys import pool_identity as pool_identity
from dagster_gpuinfer.pools.keys import pool_key as pool_key
from dagster_gpuinfer.pools.lease_queue import DEFAULT_IDLE_TTL_S as DEFAULT_IDLE_TTL_S
from dagster_gpuinfer.pools.lease_queue import DEFAULT_LEASE_TTL_S as DEFAULT_LEASE_TTL_S
from dagster_gpuinfer.pools.lease_queue import DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS
from dagster_gpuinfer.pools.lease_queue import EVENT_KINDS as EVENT_KINDS
from dagster_gpuinfer.pools.lease_queue import WORKER_STATES as WORKER_STATES
from dagster_gpuinfer.pools.lease_queue import ItemStatus as ItemStatus
from dagster_gpuinfer.pools.lease_queue import JobConflictError as JobConflictError
from dagster_gpuinfer.pools.lease_queue import JobEvent as JobEvent
from dagster_gpuinfer.pools.lease_queue import JobProgress as JobProgress
from dagster_gpuinfer.pools.lease_queue import JobSubmission as JobSubmission
from dagster_gpuinfer.pools.lease_queue import Lease as Lease
from dagster_gpuinfer.pools.lease_queue import LeaseLostError as LeaseLostError
from dagster_gpuinfer.pools.lease_queue import LeaseQueue as LeaseQueue
from dagster_gpuinfer.pools.lease_queue import LeaseQueueError as LeaseQueueError
from dagster_gpuinfer.pools.lease_queue import PoolStats as PoolStats
from dagster_gpuinfer.pools.lease_queue import PoolWorker as PoolWorker
from dagster_gpuinfer.pools.lease_queue import QueueUnavailable as QueueUnavailable
from dagster_gpuinfer.pools.lease_queue import UnknownJobError as UnknownJobError
from dagster_gpuinfer.pools.lease_queue import WorkItem as WorkItem
from dagster_gpuinfer.pools.postgres_queue import PostgresLeaseQueue as PostgresLeaseQueue
from dagster_gpuinfer.pools.sqlite_queue import SqliteLeaseQueue as SqliteLeaseQueue
from dagster_gpuinfer.pools.stores import QUEUE_ENV as QUEUE_ENV
from dagster_gpuinfer.pools.stores import default_pools_home as default_pools_home
from dagster_gpuinfer.pools.stores import default_queue_location as default_queue_location
from dagster_gpuinfer.pools.stores import open_lease_queue as open_lease_queue
