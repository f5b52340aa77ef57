"""uvicorn around the app: the listening socket bound before the model loads, a time limit on a
request's headers, and a shutdown that drains the app before uvicorn closes connections.

uvicorn limits how long an idle keep-alive connection may stay, and h11 how large headers may
be, but nothing limits how long headers may take: a client that connects and sends nothing, or
sends headers a byte at a time, would hold its connection forever. ``_H11WithHeaderTimeout``
answers such a connection 408 and closes it after ``read_timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from rosecli.server import protocol as p


class PortInUseError(OSError):
    """The address to listen on is taken (or cannot be bound)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to ``host:port``, or PortInUseError naming them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUseError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    # as uvicorn does: a restart need not wait for the old connections' TIME_WAIT; a port another
    # process listens on still fails to bind
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        what = "is already in use" if e.errno in (98, 48) else f"cannot be bound ({e.strerror})"
        raise PortInUseError(f"port {port} on {host} {what}: stop what listens there or pick another "
                             "--port") from None
    sock.set_inheritable(True)
    return sock


def _timeout_response(read_timeout: float) -> bytes:
    body = json.dumps(p.error_body(f"The request headers did not arrive within {read_timeout:g} s "
                                   "(--read-timeout).", p.INVALID_REQUEST, None, p.REQUEST_TIMEOUT)).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _H11WithHeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: it starts when the
    connection opens and when the first bytes of a next request arrive."""

    read_timeout = 30.0  # seconds; make_server sets it per server

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still waiting for a complete request head
            self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.read_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being written (the client may pipeline meanwhile)
        self.transport.write(_timeout_response(self.read_timeout))
        self.transport.close()


class RoseServer(uvicorn.Server):
    """A uvicorn server whose shutdown first drains the app (``app.state.rose.drain``): the
    listening socket stays open meanwhile, so a new request hears 503 rather than a refused
    connection."""

    def __init__(self, config: uvicorn.Config, drain, shutdown_timeout: float):
        super().__init__(config)
        self._drain = drain
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        await self._drain(self.shutdown_timeout, lambda: self.force_exit)
        await super().shutdown(sockets)


# The engine worker thread and the event loop share the GIL. A thread that gives it up (the engine
# waiting on a CUDA event, the loop in select) and wants it back waits until the holder's switch
# interval ends: CPython's 5 ms made both advance in 5 ms slices under load (a W1 decode step, 0.7 ms
# in process, took ~6 ms behind the server). ROSE_GIL_SWITCH_MS overrides it (for measuring).
DEFAULT_GIL_SWITCH_MS = 0.5


def set_gil_switch_interval() -> float:
    """Sets the process's GIL switch interval for serving; returns it in ms."""
    raw = os.environ.get("ROSE_GIL_SWITCH_MS", "")
    try:
        ms = float(raw) if raw else DEFAULT_GIL_SWITCH_MS
    except ValueError:
        raise ValueError(f"ROSE_GIL_SWITCH_MS must be a number of milliseconds, got {raw!r}") from None
    if not 0.01 <= ms <= 100:
        raise ValueError(f"ROSE_GIL_SWITCH_MS must be between 0.01 and 100 ms, got {raw!r}")
    sys.setswitchinterval(ms / 1000)
    return ms


def make_server(app, *, read_timeout: float, shutdown_timeout: float, log_level: str = "info",
                **config_kw) -> RoseServer:
    """The uvicorn server for ``app`` (from ``create_app``); run it with ``server.run(sockets=[sock])``."""
    protocol = type("H11Protocol", (_H11WithHeaderTimeout,), {"read_timeout": read_timeout})
    # the app has drained (and ended every stream) before uvicorn's own grace period starts
    config = uvicorn.Config(app, http=protocol, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, **config_kw)
    return RoseServer(config, app.state.rose.drain, shutdown_timeout)
