"""The HTTP API's connections, each wait on a client bounded: uvicorn's HTTP/1.1 protocol bounds only the idle time
between requests (timeout_keep_alive), so a connection that opens and sends nothing, or sends its headers a byte a
minute, or stops halfway through its body, would hold a file descriptor for ever. This protocol gives a request's
headers a deadline from the moment the connection opens (or its first byte arrives after a kept-alive pause) and its
body a deadline from when its headers are in; past either the connection is closed, with one line in the log. A
connection beyond max_connections is answered 503, as an OpenAI error object, and closed before it is read.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvserve.http")


def refusal(max_connections: int) -> bytes:
    """The whole HTTP response a connection beyond max_connections gets."""
    body = json.dumps({"error": {"message": f"the server holds {max_connections} connections (--max-connections); retry later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\nretry-after: 1\r\n\r\n")
    return head.encode() + body


def bounded_protocol(header_timeout: float, body_timeout: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class whose connections keep these deadlines and this limit (uvicorn takes the class, and makes
    one a connection)."""
    refused = refusal(max_connections)

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str | None = None  # "headers" or "body": what the armed deadline is for

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # this one counted
                log.debug("refused an HTTP connection: %d open", len(self.connections) - 1)
                transport.write(refused)
                transport.close()
                return
            self._arm("headers", header_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE and data:
                self._arm("headers", header_timeout)  # a request has begun: its headers are due (armed once, not per byte)
            elif state is h11.SEND_BODY:
                self._arm("body", body_timeout)
            else:
                self._disarm()  # the request is in whole (or the connection is ending): the app has it

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, waiting_for: str, seconds: float) -> None:
            if self._waiting_for == waiting_for:
                return  # a deadline runs from its start: more bytes do not extend it
            self._disarm()
            self._waiting_for = waiting_for
            self._deadline = self.loop.call_later(seconds, self._expire, waiting_for, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._waiting_for = None, None

        def _expire(self, waiting_for: str, seconds: float) -> None:
            self._deadline, self._waiting_for = None, None
            if not self.transport.is_closing():
                client = "%s:%d" % self.client if self.client else "a client"
                log.info("closed the HTTP connection of %s: no whole request %s within %gs", client, waiting_for, seconds)
                if self.cycle is not None:
                    self.cycle.disconnected = True  # a body the app is reading ends as a disconnect
                    self.cycle.message_event.set()
                self.transport.close()

    return BoundedH11Protocol
