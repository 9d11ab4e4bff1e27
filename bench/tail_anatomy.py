"""What makes the long gaps of 16 staggered streams: serving_latency.py's staggered load (16 streams starting 0-1 s
apart, 2 requests each, prompt 32, 64 new tokens, greedy) run through the engine in this process (no gRPC, no client
process), every model call timed with what it carried, for each step token budget in turn; then the same step
shapes timed alone, nothing else running: what a prompt chunk adds to a full batch's step.

Per round and budget: inter-token gap p50 / p99 (serving_latency's target: p99/p50 <= 1.5), the joiners' time to
first token (what a smaller budget costs), the share of steps that carried a chunk, and the median step at 15-16
rows without and with a chunk.

    python bench/tail_anatomy.py [--artifact artifacts/gpt2-int8] [--budgets 32,24,20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from serving_latency import prompt  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.contract.tokenizer import ByteTokenizer  # noqa: E402
from kvserve.runtime.pool import pool_capacity  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402
from kvserve.service.engine import Engine, EngineLimits, GenerationRequest  # noqa: E402

ROWS = 16
FULL = 15  # a step of at least this many rows counts as a full batch's (a joiner holds the 16th row)


class TimedRuntime:
    """The runtime with every slots step recorded as (rows, chunk tokens, seconds)."""

    def __init__(self, runtime: DecoderRuntime):
        self.runtime, self.steps = runtime, []
        self._run_slots = runtime.run_slots
        runtime.run_slots = self._timed

    def _timed(self, pool, input_ids, *args, **kwargs):
        start = time.perf_counter()
        result = self._run_slots(pool, input_ids, *args, **kwargs)
        self.steps.append((len(input_ids), len(args[2]), time.perf_counter() - start))  # args[2]: the chunk's ids
        return result


async def staggered(engine: Engine, vocab: int) -> tuple[list[float], list[float]]:
    """(every inter-token gap s, every request's time to first token s) of the staggered load."""
    gaps, ttfts = [], []

    async def worker(w: int):
        await asyncio.sleep(w / 15)
        for k in range(2):
            stamps = [time.perf_counter()]
            request = GenerationRequest(prompt_ids=tuple(prompt(100 * w + k, 32, vocab)), max_new_tokens=64, ignore_eos=True)
            async for _ in engine.generate(request):
                stamps.append(time.perf_counter())
            ttfts.append(stamps[1] - stamps[0])
            gaps.extend(np.diff(stamps[1:]))

    await asyncio.gather(*(worker(w) for w in range(16)))
    return gaps, ttfts


async def one_round(timed: TimedRuntime, config, budget: int) -> dict:
    engine = Engine(timed.runtime, config, ByteTokenizer(), EngineLimits(max_batch_size=ROWS, max_queue=64, step_token_budget=budget))
    engine.start()
    try:
        async for _ in engine.generate(GenerationRequest(prompt_ids=tuple(prompt(0, 32, config.vocab_size)), max_new_tokens=4)):
            pass  # warm-up
        timed.steps.clear()
        gaps, ttfts = await staggered(engine, config.vocab_size)
    finally:
        await engine.close()
    steps = np.array(timed.steps)  # (N, 3): rows, chunk tokens, seconds
    full = steps[:, 0] >= FULL

    def median_ms(chosen: np.ndarray) -> float:
        return float(np.median(steps[chosen, 2])) * 1e3 if chosen.any() else float("nan")

    decode_ms, chunk_ms = median_ms(full & (steps[:, 1] == 0)), median_ms(full & (steps[:, 1] > 0))
    p50, p99 = np.percentile(gaps, 50) * 1e3, np.percentile(gaps, 99) * 1e3
    slowest = steps[np.argsort(steps[:, 2])[-3:][::-1]]
    return {"slowest steps": ", ".join(f"{rows:.0f} rows + {chunk:.0f}: {seconds * 1e3:.1f} ms" for rows, chunk, seconds in slowest),
            "ITL p50 ms": p50, "ITL p99 ms": p99, "p99/p50": p99 / p50, "TTFT p50 ms": np.median(ttfts) * 1e3,
            "steps": len(steps), "with a chunk": f"{np.mean(steps[:, 1] > 0):.0%}", "full, decode ms": decode_ms,
            "full, with chunk ms": chunk_ms, "chunk / decode": chunk_ms / decode_ms}


def alone(runtime: DecoderRuntime, config, chunks: list[int], rounds: int, steps: int = 40) -> dict[int, np.ndarray]:
    """{chunk tokens: every step's ms} of a step of 15 decoding rows and a chunk in the 16th (0: 16 decoding rows),
    nothing else running, the shapes taking turns: its median is what the chunk costs, its p99 / p50 how much an
    identical step's time moves on this machine."""
    pool = runtime.new_pool(ROWS, config.n_kv_head, config.head_dim, pool_capacity(config))

    def step(chunk: int):
        rows = ROWS if chunk == 0 else FULL
        tokens, positions = np.full(rows, 42, np.int64), np.full(rows, 80, np.int64)  # (B,): past 80, as mid-stream
        ids = np.full(chunk, 7, np.int64)  # (T,)
        sampled = np.arange(rows) if chunk == 0 else np.append(np.arange(rows), rows + chunk - 1)
        return lambda: runtime.run_slots(pool, tokens, positions, None, ids, 0, FULL, sampled, False)

    shapes = {chunk: step(chunk) for chunk in chunks}
    samples: dict[int, list[float]] = {chunk: [] for chunk in chunks}
    for round_ in range(rounds):
        for chunk in chunks if round_ % 2 == 0 else chunks[::-1]:
            shapes[chunk]()  # this shape's first step after another's
            for _ in range(steps):
                start = time.perf_counter()
                shapes[chunk]()
                samples[chunk].append(time.perf_counter() - start)
    return {chunk: np.array(times) * 1e3 for chunk, times in samples.items()}


def cell(key: str, value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if np.isnan(value):
        return "-"  # no such step this round (with a small budget every full-batch step carries a chunk)
    return f"{value:.2f}" if key in ("p99/p50", "chunk / decode") else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2-int8")
    parser.add_argument("--budgets", default="32,24,20", help="step token budgets to compare (kvserve serve --step-token-budget)")
    parser.add_argument("--rounds", type=int, default=3, help="each budget runs the load this many times, the budgets in turn")
    args = parser.parse_args()
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets must be comma-separated integers, got {args.budgets!r}")
    if args.rounds < 1 or any(b <= FULL for b in budgets):
        parser.error(f"--rounds must be >= 1 and every budget > {FULL} (a full batch's decoding rows)")
    artifact = open_artifact(args.artifact)
    config = artifact.config
    if config.n_ctx < 100:
        parser.error(f"{args.artifact}: its context holds {config.n_ctx} positions; the load needs 97")
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu")
    timed = TimedRuntime(runtime)
    results: dict[int, list[dict]] = {}
    for round_ in range(args.rounds):
        for budget in budgets if round_ % 2 == 0 else budgets[::-1]:
            results.setdefault(budget, []).append(asyncio.run(one_round(timed, config, budget)))
    runtime.run_slots = timed._run_slots
    chunk_sizes = sorted({0, 1} | {b - FULL for b in budgets})
    shapes = alone(runtime, config, chunk_sizes, args.rounds)

    print(f"## 16 staggered streams in process, {args.artifact}: every round, budgets in turn\n")
    keys = [key for key in results[budgets[0]][0] if key != "slowest steps"]
    print("| budget | round | " + " | ".join(keys) + " |\n|---:|---:|" + "---:|" * len(keys))
    for budget in budgets:
        for round_, result in enumerate(results[budget], 1):
            cells = [cell(key, result[key]) for key in keys]
            print(f"| {budget} | {round_} | " + " | ".join(cells) + " |")
    print("\nThe slowest three steps of each round (rows in the step + chunk tokens: ms); with the streams in lockstep, one slow "
          "step is a long gap for every stream, and p99 of ~2,000 gaps is about the second slowest step:\n")
    for budget in budgets:
        for round_, result in enumerate(results[budget], 1):
            print(f"- budget {budget}, round {round_}: {result['slowest steps']}")
    print(f"\n## The same step shapes alone (15 decoding rows and a chunk of k tokens; k = 0: 16 rows), {args.rounds} x 40 "
          "steps each, in turn\n")
    print("| chunk tokens | step ms, median | / 16 decoding rows | step p99 / p50 (identical steps) |\n|---:|---:|---:|---:|")
    base = np.median(shapes[0])
    for chunk in chunk_sizes:
        times = shapes[chunk]
        print(f"| {chunk} | {np.median(times):.2f} | {np.median(times) / base:.2f}x | {np.percentile(times, 99) / np.median(times):.2f} |")
    print(f"\nmachine: {describe(runtime.provider)}")


if __name__ == "__main__":
    main()
