"""A client that leaves before its HTTP answer starts: what the API's handlers wait on beside their work (http_api.py,
http_responses.py), so a request whose client is gone stops taking a row or a prefill."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def unless_disconnected(request: Request, awaitable):
    """awaitable's result, or ClientGone when the client disconnects first (awaitable is then cancelled)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ClientGone()
    return work.result()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
