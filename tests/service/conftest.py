"""Service fixtures: a real server on loopback (port 0) in a background event loop, real channels to it."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest


class ServerThread:
    """An App running in its own event loop thread, so tests can call it with ordinary blocking stubs."""

    def __init__(self, options, load: bool = True):
        from kvserve.service.server import App

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app = App(options)
        self.port = self.call(self.app.start())
        if load:
            self.call(self.app.load())
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.app.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_server(artifact, load: bool = True, **overrides) -> ServerThread:
    from kvserve.service.server import ServerOptions

    from ..conftest import PROVIDER

    return ServerThread(ServerOptions(artifact=str(artifact), port=0, provider=PROVIDER, **overrides), load=load)


@pytest.fixture(scope="session")
def server(tiny_artifact):
    running = start_server(tiny_artifact, max_batch_size=8, max_queue=256)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def stub(server):
    from kvserve.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def collect(stub, request, timeout: float = 60):
    """(token ids, text, final finish message) of one Generate stream."""
    ids, text, finish = [], "", None
    for response in stub.Generate(request, timeout=timeout):
        ids.append(response.token.id)
        text += response.token.text_delta
        if response.HasField("finish"):
            finish = response.finish
    return ids, text, finish
