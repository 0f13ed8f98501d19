"""A real HTTP server on 127.0.0.1 that records webhook POSTs (used by the health and access tests).

`behaviour` decides each answer: a status code, or a delay before answering (a slow server).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookServer:
    def __init__(
        self, behaviour: Callable[[int], tuple[int, float]] | None = None, host: str = "127.0.0.1"
    ) -> None:
        """`host`: the address to listen on (the test bed's nodes reach the controller at its
        address on the bed's network, not at 127.0.0.1)."""
        self.requests: list[dict] = []
        self.attempts = 0
        self._lock = threading.Lock()
        self._behaviour = behaviour or (lambda attempt: (204, 0.0))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server._lock:
                    attempt = server.attempts
                    server.attempts += 1
                status, delay = server._behaviour(attempt)
                time.sleep(delay)
                if status < 300:
                    with server._lock:
                        server.requests.append(
                            {"path": self.path, "headers": dict(self.headers), "json": json.loads(body)}
                        )
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

        self.host = host
        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def url(self, path: str = "/hooks/s3cr3t-token-do-not-log") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def __enter__(self) -> WebhookServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def wait_for(self, count: int, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.requests) >= count:
                    return list(self.requests)
            time.sleep(0.02)
        return list(self.requests)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connection refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/hooks/s3cr3t-token-do-not-log"
