"""What the serving stack costs one stream: the bare step loop against the in-process engine and a `kvserve serve`
process over gRPC, on the same artifact, one request at a time; and the bare step loop behind a gRPC server of its
own, which is what streaming one message a token costs by itself on this machine.

The bare step loop (bench/decode_step.slots_generate) runs a greedy request as the server's steps do (the prompt as
one chunk, then one decode step a token, each token the graph's greedy token) with nothing around it: no scheduler,
no sampling, no events, no gRPC. The engine and the server run the same requests (ignore_eos, greedy). The three
paths take turns request by request, the order rotating each round, so the drift of a shared machine hits them
alike; each path's figure is the median over the rounds of a request's tokens/s (its tokens over the time from
sending it to its last token). The gRPC client shares the machine with the server (on 2 cores, its work per token
competes with the model's threads).

The fourth path, "bare loop over gRPC", is bench/bare_server.py: a server process whose Generate runs the bare step
loop and streams each token as it is made (a message with its id), read by the same client as the gRPC path's. No
engine, scheduler, sampling or text: its distance from the bare loop is what one gRPC message a token costs a
stream here (the server's send, its thread hand-off, the client's receive, all on the same cores); kvserve's
server's distance from it is the server's own.

    python bench/stream_overhead.py [--artifact artifacts/gpt2] [--provider cpu] [--rounds 12] [--prompt-tokens 32]
                                    [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import one_row_pool, slots_generate  # noqa: E402
from grpc_load import InProcess, one_request, prompt_ids, start_server  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PATHS = ("bare step loop", "in-process engine", "gRPC server", "bare loop over gRPC")


def start_bare_server(artifact: str, provider: str) -> tuple[subprocess.Popen, str]:
    """bench/bare_server.py serving artifact: (process, its gRPC target)."""
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("bare_server.py")), "--artifact", artifact, "--provider",
                                provider], stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.fullmatch(r"listening on (\d+)\n", line)
    if match is None:
        process.kill()
        sys.exit(f"bench/bare_server.py did not start: {line!r}")
    return process, f"127.0.0.1:{match.group(1)}"


async def measure(local: InProcess, target: str, bare_target: str, rounds: int, prompt_len: int,
                  new_tokens: int) -> dict[str, dict[str, list]]:
    """{path: {"tokens_per_s": [...], "gaps": [...]}}, a request of each path per round; target: kvserve's server,
    bare_target: bench/bare_server.py's."""
    loop = asyncio.get_running_loop()
    vocab = local.config.vocab_size
    pool = one_row_pool(local.runtime, local.config)
    engine = local.engine()

    async def bare(ids):
        start = time.perf_counter()
        tokens = await loop.run_in_executor(local.steps, slots_generate, local.runtime, pool, ids, new_tokens)
        return time.perf_counter() - start, [], len(tokens)

    results = {path: {"tokens_per_s": [], "gaps": []} for path in PATHS}
    try:
        async with grpc.aio.insecure_channel(target) as channel, grpc.aio.insecure_channel(bare_target) as bare_channel:
            in_process = functools.partial(local.request, engine, new_tokens=new_tokens)
            over_grpc = functools.partial(one_request, pb_grpc.GenerationServiceStub(channel), new_tokens=new_tokens)
            bare_over_grpc = functools.partial(one_request, pb_grpc.GenerationServiceStub(bare_channel), new_tokens=new_tokens)
            runs = dict(zip(PATHS, (bare, in_process, over_grpc, bare_over_grpc)))
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
    servers = []
    try:
        bare_process, bare_target = start_bare_server(args.artifact, args.provider)
        servers.append(bare_process)
        process, target, _ = start_server(args.artifact, args.provider)
        servers.append(process)
        results = asyncio.run(measure(local, target, bare_target, args.rounds, args.prompt_tokens, args.new_tokens))
    finally:
        for server in servers:
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
