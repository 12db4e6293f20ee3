"""`LeaseKeeper`: the thread that heartbeats a pool worker's lease and says when it is lost."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dagster_gpuinfer.pools import Lease, LeaseLostError, LeaseQueue

log = logging.getLogger("dagster_gpuinfer.worker")


class LeaseKeeper:
    """Heartbeats `lease` every `ttl_s / 3` seconds until `stop`.

    A refused heartbeat (`LeaseLostError`: the job was cancelled, the lease expired or was
    taken over) calls `on_lost` once and ends the thread. A heartbeat that fails otherwise
    (the store is unreachable) is retried at the next beat; once a whole TTL went by without
    one that succeeded, the lease has lapsed in the store anyway, and that is a loss too.

    Args:
        queue: The lease queue.
        lease: The lease to keep.
        on_lost: Called (from this thread) with the `LeaseLostError`.
        on_beat: Called (from this thread) after each heartbeat that succeeded, e.g. to
            report the worker as busy.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        queue: LeaseQueue,
        lease: Lease,
        *,
        on_lost: Callable[[LeaseLostError], None],
        on_beat: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.lease = lease
        self.on_lost = on_lost
        self.on_beat = on_beat
        self.clock = clock
        self.interval = lease.ttl_s / 3
        self.lost: LeaseLostError | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="gpuinfer-lease-heartbeat", daemon=True
        )

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop heartbeating (the lease is being completed, released or failed)."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval + 30)

    def _beat(self) -> None:
        last_ok = self.clock()
        while not self._stopped.wait(self.interval):
            try:
                self.lease = self.queue.heartbeat(self.lease)
                last_ok = self.clock()
            except LeaseLostError as exc:
                self._lose(exc)
                return
            except Exception as exc:  # noqa: BLE001 - the store may come back within the TTL
                silent = self.clock() - last_ok
                log.warning("heartbeat of lease %s failed (%s)", self.lease.item_key, exc)
                if silent >= self.lease.ttl_s:
                    self._lose(
                        LeaseLostError(
                            f"no heartbeat of the lease of item {self.lease.item_key!r} got "
                            f"through for {silent:.0f} s (its TTL is {self.lease.ttl_s:.0f} s; "
                            f"last error: {exc}): it has lapsed",
                            reason="expired",
                        )
                    )
                    return
                continue
            if self.on_beat is not None and not self._stopped.is_set():
                try:
                    self.on_beat()
                except Exception as exc:  # noqa: BLE001 - a report is best effort
                    log.warning("could not report the worker: %s", exc)

    def _lose(self, exc: LeaseLostError) -> None:
        if self._stopped.is_set():
            return  # the lease was settled meanwhile: nothing to stop
        self.lost = exc
        log.warning("lost the lease of item %r: %s", self.lease.item_key, exc)
        self.on_lost(exc)
