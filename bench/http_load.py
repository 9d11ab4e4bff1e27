"""The OpenAI-compatible HTTP API against gRPC on one server: 16 streaming clients' aggregate tokens/s, and one
client's time to first token, the two APIs taking turns round by round (never at once: on 2 cores they would
contend). Clients: grpc.aio, and httpx reading server-sent events (the transport the `openai` client uses).

    python bench/http_load.py [--artifact artifacts/gpt2] [--rounds 3] [--provider cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server  # noqa: E402

from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, STREAMS, REQUESTS_PER_STREAM = 32, 64, 16, 2


def prompt(seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, PROMPT_TOKENS).tolist()


async def grpc_stream(stub, ids: list[int], new_tokens: int) -> tuple[float, int]:
    """(time to first token s, tokens) of one greedy stream."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens)
    start, first, tokens = time.perf_counter(), None, 0
    async for _ in stub.Generate(request, timeout=300):
        first = first or time.perf_counter()
        tokens += 1
    return first - start, tokens


async def http_stream(client: httpx.AsyncClient, model: str, ids: list[int], new_tokens: int) -> tuple[float, int]:
    """(time to first token s, tokens) of one greedy stream: its tokens as its usage chunk counts them (a chunk carries
    the tokens ready together)."""
    body = {"model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, tokens, pending = time.perf_counter(), None, 0, b""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for data in response.aiter_bytes():
            *events, pending = (pending + data).split(b"\n\n")  # an event ends with a blank line (its text may hold \r)
            for event in events:
                if event.startswith(b"data: {"):
                    chunk = json.loads(event[6:])
                    if chunk["choices"]:
                        first = first or time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    return first - start, tokens


async def level(api: str, target: str, http_base: str, model: str, vocab: int, streams: int, seed: int) -> dict:
    """streams concurrent clients, REQUESTS_PER_STREAM requests each: aggregate tokens/s and every TTFT."""
    async with grpc.aio.insecure_channel(target) as channel, httpx.AsyncClient(base_url=http_base, timeout=300,
                                                                               limits=httpx.Limits(max_connections=64)) as client:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def one(ids, new_tokens):
            return await (grpc_stream(stub, ids, new_tokens) if api == "gRPC" else http_stream(client, model, ids, new_tokens))

        await one(prompt(seed - 1, vocab), 2)  # connection and warm-up
        ttfts, tokens = [], 0

        async def worker(w: int):
            nonlocal tokens
            for k in range(REQUESTS_PER_STREAM):
                ttft, n = await one(prompt(seed + 100 * w + k, vocab), NEW_TOKENS)
                ttfts.append(ttft)
                tokens += n

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(streams)))
        return {"tokens/s": tokens / (time.perf_counter() - start), "ttft": ttfts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2")
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    from kvserve.contract.artifact import open_artifact

    config = open_artifact(args.artifact).config
    port = 18000 + np.random.default_rng().integers(0, 1000)
    results: dict[tuple[str, int], list[dict]] = {}
    with Server("http", args.artifact, args.provider, sys.executable, ["--http-port", str(port), "--prompt-cache", "off"]) as server:
        model = Path(args.artifact).resolve().name
        base = f"http://127.0.0.1:{port}"
        for round_ in range(args.rounds):
            order = ("gRPC", "HTTP") if round_ % 2 == 0 else ("HTTP", "gRPC")
            for streams in (1, STREAMS):
                for api in order:
                    results.setdefault((api, streams), []).append(
                        asyncio.run(level(api, server.target, base, model, config.vocab_size, streams, 1000 * (round_ + 1))))
    print(f"## HTTP (OpenAI completions, SSE) against gRPC, one server, {args.artifact}, prompt {PROMPT_TOKENS}, {NEW_TOKENS} new "
          f"tokens, greedy, {REQUESTS_PER_STREAM} requests a stream, {args.rounds} rounds alternating, medians over rounds "
          "(--prompt-cache off: every round computes the same)\n")
    print("| API | streams | aggregate tokens/s | TTFT p50 ms |\n|---|---:|---:|---:|")
    medians = {}
    for (api, streams), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rate = statistics.median(r["tokens/s"] for r in runs)
        ttft = statistics.median(statistics.median(r["ttft"]) for r in runs) * 1e3
        medians[(api, streams)] = (rate, ttft)
        print(f"| {api} | {streams} | {rate:.1f} | {ttft:.1f} |")
    print(f"\n{STREAMS} streams, HTTP / gRPC aggregate tokens/s: {medians[('HTTP', STREAMS)][0] / medians[('gRPC', STREAMS)][0]:.1%} (target >= 90%)")
    print(f"1 stream, HTTP - gRPC time to first token: {medians[('HTTP', 1)][1] - medians[('gRPC', 1)][1]:+.2f} ms (target < 2 ms)")
    print(f"\nmachine: {describe(args.provider)}")


if __name__ == "__main__":
    main()
