"""Doorbells: a change in the lease queue wakes whoever waits for it, at once.

An idle pool worker waits for work on its pool, a step waits for its job's events; both
used to find out at their next poll (half a second each way, on every run of a pool). The
store now rings a channel after each change a waiter cares about (`pool_channel`: a job
was submitted or an item went back to the queue; `job_channel`: a job got an event, a
result, a failed item or was cancelled), and a waiter `listen`s on its channel and wakes
when it rings. A ring is a hint, never the truth: the waiter reads the queue after it, and
still polls when it hears nothing (a lease that lapsed rings no bell), so a lost ring
costs one poll interval, never a lease or an event.

- `LocalDoorbell` (the SQLite store): a Unix datagram socket per waiter in a folder per
  channel, beside the queue file (`<file>.bells`, or under the temporary folder when that
  path is too long for a socket); a ring sends one byte to each socket there. SQLite
  serves one host, and so does this bell.
- `PostgresDoorbell` (the PostgreSQL store): `LISTEN`/`NOTIFY`, across hosts.
- `Doorbell` itself rings nothing: its waiters sleep out their poll (any other store).

Imports neither dagster nor torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# AF_UNIX socket paths are limited to 108 bytes (with the terminating NUL) on Linux.
MAX_SOCKET_PATH = 107


def pool_channel(pool_key: str) -> str:
    """The channel of a pool's work: rung when an item of the pool is queued."""
    return f"pool:{pool_key}"


def job_channel(job_id: str) -> str:
    """The channel of a job: rung when the job gets an event or changes state."""
    return f"job:{job_id}"


def channel_digest(channel: str) -> str:
    """A short name for `channel`, fit for a file name and a PostgreSQL identifier."""
    return hashlib.sha256(channel.encode()).hexdigest()[:20]


class Listener:
    """Waits on one channel (`Doorbell.listen`); this base hears nothing and sleeps."""

    def wait(self, timeout_s: float) -> bool:
        """Block until the channel rings (True) or `timeout_s` passes (False); rings
        heard since the last wait count, so a ring between a read and a wait is not lost."""
        time.sleep(max(0.0, timeout_s))
        return False

    def close(self) -> None:
        """Stop listening."""

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Doorbell:
    """Rings nothing; its listeners sleep out their timeout (stores without a bell)."""

    def ring(self, channel: str) -> None:
        """Wake the listeners of `channel` (best effort: never raises)."""

    def listen(self, channel: str) -> Listener:
        """A listener on `channel`, listening from now on; close it when done."""
        return Listener()


# --------------------------------------------------------------------------- SQLite: sockets


def bell_folder(wanted: str | os.PathLike[str]) -> Path:
    """The folder of a `LocalDoorbell` wanted at `wanted`: that folder, or
    `<tmp>/gpuinfer-bells-<uid>-<digest of it>` when a socket path under it would be too
    long (an AF_UNIX path holds 107 bytes)."""
    folder = Path(os.path.abspath(wanted))
    # channel folder (20) + socket name (<= 30) + two separators
    if len(os.fsencode(folder)) + 52 <= MAX_SOCKET_PATH:
        return folder
    digest = hashlib.sha256(os.fsencode(folder)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gpuinfer-bells-{os.getuid()}-{digest}"


class SocketListener(Listener):
    """A Unix datagram socket bound in the channel's folder until closed."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for attempt in range(3):  # the last listener may remove the folder in between
            try:
                folder.mkdir(parents=True, exist_ok=True)
                self.socket.bind(str(self.path))
                break
            except FileNotFoundError:
                if attempt == 2:
                    self.socket.close()
                    raise
            except OSError:
                self.socket.close()
                raise
        self.socket.setblocking(False)

    def wait(self, timeout_s: float) -> bool:
        if self._drain():
            return True
        ready, _, _ = select.select([self.socket], [], [], max(0.0, timeout_s))
        return bool(ready) and self._drain()

    def _drain(self) -> bool:
        heard = False
        while True:
            try:
                self.socket.recv(64)
            except (BlockingIOError, InterruptedError):
                return heard
            heard = True

    def close(self) -> None:
        self.socket.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # the last listener of the channel removes its folder


class LocalDoorbell(Doorbell):
    """Bells on this host: one Unix datagram socket per listener under `folder` (or under
    the temporary folder when `folder` is too deep for socket paths: `bell_folder`).

    A ring sends one byte to every socket of the channel; a socket nobody reads any more
    (its process died without closing it) refuses it and is removed; a full socket already
    has rings waiting and is skipped.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = bell_folder(folder)

    def listen(self, channel: str) -> Listener:
        try:
            return SocketListener(self.folder / channel_digest(channel))
        except OSError as exc:  # a read-only or odd folder: poll as before
            log.warning("no doorbell for %s under %s (%s): polling", channel, self.folder, exc)
            return Listener()

    def ring(self, channel: str) -> None:
        folder = self.folder / channel_digest(channel)
        try:
            names = os.listdir(folder)
        except OSError:
            return  # nobody listens
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.setblocking(False)
            for name in names:
                path = folder / name
                try:
                    sender.sendto(b"!", str(path))
                except (BlockingIOError, InterruptedError):
                    continue  # its buffer is full of rings already
                except (ConnectionRefusedError, FileNotFoundError):
                    with contextlib.suppress(OSError):
                        path.unlink()  # its listener died without closing it
                except OSError as exc:
                    log.debug("could not ring %s: %s", path, exc)


# --------------------------------------------------------------------------- PostgreSQL


def postgres_channel(channel: str) -> str:
    """The PostgreSQL LISTEN channel of `channel` (an identifier under 63 bytes)."""
    return f"gpuinfer_{channel_digest(channel)}"


class PostgresListener(Listener):
    """`LISTEN` on its own autocommit connection until closed. A connection the server
    dropped (a restart, a failover) is opened again at the next wait: until then the
    listener polls, and after it wakes its waiter once (rings sent while it was deaf are
    lost; the waiter reads the queue). An outage is logged once as it begins and once as
    it ends, not at every wait (a waiter polls every few seconds)."""

    def __init__(self, connect: Any, channel: str) -> None:
        self._connect = connect
        self.channel = channel
        self.connection: Any = None
        self._deaf = False  # its last try to listen failed (and was logged)
        self._listen()

    def _listen(self) -> bool:
        try:
            connection = self._connect()
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f'LISTEN "{postgres_channel(self.channel)}"')
        except Exception as exc:  # noqa: BLE001 - the queue's own calls say what is wrong
            level = logging.DEBUG if self._deaf else logging.WARNING
            log.log(level, "no doorbell for %s yet (%s): polling", self.channel, exc)
            self._deaf = True
            return False
        if self._deaf:
            log.info("doorbell %s listens again", self.channel)
            self._deaf = False
        self.connection = connection
        return True

    def wait(self, timeout_s: float) -> bool:
        if self.connection is None:
            if self._listen():
                return True  # deaf until now: a ring may have been missed
            time.sleep(max(0.0, timeout_s))
            return False
        try:
            if self._drain():
                return True
            ready, _, _ = select.select([self.connection], [], [], max(0.0, timeout_s))
            return bool(ready) and self._drain()
        except Exception as exc:  # noqa: BLE001 - the server went away
            log.warning("doorbell %s lost its connection (%s): polling", self.channel, exc)
            self.close()
            self.connection, self._deaf = None, True
            return True  # rings while it was down are lost: the waiter reads the queue

    def _drain(self) -> bool:
        self.connection.poll()
        heard = bool(self.connection.notifies)
        self.connection.notifies.clear()
        return heard

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.connection.close()


class PostgresDoorbell(Doorbell):
    """`NOTIFY` through the queue's own connection, `LISTEN` on a connection per listener.

    Args:
        notify: Runs one `pg_notify(channel)` statement on the store (the queue's
            transaction).
        connect: Opens a new connection to the store (for a listener).
    """

    def __init__(self, notify: Any, connect: Any) -> None:
        self._notify = notify
        self._connect = connect

    def listen(self, channel: str) -> Listener:
        return PostgresListener(self._connect, channel)

    def ring(self, channel: str) -> None:
        try:
            self._notify(postgres_channel(channel))
        except Exception as exc:  # noqa: BLE001 - a ring is a hint
            log.debug("could not ring %s: %s", channel, exc)
