"""How far each decode step is from its memory-bandwidth floor: the bytes a step must read (export/footprint.py:
weights, scales, a row of each looked-up table, the K/V it attends over) over the machine's measured read
bandwidth, against the step's measured time; batch 1 and 16, every graph given, the graphs taking turns.

Read bandwidth is measured here, with numpy summing a 1 GiB buffer, from one thread and from as many threads as ONNX
Runtime runs (one per core): a floor for each (the step's own threads may reach either).

    python bench/decode_floor.py [--artifacts artifacts/gpt2 artifacts/gpt2-int8] [--steps 40] [--rounds 3] [--past 64]

(`kvserve export --preset gpt2 --quantize int8 --out artifacts/gpt2-int8` writes the int8 graph.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import best_step_seconds, onnx_step  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.export.footprint import step_footprint  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

BANDWIDTH_BYTES = 2**30


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes a second numpy reads (a sum over a buffer far larger than the caches), split over threads; best of repeats."""
    buffer = np.ones(BANDWIDTH_BYTES // 4, dtype=np.float32)
    parts = np.array_split(buffer, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))  # numpy releases the GIL while it sums
            best = max(best, buffer.nbytes / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", nargs="+", default=["artifacts/gpt2", "artifacts/gpt2-int8"])
    parser.add_argument("--steps", type=int, default=40, help="steps timed per graph and batch each round (the median counts)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--past", type=int, default=64, help="cached tokens each row attends over (plus its own)")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.past < 0:
        parser.error("--steps and --rounds must be >= 1, --past >= 0")
    cores = os.cpu_count() or 1
    single, parallel = read_bandwidth(1), read_bandwidth(cores)
    graphs = []
    for path in args.artifacts:
        artifact = open_artifact(path)
        config = artifact.config
        if args.past >= config.n_ctx:
            sys.exit(f"{path}: its context holds {config.n_ctx} positions; --past {args.past} needs {args.past + 1}")
        kv_itemsize = np.dtype(artifact.kv_dtype).itemsize
        footprint = step_footprint(artifact.model_path, 2 * config.n_layer * config.n_kv_head * config.head_dim * kv_itemsize)
        runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, "cpu")
        steps = {rows: onnx_step(runtime, config, args.past, rows, with_logits=False) for rows in (1, 16)}
        for step in steps.values():
            step()  # warm
        graphs.append((path, artifact, footprint, steps))
    times = best_step_seconds({path: steps for path, _, _, steps in graphs}, args.rounds, args.steps)
    print(f"## Decode steps against their memory-bandwidth floor: past {args.past} tokens a row, {args.steps} steps a graph and batch "
          f"per round, {args.rounds} rounds alternating, the best round's median\n")
    print(f"read bandwidth (numpy sum of 1 GiB): {single / 1e9:.1f} GB/s from 1 thread, {parallel / 1e9:.1f} GB/s from {cores} "
          f"(ONNX Runtime's threads); a floor for each\n")
    print(f"| graph | rows | read a step MB (weights read whole + table rows + K/V) | floor ms, 1 / {cores} threads | step ms "
          f"| step / floor, 1 / {cores} threads |")
    print("|---|---:|---:|---:|---:|---:|")
    for path, artifact, footprint, steps in graphs:
        quantization = (artifact.manifest.get("quantization") or {}).get("scheme", "none")
        for rows in steps:
            needed = footprint.decode_bytes(rows, args.past + 1)
            floors = needed / single, needed / parallel
            measured = times[(path, rows)]
            kv = rows * (args.past + 1) * footprint.kv_column_bytes
            print(f"| {Path(path).name} ({artifact.dtype}, quantization {quantization}) | {rows} | {needed / 1e6:.1f} "
                  f"({footprint.whole_bytes / 1e6:.1f} + {rows * footprint.lookup_row_bytes / 1e6:.2f} + {kv / 1e6:.1f}) | "
                  f"{floors[0] * 1e3:.2f} / {floors[1] * 1e3:.2f} | {measured * 1e3:.2f} | "
                  f"{measured / floors[0]:.2f}x / {measured / floors[1]:.2f}x |")
    print(f"\nmachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
