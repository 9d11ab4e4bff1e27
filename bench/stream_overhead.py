"""What the serving stack costs one stream: the bare step loop against the in-process engine and a `kvserve serve`
process over gRPC, on the same artifact, one request at a time; and the bare step loop beside a gRPC stream with
nothing behind it, which is what streaming one message a token costs by itself on this machine.

The bare step loop (bench/decode_step.slots_generate) runs a greedy request as the server's steps do (the prompt as
one chunk, then one decode step a token, each token the graph's greedy token) with nothing around it: no scheduler,
no sampling, no events, no gRPC. The engine and the server run the same requests (ignore_eos, greedy). The three
paths take turns request by request, the order rotating each round, so the drift of a shared machine hits them
alike; each path's figure is the median over the rounds of a request's tokens/s (its tokens over the time from
sending it to its last token). The gRPC client shares the machine with the server (on 2 cores, its work per token
competes with the model's threads).

The fourth path, "bare loop beside a stream", runs the bare step loop in this process and sends a byte a token to
bench/paced_stream.py, a separate process whose Generate answers each byte with one prebuilt message, read by the
same client as the gRPC path's: no scheduler, no sampling, no engine, only one gRPC message a token going out and
coming in beside the steps. Its figure (sent to the last message received) over the bare loop's is the ceiling of
any server that streams one gRPC message a token from Python on this machine.

    python bench/stream_overhead.py [--artifact artifacts/gpt2] [--provider cpu] [--rounds 12] [--prompt-tokens 32]
                                    [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import one_row_pool, slots_generate  # noqa: E402
from grpc_load import InProcess, one_request, prompt_ids, start_server  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PATHS = ("bare step loop", "in-process engine", "gRPC server", "bare loop beside a stream")


def start_paced_stream(ticks_path: str) -> tuple[subprocess.Popen, str]:
    """bench/paced_stream.py listening for ticks on ticks_path: (process, its gRPC target)."""
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("paced_stream.py")), "--ticks", ticks_path],
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.kill()
        sys.exit(f"bench/paced_stream.py did not start: {line!r}")
    return process, f"127.0.0.1:{line.split()[-1]}"


async def measure(local: InProcess, target: str, paced: tuple[str, str], rounds: int, prompt_len: int,
                  new_tokens: int) -> dict[str, dict[str, list]]:
    """{path: {"tokens_per_s": [...], "gaps": [...]}}, a request of each path per round. paced: the gRPC target and
    the ticks socket of bench/paced_stream.py."""
    from kvserve.contract.tokenizer import ByteTokenizer
    from kvserve.service.engine import Engine, EngineLimits

    loop = asyncio.get_running_loop()
    vocab = local.config.vocab_size
    pool = one_row_pool(local.runtime, local.config)
    engine = Engine(local.runtime, local.config, ByteTokenizer(), EngineLimits(max_batch_size=16, max_queue=64), batch=local.batch,
                    step_thread=local.steps)
    engine.start()

    async def bare(ids):
        start = time.perf_counter()
        tokens = await loop.run_in_executor(local.steps, slots_generate, local.runtime, pool, ids, new_tokens)
        return time.perf_counter() - start, [], len(tokens)

    paced_target, ticks_path = paced
    ticks = socket.socket(socket.AF_UNIX)
    ticks.connect(ticks_path)

    async def bare_beside_stream(ids):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens, ignore_eos=True)
        call = paced_stub.Generate(request, timeout=600)
        await call.initial_metadata()  # the server's handler is reading ticks before the first one is sent

        async def receive():
            return [time.perf_counter() async for _ in call]

        received = asyncio.ensure_future(receive())
        start = time.perf_counter()
        generated = await loop.run_in_executor(local.steps, functools.partial(slots_generate, local.runtime, pool, ids, new_tokens,
                                                                               on_token=functools.partial(ticks.send, b"t")))
        stamps = await received
        if len(stamps) != len(generated):
            sys.exit(f"the paced stream delivered {len(stamps)} messages for {len(generated)} tokens")
        return stamps[0] - start, list(np.diff(stamps)), len(stamps)

    results = {path: {"tokens_per_s": [], "gaps": []} for path in PATHS}
    try:
        async with grpc.aio.insecure_channel(target) as channel, grpc.aio.insecure_channel(paced_target) as paced_channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            paced_stub = pb_grpc.GenerationServiceStub(paced_channel)
            in_process = functools.partial(local.request, engine, new_tokens=new_tokens)
            over_grpc = functools.partial(one_request, stub, new_tokens=new_tokens)
            runs = dict(zip(PATHS, (bare, in_process, over_grpc, bare_beside_stream)))
            for run in runs.values():  # warm-up: connection, first binding of each shape
                await run(prompt_ids(0, prompt_len, vocab))
            for round_ in range(rounds):
                turn = round_ % len(PATHS)
                order = PATHS[turn:] + PATHS[:turn]
                for path in order:
                    first, gaps, tokens = await runs[path](prompt_ids(1 + round_, prompt_len, vocab))
                    if tokens != new_tokens:
                        sys.exit(f"{path} produced {tokens} tokens, not {new_tokens}")
                    results[path]["tokens_per_s"].append(tokens / (first + sum(gaps)))  # sent to last token
                    results[path]["gaps"].extend(gaps)
    finally:
        ticks.close()
        await engine.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="an artifact directory (kvserve export)")
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=12, help="requests per path, alternating")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    for name in ("rounds", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (Path(args.artifact) / "manifest.json").is_file():
        parser.error(f"--artifact {args.artifact}: no manifest.json there (kvserve export writes one)")
    local = InProcess(args.artifact, args.provider)
    if args.prompt_tokens + args.new_tokens > local.config.n_ctx:
        parser.error(f"--prompt-tokens + --new-tokens must fit the {local.config.n_ctx}-token context")
    with tempfile.TemporaryDirectory() as scratch:
        ticks_path = str(Path(scratch) / "ticks.sock")
        paced, paced_target = start_paced_stream(ticks_path)
        process, target = start_server(args.artifact, args.provider)
        try:
            results = asyncio.run(measure(local, target, (paced_target, ticks_path), args.rounds, args.prompt_tokens, args.new_tokens))
        finally:
            for server in (process, paced):
                server.terminate()
                server.wait(60)

    bare = statistics.median(results[PATHS[0]]["tokens_per_s"])
    print(f"## One stream: {args.artifact} ({local.config.n_layer} layers, d_model {local.config.d_model}), prompt "
          f"{args.prompt_tokens}, {args.new_tokens} new tokens, greedy; {args.rounds} requests a path, alternating\n")
    print("| path | tokens/s, median request | min | max | / bare step loop | inter-token p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in PATHS:
        rates, gaps = results[path]["tokens_per_s"], results[path]["gaps"]
        median = statistics.median(rates)
        p50, p99 = (f"{np.percentile(gaps, q) * 1e3:.2f}" for q in (50, 99)) if gaps else ("—", "—")
        print(f"| {path} | {median:.1f} | {min(rates):.1f} | {max(rates):.1f} | {median / bare:.1%} | {p50} | {p99} |")
    print(f"\nmachine: {describe(local.runtime.provider)}")


if __name__ == "__main__":
    main()
