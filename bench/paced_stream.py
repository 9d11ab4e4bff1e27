"""A GenerationService with nothing behind it: Generate streams one prebuilt GenerateResponse for each byte that
arrives on a Unix socket, so another process decides when each message goes out. bench/stream_overhead.py runs
its bare step loop with a byte sent per token, which puts one gRPC message a token (this server's send and the
client's receive) beside the model's steps and nothing else: the least any Python gRPC server streaming one message
a token could cost one stream on the same machine.

    python bench/paced_stream.py --ticks /tmp/ticks.sock   (prints "listening on PORT", then serves until killed)
"""

from __future__ import annotations

import argparse
import asyncio
import os

import grpc

from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc


class TickedGeneration(pb_grpc.GenerationServiceServicer):
    def __init__(self) -> None:
        self.ticks: asyncio.StreamReader | None = None
        self.connected = asyncio.Event()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.ticks = reader
        self.connected.set()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self.connected.wait()
        await context.send_initial_metadata(())  # the client waits for this before it starts the ticks
        token = pb.GenerateResponse(token=pb.Token(id=42, text_delta=" the"))  # the size of a kvserve token message
        for _ in range(request.max_new_tokens - 1):
            await self.ticks.readexactly(1)
            yield token
        await self.ticks.readexactly(1)
        yield pb.GenerateResponse(token=token.token, finish=pb.FinishDetails(reason=pb.FINISH_REASON_LENGTH,
                                                                             generated_tokens=request.max_new_tokens))


async def serve(ticks_path: str) -> None:
    servicer = TickedGeneration()
    await asyncio.start_unix_server(servicer.accept, path=ticks_path)
    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on {port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ticks", required=True, help="the Unix socket path to listen on for ticks (one byte a message)")
    args = parser.parse_args()
    if os.path.exists(args.ticks):
        parser.error(f"--ticks {args.ticks}: something is already there")
    asyncio.run(serve(args.ticks))


if __name__ == "__main__":
    main()
