"""The prompt cache on against off, servers alternating in one run (never side by side: on 2 cores they would
contend), and what a K/V copy between rows costs against computing the tokens it saves.

Scenarios (greedy, ignore_eos; each server `--max-batch-size 16`, a fresh server per round):
  chat          a 4-turn conversation: the first prompt 400 tokens, each later turn the history (prompt and the 48
                tokens generated) and 100 new tokens: time to first token per turn
  shared-512    16 requests arriving together, a shared 512-token system prompt and a 32-token question each, 32 new
                tokens: time to first token p50 / p99 and aggregate tokens/s
  no-match      16 streams of random 128-token prompts, 64 new tokens, 2 requests each: aggregate tokens/s
And, in process: the no-match load through the engine alone, cache on and off alternating (the same comparison
without gRPC, a client process or a fresh server each round, which move the servers' figures more than the cache
does); and a copy of N columns between two rows of the pool (SlotPool.copy_columns) against a prefill of
N tokens, on the provider in use: the line past which taking a prefix from a row in use beats recomputing it.

    python bench/prompt_cache.py [--artifact artifacts/gpt2] [--rounds 3] [--provider cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import Server  # noqa: E402

from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

TIME_CAP_S = 300


def tokens(seed: int, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


async def stream(stub, ids: list[int], new_tokens: int) -> tuple[float, list[int], int, float]:
    """(time to first token s, generated ids, prompt tokens reused, end time) of one greedy request."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens, ignore_eos=True)
    start, first, generated, reused = time.perf_counter(), None, [], 0
    async for response in stub.Generate(request, timeout=TIME_CAP_S):
        first = first or time.perf_counter()
        generated.append(response.token.id)
        if response.HasField("finish"):
            reused = response.finish.cached_prompt_tokens
    return first - start, generated, reused, time.perf_counter()


async def chat(stub, vocab: int, seed: int) -> dict:
    history = tokens(seed, 400, vocab)
    result = {}
    for turn in range(1, 5):
        ttft, generated, reused, _ = await stream(stub, history, 48)
        result[f"turn {turn} TTFT ms"] = ttft * 1e3
        result[f"turn {turn} reused"] = reused
        history = history + generated + tokens(seed + turn, 100, vocab)
    return result


async def shared_512(stub, vocab: int, seed: int) -> dict:
    system = tokens(seed, 512, vocab)
    start = time.perf_counter()
    runs = await asyncio.gather(*(stream(stub, system + tokens(seed + 1 + i, 32, vocab), 32) for i in range(16)))
    elapsed = max(end for *_, end in runs) - start
    ttfts = [ttft for ttft, *_ in runs]
    return {"TTFT p50 ms": float(np.percentile(ttfts, 50)) * 1e3, "TTFT p99 ms": float(np.percentile(ttfts, 99)) * 1e3,
            "tokens/s": sum(len(generated) for _, generated, *_ in runs) / elapsed,
            "reused per request": statistics.mean(reused for _, _, reused, _ in runs)}


async def no_match_load(request, vocab: int, seed: int) -> dict:
    """The no-match scenario's requests, each through request(ids, new_tokens) -> tokens generated: aggregate tokens/s."""
    counted = 0

    async def worker(w: int):
        nonlocal counted
        for k in range(2):
            generated = await request(tokens(seed + 100 * w + k, 128, vocab), 64)
            counted += generated  # after the await: += across it would lose the other workers' counts

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(16)))
    return {"tokens/s": counted / (time.perf_counter() - start)}


async def no_match(stub, vocab: int, seed: int) -> dict:
    async def request(ids: list[int], new_tokens: int) -> int:
        return len((await stream(stub, ids, new_tokens))[1])

    return await no_match_load(request, vocab, seed)


SCENARIOS = {"chat": chat, "shared-512": shared_512, "no-match": no_match}


async def run(server: Server, scenario, vocab: int, seed: int) -> dict:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await stream(stub, tokens(10**6 + seed, 32, vocab), 4)  # connection and warm-up (it shares nothing)
        return await scenario(stub, vocab, seed)


def no_match_in_process(artifact: str, provider: str, rounds: int) -> tuple[dict[str, list[tuple[float, int]]], str]:
    """The no-match load through the engine in this process (no gRPC, no client process, no fresh server a round: the
    servers' figures move more between rounds than the cache moves them), one runtime under two batches, cache on and
    off alternating: ({setting: [(tokens/s, K/V bytes the round moved between rows)]}, the provider)."""
    from grpc_load import InProcess

    from kvserve.service.core.batch import SlotBatch

    local = InProcess(artifact, provider)
    batches = {"on": local.batch, "off": SlotBatch(local.runtime, local.config, 16)}
    traffic = local.runtime.traffic

    async def one_round(setting: str, seed: int) -> tuple[float, int]:
        engine = local.engine(batches[setting], prompt_cache=setting == "on")

        async def request(ids: list[int], new_tokens: int) -> int:
            return len(await InProcess.stamps(engine, ids, new_tokens)) - 1

        try:
            moved = traffic.device_copy_bytes
            result = await no_match_load(request, local.config.vocab_size, seed)
            return result["tokens/s"], traffic.device_copy_bytes - moved
        finally:
            await engine.close()

    results: dict[str, list[tuple[float, int]]] = {"on": [], "off": []}
    for round_ in range(rounds):
        for setting in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            results[setting].append(asyncio.run(one_round(setting, 1000 * round_)))
    return results, local.runtime.provider


def copy_against_prefill(artifact: str, provider: str, lengths=(16, 64, 256, 512)) -> tuple[list[tuple[int, float, float]], str]:
    """([(tokens, ms to copy their K/V between two rows, ms to prefill them in one step)], the provider that ran them)."""
    from kvserve.contract.artifact import open_artifact
    from kvserve.runtime.step import DecoderRuntime
    from kvserve.service.core.batch import SlotBatch

    opened = open_artifact(artifact)
    runtime = DecoderRuntime(opened.model_path, opened.config.n_layer, opened.dtype, provider)
    batch = SlotBatch(runtime, opened.config, 2)
    pool, rows = batch.pool, []
    for n in lengths:
        prompt = np.asarray(tokens(n, n, opened.config.vocab_size), np.int64)
        copies, prefills = [], []
        for _ in range(5):
            start = time.perf_counter()
            runtime.run_slots(pool, np.zeros(1, np.int64), np.full(1, pool.scratch, np.int64), np.ones((1, 1), np.int64),
                              prompt, 0, 0, np.array([1 + n - 1], np.int64), False)
            prefills.append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.copy_columns(0, 1, n)
            copies.append(time.perf_counter() - start)
        rows.append((n, statistics.median(copies) * 1e3, statistics.median(prefills) * 1e3))
    return rows, runtime.provider


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="a gpt2 artifact (kvserve export --preset gpt2 --out artifacts/gpt2)")
    parser.add_argument("--provider", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3, help="each scenario runs this many times per server, alternating")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    unknown = [name for name in args.scenarios.split(",") if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (choose from {', '.join(SCENARIOS)})")
    from kvserve.contract.artifact import open_artifact

    config = open_artifact(args.artifact).config
    servers = {setting: Server(f"cache {setting}", args.artifact, args.provider, None, ["--prompt-cache", setting]) for setting in ("on", "off")}
    results: dict[tuple[str, str], list[dict]] = {}
    for name in args.scenarios.split(","):
        for round_ in range(args.rounds):
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")  # alternate which goes first, too
            for setting in order:
                with servers[setting] as server:
                    results.setdefault((name, setting), []).append(asyncio.run(run(server, SCENARIOS[name], config.vocab_size, 1000 * round_)))
    engine_runs = no_match_in_process(args.artifact, args.provider, max(args.rounds, 4))[0] if "no-match" in args.scenarios.split(",") else None
    copies, provider = copy_against_prefill(args.artifact, args.provider)

    print(f"## Prompt cache on and off, {args.artifact} ({config.n_layer} layers, d_model {config.d_model}), {args.rounds} rounds, "
          "servers alternating, medians over rounds\n")
    for name in args.scenarios.split(","):
        keys = list(results[(name, "on")][0])
        print(f"### {name}\n\n| prompt cache | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
        medians = {}
        for setting in ("on", "off"):
            medians[setting] = {k: statistics.median(r[k] for r in results[(name, setting)]) for k in keys}
            print(f"| {setting} | " + " | ".join(f"{medians[setting][k]:.1f}" for k in keys) + " |")
        on, off = medians["on"], medians["off"]
        if name == "chat":
            ratios = [off[f"turn {t} TTFT ms"] / on[f"turn {t} TTFT ms"] for t in (2, 3, 4)]
            together = sum(off[f"turn {t} TTFT ms"] for t in (2, 3, 4)) / sum(on[f"turn {t} TTFT ms"] for t in (2, 3, 4))
            print(f"\nturns 2-4, time to first token off / on: {', '.join(f'{r:.1f}x' for r in ratios)}; the three together "
                  f"{together:.1f}x (target >= 5x)\n")
        elif name == "shared-512":
            print(f"\nTTFT p50 off / on: {off['TTFT p50 ms'] / on['TTFT p50 ms']:.1f}x (target >= 3x); "
                  f"tokens/s on / off: {on['tokens/s'] / off['tokens/s']:.2f}x (target >= 1)\n")
        elif name == "no-match":
            every = "; ".join(f"{setting} " + ", ".join(f"{r['tokens/s']:.1f}" for r in results[(name, setting)]) for setting in ("on", "off"))
            print(f"\ntokens/s on / off: {on['tokens/s'] / off['tokens/s']:.3f}x (target within 3%); every round: {every}\n")
    if engine_runs:
        on, off = (statistics.median(rate for rate, _ in engine_runs[setting]) for setting in ("on", "off"))
        print(f"### no-match, the engine in process ({len(engine_runs['on'])} rounds a setting, alternating)\n\n"
              "| prompt cache | tokens/s, median | every round | K/V moved between rows per round, median |\n|---|---:|---|---:|")
        for setting, median in (("on", on), ("off", off)):
            rounds = ", ".join(f"{rate:.1f}" for rate, _ in engine_runs[setting])
            moved = statistics.median(moved for _, moved in engine_runs[setting]) / 1e9
            print(f"| {setting} | {median:.1f} | {rounds} | {moved:.2f} GB |")
        print(f"\ntokens/s on / off: {on / off:.3f}x (target within 3%)\n")
    print(f"### K/V copy between rows against prefill, {provider}\n\n| tokens | copy ms | prefill ms | prefill / copy |\n|---:|---:|---:|---:|")
    for n, copy_ms, prefill_ms in copies:
        print(f"| {n} | {copy_ms:.3f} | {prefill_ms:.1f} | {prefill_ms / copy_ms:.0f}x |")
    print(f"\nmachine: {describe(provider)}")


if __name__ == "__main__":
    main()
