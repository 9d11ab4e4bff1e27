"""The bare step loop behind gRPC: a GenerationService whose Generate runs bench/decode_step.slots_generate on the
artifact (the server's steps with nothing around them: no engine, scheduler, sampling or text) and streams one
message a token, each handed from the step thread to the event loop as it is made. bench/stream_overhead.py times it
beside `kvserve serve`: the gap from the bare loop to this is what streaming one gRPC message a token costs on the
machine, the gap from this to kvserve's server is the server's own.

    python bench/bare_server.py --artifact artifacts/gpt2 [--provider cpu]   (prints "listening on PORT", serves until killed)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import one_row_pool, slots_generate  # noqa: E402

from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


class BareGeneration(pb_grpc.GenerationServiceServicer):
    """Greedy, ignore_eos and token-id prompts only: what the benchmark sends."""

    def __init__(self, runtime, config):
        self.runtime, self.pool = runtime, one_row_pool(runtime, config)
        self.steps = ThreadPoolExecutor(max_workers=1)  # one request at a time, as the benchmark sends them

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        loop = asyncio.get_running_loop()
        made: asyncio.Queue = asyncio.Queue()
        count = request.max_new_tokens
        run = functools.partial(slots_generate, self.runtime, self.pool, list(request.token_ids.ids), count,
                                on_token=lambda token: loop.call_soon_threadsafe(made.put_nowait, token))
        generated = loop.run_in_executor(self.steps, run)
        for _ in range(count - 1):
            yield pb.GenerateResponse(token=pb.Token(id=await made.get()))
        last = await made.get()
        await generated
        yield pb.GenerateResponse(token=pb.Token(id=last), finish=pb.FinishDetails(reason=pb.FINISH_REASON_LENGTH, generated_tokens=count))


async def serve(artifact_dir: str, provider: str) -> None:
    from kvserve.contract.artifact import open_artifact
    from kvserve.runtime.step import DecoderRuntime

    artifact = open_artifact(artifact_dir)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, provider)
    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(BareGeneration(runtime, artifact.config), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on {port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", required=True, help="an artifact directory (kvserve export)")
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    if not (Path(args.artifact) / "manifest.json").is_file():
        parser.error(f"--artifact {args.artifact}: no manifest.json there (kvserve export writes one)")
    asyncio.run(serve(args.artifact, args.provider))


if __name__ == "__main__":
    main()
