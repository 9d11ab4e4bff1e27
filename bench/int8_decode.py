"""Decode speed of 8-bit weights against float32: the gpt2 preset (124M, random weights), slots layout.

The same exported float32 graph, and that graph quantized by each scheme of export/quantize.py (int8 =
MatMulNBits, what `--quantize int8` writes; int8-dynamic = MatMulInteger, for the comparison). Greedy, a
128-token prompt prefilled in one step, then 128 decode steps with every row decoding; decode tokens/s
counts the steps after the first token. Batch 1 and batch 16 (16 rows, the same prompt each). The graphs
take turns within every round; the best round of each is kept. Also whether a row's numbers depend on the
other rows of its step (they must not: a stream's tokens may not change with the server's load). Prints a
markdown table and the machine.

    python bench/int8_decode.py [--artifact artifacts/gpt2] [--rounds 3] [--threads 0]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.export.onnx_export import save_graph  # noqa: E402
from kvserve.export.pipeline import export_artifact, load_source  # noqa: E402
from kvserve.export.quantize import quantize_model  # noqa: E402
from kvserve.runtime.pool import pool_capacity  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 128, 128
SCHEMES = ("float32", "int8", "int8-dynamic")


def greedy(runtime: DecoderRuntime, pool, rows: int, prompt: np.ndarray, new_tokens: int) -> float:
    """Prefill every row (one step each), then decode new_tokens steps; returns the decode seconds."""
    for row in range(rows):
        logits = prefill(runtime, pool, rows, row, prompt)
    tokens = np.full(rows, int(logits.argmax()), np.int64)
    lengths = np.full(rows, len(prompt), np.int64)
    empty = np.zeros(0, np.int64)
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        mask = np.ones((rows, int(lengths.max()) + 1), np.int64)  # (B, W): every row is as long as the others
        logits = runtime.run_slots(pool, tokens, lengths, mask, empty, 0, 0, np.arange(rows)).logits
        tokens = logits.argmax(-1).astype(np.int64)
        lengths += 1
    return time.perf_counter() - start


def prefill(runtime: DecoderRuntime, pool, rows: int, row: int, prompt: np.ndarray) -> np.ndarray:
    """Write prompt into row (every other row idle at the scratch column); the logits after its last token."""
    return runtime.run_slots(pool, np.zeros(rows, np.int64), np.full(rows, pool.scratch), np.ones((rows, 1), np.int64),
                             prompt, 0, row, np.array([rows + len(prompt) - 1])).logits[0]


def batch_dependence(runtime: DecoderRuntime, config, prompt: np.ndarray, rows: int = 16) -> float:
    """max |logits| difference of one sequence's decode step run alone and run beside rows - 1 others with other
    prompts: 0 up to rounding when every row's numbers depend on that row alone."""
    capacity = pool_capacity(config)
    alone, crowd = runtime.new_pool(1, config.n_head, config.d_head, capacity), runtime.new_pool(rows, config.n_head, config.d_head, capacity)
    token = np.array([int(prefill(runtime, alone, 1, 0, prompt).argmax())])
    for row in range(rows):
        prefill(runtime, crowd, rows, row, prompt if row == 0 else (prompt * (row + 3) + row) % config.vocab_size)
    width = len(prompt) + 1
    lone = runtime.run_slots(alone, token, np.array([len(prompt)]), np.ones((1, width), np.int64), np.zeros(0, np.int64), 0, 0, np.arange(1)).logits
    tokens = np.concatenate([token, np.arange(1, rows)])
    beside = runtime.run_slots(crowd, tokens, np.full(rows, len(prompt)), np.ones((rows, width), np.int64), np.zeros(0, np.int64), 0, 0,
                               np.arange(rows)).logits
    return float(np.abs(lone[0].astype(np.float64) - beside[0]).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="a float32 slots gpt2 artifact; exported if missing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime's default)")
    args = parser.parse_args()

    artifact_dir = Path(args.artifact)
    if not artifact_dir.exists():
        model, source = load_source("gpt2", None)
        export_artifact(model, source, artifact_dir, provider="cpu")
    artifact = open_artifact(artifact_dir)
    if artifact.kv_cache != "slots" or artifact.quantization is not None or artifact.dtype != "float32":
        raise SystemExit(f"{artifact_dir}: need a float32 slots artifact without quantization")
    config = artifact.config
    work = Path(tempfile.mkdtemp(prefix="int8-bench-"))
    graphs = {"float32": artifact.model_path}
    try:
        for scheme in SCHEMES[1:]:
            directory = work / scheme
            directory.mkdir()
            start = time.perf_counter()
            quantized, _ = quantize_model(onnx.load(str(artifact.model_path)), scheme)
            save_graph(quantized, directory)
            print(f"quantized {scheme} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
            graphs[scheme] = directory / "model.onnx"
        runtimes = {name: DecoderRuntime(path, config.n_layer, "float32", "cpu", threads=args.threads)
                    for name, path in graphs.items()}
        prompt = (np.arange(PROMPT_LEN) * 7919 + 13) % config.vocab_size
        best = {(name, rows): float("inf") for name in graphs for rows in args.batch}
        pools = {(name, rows): runtimes[name].new_pool(rows, config.n_head, config.d_head, pool_capacity(config))
                 for name in graphs for rows in args.batch}
        for name in graphs:  # warm-up: first runs pay allocation and kernel selection
            greedy(runtimes[name], pools[(name, 1)], 1, prompt, 4)
        for _ in range(args.rounds):
            for rows in args.batch:
                for name in graphs:  # alternating: drift hits every graph alike
                    seconds = greedy(runtimes[name], pools[(name, rows)], rows, prompt, NEW_TOKENS)
                    best[(name, rows)] = min(best[(name, rows)], seconds)
        dependence = {name: batch_dependence(runtimes[name], config, prompt) for name in graphs}
        sizes = {name: sum(p.stat().st_size for p in Path(path).parent.glob("model.onnx*")) for name, path in graphs.items()}
        print(f"gpt2 preset (124M), slots, greedy, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, best of {args.rounds} rounds, alternating\n")
        print("| weights | graph MB | " + " | ".join(f"batch {r} tokens/s | ms/step" for r in args.batch)
              + " | batch 1 vs float32 | a row's logits alone vs beside 15 others, max abs Δ |")
        print("|---|---:|" + "---:|---:|" * len(args.batch) + "---:|---:|")
        for name in graphs:
            cells = []
            for rows in args.batch:
                step = best[(name, rows)] / (NEW_TOKENS - 1)
                cells.append(f"{rows / step:.1f} | {step * 1e3:.2f}")
            ratio = best[("float32", args.batch[0])] / best[(name, args.batch[0])]
            print(f"| {name} | {sizes[name] / 2**20:.0f} | " + " | ".join(cells) + f" | {ratio:.2f}x | {dependence[name]:.1e} |")
        print(f"\nmachine: {describe('cpu')}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
