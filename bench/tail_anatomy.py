"""What makes the long gaps of 16 staggered streams: serving_latency.py's staggered load (16 streams starting 0-1 s
apart, 2 requests each, prompt 32, 64 new tokens, greedy) run through the engine in this process (no gRPC, no client
process), every model call timed with what it carried, for each step token budget in turn; then the same step
shapes timed alone, nothing else running: what a prompt chunk adds to a full batch's step.

Per round and budget: inter-token gap p50 / p99 (issue 51's target: p99/p50 <= 1.4), the joiners' time to
first token (what a smaller budget costs), the share of steps that carried a chunk, the median step at 15-16
rows without and with a chunk, and the step thread's own work between two model calls (p99 and longest: a request's
end and the next one's join move K/V rows there, bench/row_moves.py), which every stream waits for.

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
from decode_step import onnx_step, step_samples  # noqa: E402
from grpc_load import InProcess  # noqa: E402
from machine import describe  # noqa: E402
from serving_latency import gaps, prompt, staggered_load  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.contract.tokenizer import ByteTokenizer  # noqa: E402
from kvserve.runtime.pool import pool_capacity  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402
from kvserve.service.core.engine import Engine  # noqa: E402
from kvserve.service.core.limits import EngineLimits  # noqa: E402

ROWS = 16
FULL = 15  # a step of at least this many rows counts as a full batch's (a joiner holds the 16th row)


class TimedRuntime:
    """The runtime with every slots step recorded as (rows, chunk tokens, seconds) while attached."""

    def __init__(self, runtime: DecoderRuntime):
        self.runtime, self.steps = runtime, []
        self._run_slots = runtime.run_slots
        runtime.run_slots = self._timed

    def _timed(self, pool, input_ids, position_ids, attention_mask, chunk_ids, *rest, **options):
        start = time.perf_counter()
        result = self._run_slots(pool, input_ids, position_ids, attention_mask, chunk_ids, *rest, **options)
        self.steps.append((len(input_ids), len(chunk_ids), time.perf_counter() - start, start))
        return result

    def detach(self) -> None:
        del self.runtime.run_slots  # the class's own method again


async def one_round(timed: TimedRuntime, config, budget: int) -> dict:
    engine = Engine(timed.runtime, config, ByteTokenizer(), EngineLimits(max_batch_size=ROWS, max_queue=64, step_token_budget=budget))
    engine.start()
    try:
        await InProcess.stamps(engine, prompt(0, 32, config.vocab_size), 4)  # warm-up
        timed.steps.clear()
        runs, _ = await staggered_load(lambda ids, new_tokens: InProcess.stamps(engine, ids, new_tokens), config.vocab_size)
    finally:
        await engine.close()
    itl = [gap for stamps in runs for gap in gaps(stamps)]
    ttfts = [stamps[1] - stamps[0] for stamps in runs]
    steps = np.array(timed.steps)  # (N, 4): rows, chunk tokens, seconds, start
    between = (np.diff(steps[:, 3]) - steps[:-1, 2]) * 1e3  # the step thread's own work between two model calls, ms
    full = steps[:, 0] >= FULL

    def median_ms(chosen: np.ndarray) -> float:
        return float(np.median(steps[chosen, 2])) * 1e3 if chosen.any() else float("nan")

    decode_ms, chunk_ms = median_ms(full & (steps[:, 1] == 0)), median_ms(full & (steps[:, 1] > 0))
    p50, p99 = np.percentile(itl, 50) * 1e3, np.percentile(itl, 99) * 1e3
    slowest = steps[np.argsort(steps[:, 2])[-3:][::-1]]
    return {"slowest steps": ", ".join(f"{rows:.0f} rows + {chunk:.0f}: {seconds * 1e3:.1f} ms" for rows, chunk, seconds, _ in slowest),
            "ITL p50 ms": p50, "ITL p99 ms": p99, "p99/p50": p99 / p50, "TTFT p50 ms": np.median(ttfts) * 1e3,
            "steps": len(steps), "with a chunk": f"{np.mean(steps[:, 1] > 0):.0%}", "full, decode ms": decode_ms,
            "full, with chunk ms": chunk_ms, "chunk / decode": chunk_ms / decode_ms,
            "between calls p99 ms": float(np.percentile(between, 99)), "between calls max ms": float(between.max())}


def alone(runtime: DecoderRuntime, config, chunks: list[int], rounds: int, steps: int = 40) -> dict[int, np.ndarray]:
    """{chunk tokens: every step's ms} of a step of 15 decoding rows and a chunk in the 16th (0: 16 decoding rows),
    nothing else running, the shapes taking turns: its median is what the chunk costs, its p99 / p50 how much an
    identical step's time moves on this machine. A round's first step of each shape (after another shape) is left out."""
    pool = runtime.new_pool(ROWS, config.n_kv_head, config.head_dim, pool_capacity(config))
    shapes = {str(chunk): {ROWS: onnx_step(runtime, config, 80, ROWS if chunk == 0 else FULL, False, chunk, pool)}  # past 80: mid-stream
              for chunk in chunks}
    samples = step_samples(shapes, rounds, steps + 1)
    return {chunk: np.array([t for times in samples[(str(chunk), ROWS)] for t in times[1:]]) * 1e3 for chunk in chunks}


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
    timed.detach()
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
