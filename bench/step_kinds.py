"""Where a loaded server's step time goes, by kind of step: the engine in this process (no gRPC) under N concurrent
streams (prompt 32, 64 new tokens, greedy, 2 requests a stream), every model step timed with what it ran: decode
only at a fixed shape (captured under --cuda-graph), decode only at its own shape, decode rows beside a prompt chunk,
a chunk alone; and the rows the batch held then.

Per kind: steps, their share of the run's step time, p50 / p99 / max ms, rows (p50 / max). Prints markdown tables
and the machine.

    python bench/step_kinds.py --artifact DIR [--provider cuda] [--cuda-graph] [--streams 16] [--max-batch-size 256]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_load import InProcess, prompt_ids  # noqa: E402
from machine import describe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--cuda-graph", action="store_true")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=256)
    args = parser.parse_args()
    local = InProcess(args.artifact, args.provider, args.cuda_graph, args.max_batch_size)
    batch = local.batch
    timings = collections.defaultdict(list)  # kind -> [(seconds, rows)]
    run = batch.run

    def timed(plan, before_model=None):
        chunk = plan.chunk is not None
        decode = bool(plan.decode)
        kind = ("decode + chunk" if decode else "chunk alone") if chunk else ("decode, fixed shape" if batch.fixed_decode else "decode")
        rows = len(batch.kv.slots)
        start = time.perf_counter()
        results = run(plan, before_model)
        timings[kind].append((time.perf_counter() - start, rows))
        return results

    batch.run = timed
    vocab = local.config.vocab_size

    async def load():
        engine = local.engine()
        try:
            async def stream(k):
                for r in range(2):
                    await local.request(engine, prompt_ids(5000 + 2 * k + r, 32, vocab), 64)
            await asyncio.gather(*(stream(k) for k in range(args.streams)))
        finally:
            await engine.close()

    asyncio.run(load())  # a first load: shapes bound, arenas grown
    timings.clear()
    began = time.perf_counter()
    asyncio.run(load())
    wall = time.perf_counter() - began
    total = sum(s for values in timings.values() for s, _ in values)
    print(f"{args.artifact}, {local.runtime.provider}, {args.streams} streams, max batch {args.max_batch_size}, "
          f"cuda graph {'captured' if local.runtime.captures_decode else 'off'}; {wall:.2f} s wall, {total:.2f} s in steps\n")
    print("| step | steps | share of step time | p50 ms | p99 ms | max ms | rows p50 | rows max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, values in sorted(timings.items()):
        seconds = np.array([s for s, _ in values]) * 1e3
        rows = np.array([r for _, r in values])
        print(f"| {kind} | {len(values)} | {seconds.sum() / 1e3 / total:.0%} | {np.percentile(seconds, 50):.2f} | "
              f"{np.percentile(seconds, 99):.2f} | {seconds.max():.2f} | {int(np.median(rows))} | {rows.max()} |")
    print(f"\nmachine: {describe(local.runtime.provider)}")


if __name__ == "__main__":
    main()
