"""Tokenizing a client's text, in a process of its own: Tokenize calls, and every long prompt.

A Tokenize call at the text limit is ~260,000 ids and as many pieces: about 30 ms of work that holds the GIL
(the protobuf is built and serialized in single C calls). On any thread of the server's process, a flood of such
calls starved the event loop that streams every token (a running stream went from 34 ms to 8.7 s). So the whole
call runs in one worker process, which returns the serialized response; the event loop forwards its bytes. A long
prompt is tokenized there too (encode_within): 4 clients sending 256 KiB prompts held a running stream at 4-9x its
time alone while their tokenizing and the check of every id shared the GIL with the steps; the worker hands back
the ids only when they fit the context, else their count, so the server's own work is bounded by the context. And
an HTTP request's body is parsed and checked there (parse_body): its JSON, its parameters and its texts' sizes.
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

from .openai_protocol import parse_body

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


def _encode_within(text: str, add_special_tokens: bool, most: int) -> list[int] | int:
    """text's ids if at most `most`, else how many there are (the refusal needs the count, not 60,000 ids)."""
    ids = _tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ids if len(ids) <= most else len(ids)


def _respond(text: str) -> bytes:
    """The serialized TokenizeResponse for text, in the worker."""
    ids = _tokenizer.encode(text)
    return pb.TokenizeResponse(ids=ids, pieces=_tokenizer.pieces(ids)).SerializeToString()


class TokenizeProcess:
    """One worker process for a client's inputs: Tokenize calls, long prompts and HTTP bodies, in arrival order."""

    def __init__(self, tokenizer_path: Path | None):
        self._path = None if tokenizer_path is None else str(tokenizer_path)
        self._restarting = threading.Lock()  # validation threads and the event loop may find the worker dead at once
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                                   initargs=(self._path, os.getpid()))
        pool.submit(_respond, "")  # spawn and load now, not on the first call
        return pool

    async def respond(self, text: str) -> bytes:
        """The serialized TokenizeResponse for text (its size already checked against the text limit)."""
        return await self._run(_respond, text)

    async def parse_body(self, raw: bytes, kind: str, model_name: str, limits, context: int):
        """openai_protocol.parse_body(raw, ...) in the worker: the Parsed request, or its ApiError raised here."""
        return await self._run(parse_body, raw, kind, model_name, limits, context)

    def encode_within(self, text: str, add_special_tokens: bool, most: int) -> list[int] | int:
        """text's ids, or their count when there are more than `most`; blocks the calling thread (a worker thread of the
        server's: request validation), never the event loop."""
        try:
            return self._submit(_encode_within, text, add_special_tokens, most).result()
        except BrokenProcessPool:  # the worker died (killed, out of memory) with the call in it: a new one takes it
            self._restart()
            return self._submit(_encode_within, text, add_special_tokens, most).result()

    async def _run(self, work, *args):
        """work(*args) in the worker, awaited; once more in a new worker if this one dies with it."""
        try:
            return await asyncio.wrap_future(self._submit(work, *args))
        except BrokenProcessPool:
            self._restart()
            return await asyncio.wrap_future(self._submit(work, *args))

    def _submit(self, work, *args):
        try:
            return self._pool.submit(work, *args)
        except BrokenProcessPool:  # found dead before the call: a new worker takes it
            self._restart()
            return self._pool.submit(work, *args)

    def _restart(self) -> None:
        with self._restarting:
            if self._pool._broken:
                self._pool.shutdown(wait=False)
                self._pool = self._start()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
