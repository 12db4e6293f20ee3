"""A fault-injecting HTTP proxy in front of the loopback S3 server (moto).

Every S3 request of the workers and of the control plane goes through it. While a fault
window is open, each request is hit with the window's probability by one of:

- `s3_5xx`: `503 SlowDown` before the request reaches S3 (not applied), or `500
  InternalError` after S3 applied it (the client sees a failure of a write that happened);
- `s3_slow`: the response held back 0.5-2.5 s;
- `s3_reset`: the connection reset (RST) before forwarding, after S3 applied the request, or
  halfway through the response body.

Outside a window requests pass unchanged. Decisions come from a seeded generator; which
request meets which decision depends on thread timing, the schedule of windows does not.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

S3_FAULTS = ("s3_5xx", "s3_slow", "s3_reset")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te"}
ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
    "<Message>injected by the chaos proxy</Message></Error>"
)


class _Reset(Exception):
    """The handler reset the connection: nothing more is written to it."""


class FaultProxy:
    """`FaultProxy(host, upstream_port, seed)`; `start()`, `open_window(kind, seconds, rate)`,
    `fail_once(method, key_suffix, variant)`, `stop()`; `endpoint` is the URL clients use,
    `injected` counts what was done."""

    def __init__(self, host: str, upstream: tuple[str, int], seed: int) -> None:
        self.upstream = upstream
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._windows: list[tuple[str, float, float]] = []  # kind, until, rate; may overlap
        self._once: list[tuple[str, str, str]] = []  # method, key suffix, variant
        self._server = ThreadingHTTPServer((host, 0), _handler_class(self))
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # resets are the point
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def open_window(self, kind: str, seconds: float, rate: float) -> None:
        if kind not in S3_FAULTS:
            raise ValueError(f"unknown S3 fault {kind!r}: one of {', '.join(S3_FAULTS)}")
        with self._lock:
            self._windows.append((kind, time.monotonic() + seconds, rate))

    def fail_once(self, method: str, key_suffix: str, variant: str) -> None:
        """Hit the next `method` request whose path ends with `key_suffix` with `variant`
        (`503-before`, `500-after`, `reset-before`, `reset-after`, `reset-mid-body`): a
        fault aimed at one step of a protocol, for a test that must meet it."""
        with self._lock:
            self._once.append((method.upper(), key_suffix, variant))

    def decide(self, method: str = "", path: str = "") -> tuple[str, str] | None:
        """The fault for the next request (`method` on `path`), `(kind, variant)`, or None."""
        with self._lock:
            self.requests += 1
            key = path.split("?", 1)[0]
            for rule in self._once:
                if rule[0] == method and key.endswith(rule[1]):
                    self._once.remove(rule)
                    self.injected[rule[2]] += 1
                    return "once", rule[2]
            now = time.monotonic()
            self._windows = [w for w in self._windows if now <= w[1]]
            hit = [w for w in self._windows if self._rng.random() < w[2]]
            if not hit:
                return None
            kind = hit[0][0]
            variants = {
                "s3_5xx": ("503-before", "500-after"),
                "s3_slow": ("slow",),
                "s3_reset": ("reset-before", "reset-after", "reset-mid-body"),
            }[kind]
            variant = self._rng.choice(variants)
            self.injected[variant] += 1
            delay = self._rng.uniform(0.5, 2.5)
        return kind, f"{variant}:{delay:.2f}" if kind == "s3_slow" else variant


def _handler_class(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        pass

    Handler.proxy = proxy
    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        return

    def do_GET(self) -> None:  # noqa: N802 - stdlib's names
        self._serve()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET  # noqa: N815

    def _serve(self) -> None:
        try:
            body = self._read_body()
            fault = self.proxy.decide(self.command, self.path)
            variant = fault[1] if fault else ""
            if variant == "503-before":
                return self._error(503, "SlowDown")
            if variant == "reset-before":
                raise _Reset
            if variant.startswith("slow:"):
                time.sleep(float(variant.split(":")[1]))
            status, reason, headers, payload = self._forward(body)
            if variant == "500-after":
                return self._error(500, "InternalError")
            if variant == "reset-after":
                raise _Reset
            self._respond(status, reason, headers, payload, cut=variant == "reset-mid-body")
        except _Reset:
            self._reset()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
            if self.command == "HEAD":
                length = response.getheader("Content-Length")
                kept.append(("Content-Length", length or "0"))
            return response.status, response.reason, kept, payload
        finally:
            connection.close()

    def _respond(self, status, reason, headers, payload: bytes, cut: bool = False) -> None:
        self.send_response(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if cut and len(payload) > 1:
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            raise _Reset
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _error(self, status: int, code: str) -> None:
        payload = ERROR_XML.format(code=code).encode()
        headers = [("Content-Type", "application/xml")]
        self._respond(status, code, headers, payload)

    def _reset(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
