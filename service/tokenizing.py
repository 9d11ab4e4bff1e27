"""Tokenize calls, answered by a process of their own.

A Tokenize call at the text limit is ~260,000 ids and as many pieces: about 30 ms of work that holds the GIL
(the protobuf is built and serialized in single C calls). On any thread of the server's process, a flood of such
calls starved the event loop that streams every token (a running stream went from 34 ms to 8.7 s). So the whole
call runs in one worker process, which returns the serialized response; the event loop forwards its bytes.
The worker is spawned (not forked: the server's gRPC threads must not be copied) when the model loads, and runs at
a lower scheduling priority than the server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from kvserve.contract.tokenizer import Tokenizer, load_tokenizer
from kvserve.v1 import generation_pb2 as pb

_tokenizer: Tokenizer | None = None  # the worker's
# The worker's scheduling priority below the server's: on a machine with few cores a flood of Tokenize calls then
# takes the CPU the model steps leave, not the steps' own (ONNX Runtime's threads stall when one loses its core).
WORKER_NICENESS = 10
PARENT_CHECK_SECONDS = 1.0


def _load(path: str | None, server: int) -> None:
    """The worker's start: lower priority, the tokenizer, and a watch on the server (its pid, passed in: a server
    killed while this worker still imports would make the worker's own parent, read here, already someone else)."""
    global _tokenizer
    threading.Thread(target=_exit_with, args=(server,), daemon=True, name="kvserve-parent-watch").start()
    os.nice(WORKER_NICENESS)
    _tokenizer = load_tokenizer(Path(path) if path else None)


def _exit_with(server: int) -> None:
    """End this worker once the server that spawned it is gone. A spawned worker holds both ends of its call queue,
    so a server that dies without its exit hooks (SIGKILL, out of memory) would leave it waiting forever."""
    while os.getppid() == server:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(0)


def _respond(text: str) -> bytes:
    """The serialized TokenizeResponse for text, in the worker."""
    ids = _tokenizer.encode(text)
    return pb.TokenizeResponse(ids=ids, pieces=_tokenizer.pieces(ids)).SerializeToString()


class TokenizeProcess:
    """One worker process that answers Tokenize calls in arrival order."""

    def __init__(self, tokenizer_path: Path | None):
        self._path = None if tokenizer_path is None else str(tokenizer_path)
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                                   initargs=(self._path, os.getpid()))
        pool.submit(_respond, "")  # spawn and load now, not on the first call
        return pool

    async def respond(self, text: str) -> bytes:
        """The serialized TokenizeResponse for text (its size already checked against the text limit)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, _respond, text)
        except BrokenProcessPool:  # the worker died (killed, out of memory): a new one takes this call and the next
            self._pool.shutdown(wait=False)
            self._pool = self._start()
            return await loop.run_in_executor(self._pool, _respond, text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
