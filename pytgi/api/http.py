"""uvicorn's httptools protocol with a deadline for each request's headers.

uvicorn times out idle keep-alive connections, but not a connection that opens and says nothing,
nor one that trickles its headers a byte at a time (slowloris): each holds a socket for as long as
the client likes. Here every request's headers must be complete within `header_timeout` seconds of
the connection opening (or of the previous response), else the connection gets 408 and is closed.
Bodies have their own deadline (`PayloadLimitMiddleware`)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[TimedHttpToolsProtocol]:
    return type("HttpToolsProtocol", (TimedHttpToolsProtocol,), {"header_timeout": seconds})
