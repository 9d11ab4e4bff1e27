"""One artifact's slots steps on two providers side by side: where they part, as a table. Finds a fault that only one
provider shows (it found the H100's stale chunk inputs, bench/results/h100.md): a prompt prefilled in chunks, then
greedy decode steps, each provider fed the same tokens (the first provider's choices); after each step, the largest
logit difference and, per layer, the columns of the row whose K or V differ by more than --columns-over. A longrope
artifact's row crosses its original context where the prompt and steps take it past (Phi-3's refill included), as the
export's parity driver and the server do.

    python bench/provider_diff.py --artifact artifacts/tiny [--providers cpu cuda] [--prompt 12] [--chunk 5] [--steps 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.export.parity_drivers import SlotsDriver  # noqa: E402
from kvserve.runtime import ProviderUnavailable  # noqa: E402
from kvserve.runtime.pool import pool_capacity  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402


def differing_columns(a: np.ndarray, b: np.ndarray, over: float) -> str:
    """Columns (axis 1 of (H, L, d_k)) where a and b differ by more than over, as ranges: "5-9, 12"."""
    columns = np.flatnonzero(np.abs(a - b).max(axis=(0, 2)) > over).tolist()
    ranges, start = [], None
    for i, column in enumerate(columns):
        if start is None:
            start = column
        if i + 1 == len(columns) or columns[i + 1] != column + 1:
            ranges.append(f"{start}" if start == column else f"{start}-{column}")
            start = None
    return ", ".join(ranges) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--providers", nargs=2, default=["cpu", "cuda"], choices=("cpu", "cuda"))
    parser.add_argument("--prompt", type=int, default=12, help="prompt tokens")
    parser.add_argument("--chunk", type=int, default=5, help="prompt tokens a step")
    parser.add_argument("--steps", type=int, default=4, help="greedy decode steps after the prompt")
    parser.add_argument("--columns-over", type=float, default=1e-2, help="a K/V column differs where an entry differs by more")
    args = parser.parse_args()
    if args.prompt < 1 or args.chunk < 1 or args.steps < 0:
        parser.error("--prompt and --chunk must be >= 1, --steps >= 0")
    artifact = open_artifact(args.artifact)
    config = artifact.config
    capacity = args.prompt + args.steps + 2  # the tokens, the scratch column and one to spare
    if capacity > pool_capacity(config):
        parser.error(f"--prompt + --steps must stay within the model's context ({config.n_ctx} tokens)")
    drivers = []
    for provider in args.providers:
        try:
            runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider)
        except ProviderUnavailable as error:
            parser.error(str(error))
        driver = SlotsDriver(runtime, config, capacity, artifact.kv_scales())
        driver.chunk = args.chunk
        drivers.append(driver)
    prompt = [(7 * i) % (config.vocab_size - 3) + 3 for i in range(args.prompt)]
    print(f"## {Path(args.artifact).name} ({artifact.dtype}, {artifact.attention} attention): {args.providers[0]} against "
          f"{args.providers[1]}, a {args.prompt}-token prompt in chunks of {args.chunk}, then {args.steps} decode steps\n")
    print("| after | max abs Δ logits | greedy equal | " + " | ".join(f"L{i} K/V columns over {args.columns_over:g}" for i in range(config.n_layer)) + " |")
    print("|---|---:|:-:|" + "---|" * config.n_layer)
    logits = [driver.prefill([prompt])[0][-1:] for driver in drivers]  # (1, V) each
    for step in range(args.steps + 1):
        rows = [driver.kv()[0] for driver in drivers]  # per layer K then V, each (H_kv, L, d_k)
        columns = [", ".join(f"{'KV'[j]} {differing_columns(rows[0][2 * i + j], rows[1][2 * i + j], args.columns_over)}" for j in (0, 1))
                   for i in range(config.n_layer)]
        greedy = int(logits[0].argmax()) == int(logits[1].argmax())
        label = "prefill" if step == 0 else f"decode {step}"
        print(f"| {label} | {np.abs(logits[0] - logits[1]).max():.2e} | {'yes' if greedy else 'no'} | " + " | ".join(columns) + " |")
        if step < args.steps:
            token = np.array([int(logits[0].argmax())])
            logits = [driver.decode(token) for driver in drivers]
    print(f"\nmachine: {describe(args.providers[1])}")


if __name__ == "__main__":
    main()
