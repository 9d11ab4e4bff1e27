"""The HTTP API's connections, each wait on a client bounded: uvicorn's HTTP/1.1 protocol bounds only the idle time
between requests (timeout_keep_alive), so a connection that opens and sends nothing, or sends its headers a byte a
minute, or stops halfway through its body, would hold a file descriptor for ever. This protocol gives a request's
headers a deadline from the moment the connection opens (or its first byte arrives after a kept-alive pause) and its
body a deadline from when its headers are in; past either the connection is closed, with one line in the log.

At the connection limit (max_connections, or max_per_address from one client address) a new connection is admitted by
closing the connection that has waited longest among those that hold nothing the server is working on: idle between
requests, or receiving a request that has sent nothing for STALLED_SECONDS (headers that do not end, an upload that
stopped). A request being answered or streamed is never closed so. With none such, the new connection is answered
503, as an OpenAI error object, and closed before it is read. (nginx and Envoy shed the same way under pressure.)
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvserve.http")
STALLED_SECONDS = 1.0  # a connection receiving its request with no byte for this long may be closed for a new one


def refusal(max_connections: int) -> bytes:
    """The whole HTTP response a connection beyond max_connections gets."""
    body = json.dumps({"error": {"message": f"the server holds {max_connections} connections (--max-connections); retry later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\nretry-after: 1\r\n\r\n")
    return head.encode() + body


def bounded_protocol(header_timeout: float, body_timeout: float, max_connections: int, max_per_address: int) -> type[H11Protocol]:
    """An H11Protocol class whose connections keep these deadlines and limits (uvicorn takes the class, and makes one a
    connection)."""
    refused = refusal(max_connections)

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str | None = None  # "headers" or "body": what the armed deadline is for
        _last_heard: float = 0.0  # the loop's time of its last byte in, or of its last answer's end

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._last_heard = self.loop.time()
            others = [c for c in self.connections if c is not self]
            address = self.client[0] if self.client else None
            same = [c for c in others if c.client and c.client[0] == address] if address is not None else []
            for over, pool in ((len(same) >= max_per_address, same), (len(others) >= max_connections, others)):
                if over and not self._shed(pool):
                    log.debug("refused an HTTP connection: %d open, %d from its address", len(others), len(same))
                    transport.write(refused)
                    transport.close()
                    return
            self._arm("headers", header_timeout)

        def _shed(self, pool: list) -> bool:
            """Close the connection of pool that has waited longest among those holding no work (idle, or stalled
            receiving a request); False when there is none."""
            now = self.loop.time()
            candidates = [c for c in pool if c._sheddable(now)]
            if not candidates:
                return False
            victim = min(candidates, key=lambda c: c._last_heard)
            client = "%s:%d" % victim.client if victim.client else "a client"
            log.info("closed the HTTP connection of %s (%s %.0fs) to admit a new one at the connection limit", client,
                     "stalled" if victim._waiting_for else "idle", now - victim._last_heard)
            victim._close()
            return True

        def _sheddable(self, now: float) -> bool:
            if self.transport is None or self.transport.is_closing():
                return False
            if self._waiting_for is not None:  # receiving its request: stalled once silent long enough
                return now - self._last_heard >= STALLED_SECONDS
            return self.cycle is None or self.cycle.response_complete  # idle between requests

        def _close(self) -> None:
            self._disarm()
            if self.cycle is not None:
                self.cycle.disconnected = True  # a body the app is reading ends as a disconnect
                self.cycle.message_event.set()
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._last_heard = self.loop.time()

        def data_received(self, data: bytes) -> None:
            self._last_heard = self.loop.time()
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
                self._close()

    return BoundedH11Protocol
