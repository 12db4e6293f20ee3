"""The http(s) fetch of an image URL, under the pipeline's URL policy.

Three checks stand between a URL in a user's data and the network:

- **The allow-list, with ports.** `images.allowed_url_hosts` lists `name` or `name:port`. A
  bare `name` allows the scheme's default port only (80 for http, 443 for https), so a
  listed host does not open its other ports (`https://images.example.com:6379/`).
- **Public addresses only, checked where the worker connects.** A listed DNS name is
  resolved once, here, and the worker connects only to the addresses of that answer that
  are public: a name that resolves (or is rebound, between two lookups) to a loopback,
  private, link-local (a cloud metadata endpoint), multicast or reserved address is refused
  before a packet is sent to it, and the peer of the connected socket is checked again. A
  host listed as an IP literal is the operator's explicit choice and is connected as
  listed. Proxies from the environment are not used (the check would see the proxy).
- **One deadline for the whole fetch.** `images.fetch_timeout_seconds` bounds the fetch
  from the first connect to the last byte, not each socket read: a host that sends a byte a
  second is cut off when the deadline passes (a watchdog shuts the socket down under the
  read), and `images.max_image_bytes` bounds what is read.

Redirects are never followed (one could lead off the allowed hosts).
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from dagster_gpuinfer.image_options import ImageOptions

DEFAULT_PORTS = {"http": 80, "https": 443}
READ_BLOCK = 64 << 10


class AddressRefused(OSError):
    """A listed host resolved to addresses the worker must not connect to."""

    def __init__(self, host: str, addresses: list[str]) -> None:
        super().__init__(f"{host} resolves to {', '.join(addresses)}")
        self.host = host
        self.addresses = addresses


class FetchTimedOut(OSError):
    """The fetch's deadline passed before its last byte arrived."""


def allowed_endpoint(parts: urllib.parse.SplitResult, allowed: tuple[str, ...]) -> bool:
    """Whether the URL's host and port (the scheme's default when it names none) are listed:
    `name:port` exactly, or a bare `name` on its scheme's default port."""
    host = (parts.hostname or "").lower()
    default = DEFAULT_PORTS.get(parts.scheme.lower())
    port = parts.port or default
    for entry in allowed:
        listed_host, listed_port = split_entry(entry)
        if listed_host == host and (listed_port or default) == port:
            return True
    return False


def split_entry(entry: str) -> tuple[str, int | None]:
    """`("name", port)` of an allow-list entry (`name`, `name:port`, `[v6]:port`, `v6`)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, int(port)
    return entry, None


def public_address(address: str) -> bool:
    """Whether `address` is one the worker may fetch from: a global unicast address (never
    loopback, private, link-local, shared, multicast or reserved; IPv4-mapped IPv6 judged
    by its IPv4 address)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class FetchGuard:
    """One fetch's limits: which addresses it may connect to, and its deadline.

    Every socket the fetch opens is tracked; `expire` (the watchdog, at the deadline) shuts
    them down, which ends a read blocked on a slow host at once.
    """

    def __init__(self, *, timeout: float, literal_host: bool) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.literal_host = literal_host
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FetchTimedOut(f"no answer within {self.timeout} s")
        return left

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def connect(
        self, address: tuple[str, int], timeout: Any = None, source_address: Any = None
    ) -> socket.socket:
        """A socket connected to a permitted address of `address`'s host (http.client's
        `_create_connection`); raises `AddressRefused` when the host has none."""
        host, port = address
        refused: list[str] = []
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        ):
            if not (self.literal_host or public_address(str(sockaddr[0]))):
                refused.append(str(sockaddr[0]))
                continue
            sock = socket.socket(family, kind, proto)
            self.track(sock)
            try:
                sock.settimeout(self.remaining())
                sock.connect(sockaddr)
                peer = str(sock.getpeername()[0])
                if not (self.literal_host or public_address(peer)):
                    raise AddressRefused(host, [peer])
                return sock
            except OSError as exc:
                sock.close()
                if isinstance(exc, AddressRefused):
                    raise
                error = exc
        if error is not None:
            raise error
        raise AddressRefused(host, refused or ["no address"])


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected yet, or already closed
        pass


class _GuardedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, guard: FetchGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = guard.connect


class _GuardedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, guard: FetchGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def connect(self) -> None:
        """TCP through the guard, then TLS on a socket the guard tracks before the
        handshake (a slow handshake is cut off at the deadline too)."""
        raw = self.guard.connect((self.host, self.port))
        self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            raw, server_hostname=self.host, do_handshake_on_connect=False
        )
        self.guard.track(self.sock)
        self.sock.settimeout(self.guard.remaining())
        self.sock.do_handshake()


class _GuardedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, guard: FetchGuard) -> None:
        super().__init__()
        self.guard = guard

    def http_open(self, req: Any) -> Any:
        return self.do_open(functools.partial(_GuardedHTTPConnection, guard=self.guard), req)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, guard: FetchGuard) -> None:
        super().__init__()
        self.guard = guard

    def https_open(self, req: Any) -> Any:
        connection = functools.partial(_GuardedHTTPSConnection, guard=self.guard)
        return self.do_open(connection, req, context=self._context)  # type: ignore[attr-defined]


class NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: it could lead off the allowed hosts."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.HTTPError(newurl, code, "redirects are not followed", headers, fp)


class GuardedOpener:
    """Opens one allowed URL at a time under a `FetchGuard` (`open(url, timeout)`, the
    interface `ImageSource` takes; tests inject others)."""

    def open(self, url: str, timeout: float) -> Any:
        host = urllib.parse.urlsplit(url).hostname or ""
        guard = FetchGuard(timeout=timeout, literal_host=is_ip_literal(host))
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),
            NoRedirects,
            _GuardedHTTPHandler(guard),
            _GuardedHTTPSHandler(guard),
        )
        watchdog = threading.Timer(timeout, guard.expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            response = opener.open(url, timeout=timeout)
        except BaseException:
            watchdog.cancel()
            raise
        return _GuardedResponse(response, guard, watchdog)


class _GuardedResponse:
    """A response whose watchdog stops when it is closed."""

    def __init__(self, response: Any, guard: FetchGuard, watchdog: threading.Timer) -> None:
        self.response = response
        self.guard = guard
        self.watchdog = watchdog

    def read1(self, size: int) -> bytes:
        return self.response.read1(size)

    def __enter__(self) -> _GuardedResponse:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.watchdog.cancel()
        self.response.close()


def read_within(response: Any, limit: int, deadline: float) -> bytes:
    """At most `limit + 1` bytes of `response`, each read a bounded block (`read1`), and
    none after `deadline` (a monotonic time); raises `FetchTimedOut` past it."""
    blocks: list[bytes] = []
    total = 0
    read = getattr(response, "read1", None) or response.read
    while total <= limit:
        if time.monotonic() > deadline:
            raise FetchTimedOut("the body did not arrive in time")
        block = read(min(READ_BLOCK, limit + 1 - total))
        if not block:
            break
        blocks.append(block)
        total += len(block)
    if isinstance(response, _GuardedResponse) and response.guard.expired:
        raise FetchTimedOut("the body did not arrive in time")
    return b"".join(blocks)


def fetch_timeout_message(options: ImageOptions) -> str:
    return (
        f"the download took longer than images.fetch_timeout_seconds="
        f"{options.fetch_timeout_seconds} (the bound of the whole fetch, not of one read); the "
        "host is too slow or stalled: serve the image faster, or raise the limit"
    )
