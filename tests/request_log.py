"""A recording HTTP proxy in front of the loopback moto server: every S3 and SQS request a
client sends through it is forwarded unchanged and written down, so a test can count, say,
the bucket listings a sensor made (`RequestLog.s3_listings`).

Point a boto3 client (or `GpuInferenceResource(s3_endpoint_url=...)`) at `proxy.endpoint_url`
instead of the server's own.
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

# Connection-level headers a proxy must not pass on (RFC 9110, 7.6.1).
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    query: str
    sqs_action: str | None  # `ReceiveMessage` for `X-Amz-Target: AmazonSQS.ReceiveMessage`


class RequestLog:
    """A proxy on a free loopback port that forwards to `upstream` and records requests."""

    def __init__(self, upstream: str) -> None:
        target = urlparse(upstream)
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        log = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects
            # Headers and body leave in two writes: without TCP_NODELAY, Nagle's algorithm
            # and the client's delayed ACK hold each response about 40 ms.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                path, _, query = self.path.partition("?")
                target_header = self.headers.get("X-Amz-Target") or ""
                action = target_header.split(".", 1)[1] if "AmazonSQS." in target_header else None
                with log._lock:
                    log.requests.append(Request(self.command, path, query, action))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                response = log._send(target, self.command, self.path, body, headers)
                data = response.read()
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _send(self, target, method, path, body, headers) -> http.client.HTTPResponse:
        """Send on this thread's connection to the upstream, reconnecting once if it closed."""
        for attempt in (1, 2):
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                self._local.connection = connection
            try:
                connection.request(method, path, body=body, headers=headers)
                return connection.getresponse()
            except (ConnectionError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def s3_listings(self, bucket: str) -> int:
        """ListObjects / ListObjectsV2 / ListObjectVersions requests on `bucket` (path-style:
        a GET of the bucket itself, not of a key in it)."""
        return sum(
            1
            for r in self.requests
            if r.method == "GET" and r.sqs_action is None and r.path.strip("/") == bucket
        )

    def sqs_calls(self, action: str) -> int:
        return sum(1 for r in self.requests if r.sqs_action == action)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
