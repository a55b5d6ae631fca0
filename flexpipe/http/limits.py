"""The server's limits and timeouts: one frozen value passed to `App`, `serve` or `HttpServer`.

Defaults are for an internet-facing API (compare nginx: 8 KiB request line, 60 s header and body
timeouts, 75 s keep-alive; Apache: 100 header fields). docs/http.md explains each one.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

__all__ = ["HttpLimits", "default_max_connections"]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Every bound the HTTP server enforces; the status it answers is in brackets."""

    max_header_bytes: int = 64 * 1024
    """The request head: request line and every header together [431]."""
    max_header_count: int = 100
    """Header fields in one request [431]."""
    max_url_bytes: int = 8 * 1024
    """The request target (path and query) [414]."""
    max_body_bytes: int = 16 * 1024 * 1024
    """The body, unless the route sets its own (`App.add_route(..., max_body_bytes=)`) [413]."""
    header_timeout_s: float = 10.0
    """From a request's first byte (or a new connection) to the end of its head: a slowloris
    client gets 408 and the connection closes (a new connection that sent nothing just closes)."""
    body_timeout_s: float = 60.0
    """From the end of the head to the end of the body [408, then close]."""
    keep_alive_timeout_s: float = 75.0
    """An idle keep-alive connection (no request in progress) is closed after this."""
    write_timeout_s: float = 30.0
    """A client that stops reading while we write (the socket buffer stays full this long) is
    aborted, which cancels its handler (the disconnect contract)."""
    max_connections: int | None = None
    """Open client connections; None: half the process's open-file limit (the other half is left
    for upstream connections and files). At the cap, the longest-idle keep-alive connection is
    closed to make room; when none is idle, the new one gets 503 with `Connection: close`."""
    max_pipelined_requests: int = 16
    """Requests parsed but not yet answered on one connection: beyond this the server stops
    reading from it until the queue drains."""
    refusal_linger_s: float = 1.0
    """How long a refused or errored connection waits for the client to read the error before it
    is dropped (the rest of the request is read and thrown away meanwhile)."""

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes",
            "max_header_count",
            "max_url_bytes",
            "max_body_bytes",
            "max_pipelined_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be at least 1")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("HttpLimits.max_connections must be at least 1 (or None)")
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_timeout_s",
            "write_timeout_s",
            "refusal_linger_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name} must be positive")

    def connection_cap(self) -> int:
        """`max_connections`, or the default derived from the open-file limit."""
        return self.max_connections or default_max_connections()


def default_max_connections() -> int:
    """Half the soft open-file limit less a reserve of 64 (at least 64)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 32768
    return max(64, (soft - 64) // 2)
