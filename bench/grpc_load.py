"""Load over gRPC on loopback: aggregate tokens/s, time to first token and inter-token latency at
concurrency 1, 4 and 16 (or --levels, with the server's batch at --max-batch-size), against a `kvserve serve` process; plus the in-process engine alone at
concurrency 1, to show what gRPC costs. Bounded: a fixed number of requests per level and a time cap.

Each gRPC level also reports the server process's CPU time per streamed token (all its threads, from
/proc): what the host spends per token besides the model, which bounds the tokens/s one server can stream
however fast its steps run. With a model whose steps cost next to nothing (`--artifact` of the tiny preset)
the tokens/s column is the serving stack's own ceiling. With --batch-tokens each level above 1 runs again right after,
asking for several tokens a message (GenerateRequest.batch_tokens): its row says what fewer messages give. With
--new-tokens-range LOW,HIGH each request's new tokens are drawn from that range (bench/workload.py, the same requests
bench/torch_graph_decode.py --static-batches serves as a static batch would), at every level above 1 (concurrency 1
keeps --new-tokens: its row is held to the in-process engine's).

    python bench/grpc_load.py [--artifact artifacts/gpt2] [--provider auto|cpu|cuda] [--new-tokens 64] [--cuda-graph]
                              [--requests-per-stream 2] [--levels 1,16,64,256 --max-batch-size 256] [--batch-tokens]
                              [--step-token-budget N] [--new-tokens-range 16,128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from workload import new_token_counts, token_range  # noqa: E402

from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

LEVELS = (1, 4, 16)
REQUESTS_PER_STREAM = 2  # each concurrent stream sends this many requests back to back
SINGLE_STREAM_ROUNDS = 3  # the in-process engine and gRPC at concurrency 1 take turns this many times
SPLIT_STEPS = {"auto": None, "on": True, "off": False}  # serve --split-steps, as the in-process runtime's chunk_graph
LEVEL_TIME_CAP_S = 300


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(index).integers(0, vocab, length).tolist()


def percentile(values, q):
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


async def one_request(stub, ids, new_tokens, batch_tokens: bool = False):
    """(ttft s, [inter-token gaps s], tokens) of one streamed request; batch_tokens: several tokens a message where the
    server has them (GenerateRequest.batch_tokens), the tokens of one message arriving together (gaps of 0)."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens, ignore_eos=True, batch_tokens=batch_tokens)
    start = time.perf_counter()
    stamps = []
    async for response in stub.Generate(request, timeout=LEVEL_TIME_CAP_S):
        now = time.perf_counter()
        stamps.extend([now] * (len(response.tokens) if batch_tokens else 1))
    return stamps[0] - start, list(np.diff(stamps)), len(stamps)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process pid, all threads (Linux /proc); None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)": state is field 3, utime 14, stime 15
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(target, concurrency, prompt_len, new_tokens, vocab, requests_per_stream=REQUESTS_PER_STREAM, server_pid=None,
                    batch_tokens: bool = False, new_tokens_range: tuple[int, int] | None = None):
    """One level's load; new_tokens_range: each request's new tokens from bench/workload.py instead of new_tokens."""
    counts = [new_tokens] * (concurrency * requests_per_stream) if new_tokens_range is None \
        else new_token_counts(concurrency * requests_per_stream, *new_tokens_range)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await one_request(stub, prompt_ids(0, prompt_len, vocab), 4)  # connection and warm-up
        ttfts, gaps, tokens = [], [], 0

        async def stream(worker):
            nonlocal tokens
            for k in range(requests_per_stream):
                ttft, gap, n = await one_request(stub, prompt_ids(1000 * worker + k, prompt_len, vocab), counts[worker * requests_per_stream + k],
                                                 batch_tokens)
                ttfts.append(ttft)
                gaps.extend(gap)
                tokens += n

        cpu_before = None if server_pid is None else process_cpu_seconds(server_pid)
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(stream(w) for w in range(concurrency))), LEVEL_TIME_CAP_S)
        elapsed = time.perf_counter() - start
        cpu_after = None if cpu_before is None else process_cpu_seconds(server_pid)
    server_cpu = None if cpu_after is None else cpu_after - cpu_before
    return {"tokens_per_s": tokens / elapsed, "ttft": ttfts, "itl": gaps, "requests": len(ttfts), "elapsed": elapsed,
            "tokens": tokens, "server_cpu_s": server_cpu}


class InProcess:
    """The engine without gRPC, in this process: the same requests, one stream."""

    def __init__(self, artifact_dir, provider, cuda_graph: bool = False, max_batch: int = 16, split_steps: str = "auto",
                 step_token_budget: int | None = None):
        from kvserve.contract.artifact import open_artifact
        from kvserve.service.core.batch import SlotBatch
        from kvserve.runtime.step import DecoderRuntime
        from kvserve.service.core.scheduler import step_thread

        artifact = open_artifact(artifact_dir)
        self.config = artifact.config
        self.runtime = DecoderRuntime(artifact.model_path, self.config.n_layer, artifact.dtype, provider,
                                      cuda_graph=cuda_graph, chunk_graph=SPLIT_STEPS[split_steps])
        self.max_batch = max_batch
        self.limits = {} if step_token_budget is None else {"step_token_budget": step_token_budget}  # beside serve's defaults
        self.batch = SlotBatch(self.runtime, self.config, max_batch)  # one batch for every run: its decode shapes captured once
        self.steps = step_thread()  # every run's engine steps on it: CUDA graphs replay on the thread that captured them
        if self.batch.fixed_decode:  # on a pool no row uses yet
            self.steps.submit(self.batch.prepare_decode_shapes).result()

    def engine(self, batch=None, prompt_cache: bool = True, kv_events=None, **limits):
        """A started Engine (max_batch rows, queue 64, and any other EngineLimits field given) over this runtime and step
        thread, stepping batch (default: the shared one), its prompt cache on or off, its KV events published to
        kv_events (None: not published); on a running event loop, and the caller closes it."""
        from kvserve.service.core.engine import Engine
        from kvserve.service.core.limits import EngineLimits
        from kvserve.contract.tokenizer import ByteTokenizer

        limits = {"max_batch_size": self.max_batch, "max_queue": 64, "prompt_cache": prompt_cache, **self.limits, **limits}
        engine = Engine(self.runtime, self.config, ByteTokenizer(), EngineLimits(**limits),
                        batch=self.batch if batch is None else batch, step_thread=self.steps, kv_events=kv_events)
        engine.start()
        return engine

    async def run(self, prompt_len, new_tokens, requests):
        engine = self.engine()
        try:
            return await self._measure(engine, prompt_len, new_tokens, requests)
        finally:
            await engine.close()

    @staticmethod
    async def stamps(engine, ids, new_tokens) -> list[float]:
        """[arrival, every token's time] (perf_counter seconds) of one greedy request through engine."""
        from kvserve.service.core.sequence import GenerationRequest

        stamps = [time.perf_counter()]
        async for _ in engine.generate(GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=new_tokens, ignore_eos=True)):
            stamps.append(time.perf_counter())
        return stamps

    @staticmethod
    async def request(engine, ids, new_tokens):
        """(ttft s, [inter-token gaps s], tokens) of one request through engine, as one_request over gRPC."""
        stamps = await InProcess.stamps(engine, ids, new_tokens)
        return stamps[1] - stamps[0], list(np.diff(stamps[1:])), len(stamps) - 1

    async def _measure(self, engine, prompt_len, new_tokens, requests):
        def request(ids, n):
            return self.request(engine, ids, n)

        vocab = self.config.vocab_size
        await request(prompt_ids(0, prompt_len, vocab), 4)
        ttfts, gaps, tokens = [], [], 0
        start = time.perf_counter()
        for k in range(requests):
            ttft, gap, n = await request(prompt_ids(1000 + k, prompt_len, vocab), new_tokens)
            ttfts.append(ttft)
            gaps.extend(gap)
            tokens += n
        elapsed = time.perf_counter() - start
        return {"tokens_per_s": tokens / elapsed, "ttft": ttfts, "itl": gaps, "requests": len(ttfts), "elapsed": elapsed,
                "tokens": tokens, "server_cpu_s": None}  # the engine shares this process with its client


def merged(runs: list[dict]) -> dict:
    """Several runs of one configuration as one: tokens/s over their summed time, all latencies."""
    elapsed = sum(r["elapsed"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    cpu = [r["server_cpu_s"] for r in runs]
    return {
        "tokens_per_s": tokens / elapsed, "elapsed": elapsed, "requests": sum(r["requests"] for r in runs), "tokens": tokens,
        "ttft": [x for r in runs for x in r["ttft"]], "itl": [x for r in runs for x in r["itl"]],
        "server_cpu_s": None if None in cpu else sum(cpu),
    }


def start_server(artifact, provider, cuda_graph: bool = False, max_batch: int = 16, split_steps: str = "auto",
                 step_token_budget: int | None = None):
    """(the server process, its address, seconds from its start to SERVING: the load, the gate and the warm-up, which on
    CUDA runs a chunk of every length the step token budget gives)."""
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(artifact), "--port", "0", "--provider", provider,
         "--max-batch-size", str(max_batch), "--max-queue", str(max(64, 4 * max_batch)), "--split-steps", split_steps]
        + (["--cuda-graph"] if cuda_graph else [])
        + ([] if step_token_budget is None else ["--step-token-budget", str(step_token_budget)]),
        stderr=subprocess.PIPE, text=True,
    )
    port = None
    for line in process.stderr:
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        port = match.group(1) if match else port
        if "kvserve.server: SERVING " in line:
            return process, f"127.0.0.1:{port}", time.perf_counter() - began
        if "error" in line.lower():
            break
    process.kill()
    sys.exit(f"the server did not start: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="a gpt2 artifact (bench/decode_latency.py exports one)")
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=REQUESTS_PER_STREAM,
                        help="requests each concurrent stream sends back to back (more: a longer, steadier level)")
    parser.add_argument("--cuda-graph", action="store_true", help="serve (and run the in-process engine) with --cuda-graph")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels, comma-separated, from 1 (default 1,4,16)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="the server's --max-batch-size (default 16)")
    parser.add_argument("--split-steps", choices=tuple(SPLIT_STEPS), default="auto",
                        help="the server's --split-steps, and the in-process engine's (default auto: on the CUDA provider)")
    parser.add_argument("--step-token-budget", type=int, help="the server's --step-token-budget, and the in-process engine's "
                                                                  "(default: serve's)")
    parser.add_argument("--batch-tokens", action="store_true",
                        help="each level above 1 also with GenerateRequest.batch_tokens (several tokens a message), right after it")
    parser.add_argument("--new-tokens-range", type=token_range, default=None, metavar="LOW,HIGH",
                        help="each gRPC request's new tokens drawn from LOW..HIGH (bench/workload.py) instead of --new-tokens")
    args = parser.parse_args()
    if args.requests_per_stream < 1:
        parser.error(f"--requests-per-stream must be >= 1, got {args.requests_per_stream}")
    from kvserve.contract.artifact import open_artifact

    config = open_artifact(args.artifact).config
    levels = sorted({1, *(int(c) for c in args.levels.split(","))})
    local = InProcess(args.artifact, args.provider, args.cuda_graph, args.max_batch_size, args.split_steps, args.step_token_budget)
    provider = local.runtime.provider
    process, target, serving_after = start_server(args.artifact, args.provider, args.cuda_graph, args.max_batch_size,
                                                  args.split_steps, args.step_token_budget)
    try:
        engine_runs, grpc_runs = [], []
        for _ in range(SINGLE_STREAM_ROUNDS):  # alternate, so drift on a shared machine hits both alike
            engine_runs.append(asyncio.run(local.run(args.prompt_tokens, args.new_tokens, args.requests_per_stream)))
            grpc_runs.append(asyncio.run(run_level(target, 1, args.prompt_tokens, args.new_tokens, config.vocab_size,
                                                   args.requests_per_stream, server_pid=process.pid)))
        engine_result = merged(engine_runs)
        results = {1: merged(grpc_runs)}
        batched = {}
        for c in levels[1:]:
            results[c] = asyncio.run(run_level(target, c, args.prompt_tokens, args.new_tokens, config.vocab_size,
                                               args.requests_per_stream, server_pid=process.pid, new_tokens_range=args.new_tokens_range))
            if args.batch_tokens:
                batched[c] = asyncio.run(run_level(target, c, args.prompt_tokens, args.new_tokens, config.vocab_size,
                                                   args.requests_per_stream, server_pid=process.pid, batch_tokens=True,
                                                   new_tokens_range=args.new_tokens_range))
    finally:
        process.terminate()
        process.wait(60)

    print(f"## gRPC load, {args.artifact} ({config.n_layer} layers, d_model {config.d_model}), prompt {args.prompt_tokens}, "
          f"{args.new_tokens} new tokens"
          + ("" if args.new_tokens_range is None else " at concurrency 1, above it {}-{} each (bench/workload.py)".format(*args.new_tokens_range))
          + f", greedy, {args.requests_per_stream} requests per stream "
          f"(x{SINGLE_STREAM_ROUNDS} rounds at concurrency 1, alternating with the in-process engine), server batch <= {args.max_batch_size}"
          + (f", --cuda-graph ({'captured' if local.runtime.captures_decode else local.runtime.cuda_graph_note})" if args.cuda_graph else "")
          + f", steps {'split between the chunk and decode graphs' if local.runtime.splits_steps else 'through the step graph'}"
          + ("" if args.step_token_budget is None else f", --step-token-budget {args.step_token_budget}")
          + f"; the server SERVING {serving_after:.1f} s after its start\n")
    print("| path | concurrency | requests | aggregate tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | server CPU µs/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def row(name, c, r):
        cpu = "n/a" if r["server_cpu_s"] is None else f"{r['server_cpu_s'] / r['tokens'] * 1e6:.0f}"
        print(f"| {name} | {c} | {r['requests']} | {r['tokens_per_s']:.1f} | {percentile(r['ttft'], 50):.1f} | "
              f"{percentile(r['ttft'], 99):.1f} | {percentile(r['itl'], 50):.1f} | {percentile(r['itl'], 99):.1f} | {cpu} |")

    row("in-process engine", 1, engine_result)
    for c in levels:
        row("gRPC", c, results[c])
        if c in batched:
            row("gRPC, batch_tokens", c, batched[c])
    top = 16 if 16 in results else levels[-1]
    scale = results[top]["tokens_per_s"] / results[1]["tokens_per_s"]
    overhead = results[1]["tokens_per_s"] / engine_result["tokens_per_s"]
    print(f"\nconcurrency {top} / concurrency 1: {scale:.2f}x aggregate tokens/s (target >= 4x at 16)")
    print(f"single stream over gRPC / in-process engine: {overhead:.0%} (target >= 90%)")
    print(f"\nmachine: {describe(provider)}")


if __name__ == "__main__":
    main()
