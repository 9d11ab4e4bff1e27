"""MatMulNBits block sizes: one float32 artifact's graph quantized at each (bits, block size), its decode step timed at
batch 1 and 16, the graphs taking turns; and each graph's mean KL from the float32 graph over a prompt of real text.

The block size is how many input rows of one output column share a scale: bigger blocks read fewer scales and the
CPU kernel rescales less often, smaller ones follow the weights more closely. export/quantize.py's BLOCKS were chosen
from this table (docs/parity.md, "Block sizes").

    python bench/quantize_blocks.py [--artifact artifacts/gpt2] [--blocks 32 64 128 256] [--bits 8 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import best_step_seconds, one_row_pool, onnx_step  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import ArtifactError, open_artifact  # noqa: E402
from kvserve.contract.tolerances import kl_divergence  # noqa: E402
from kvserve.export.quantize import quantize_model  # noqa: E402
from kvserve.export.onnx_export import save_graph  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

PROMPT = "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep."


def prompt_logits(runtime: DecoderRuntime, config, ids: np.ndarray) -> np.ndarray:
    pool = one_row_pool(runtime, config)
    scratch = np.array([pool.scratch])
    return runtime.run_slots(pool, np.zeros(1, np.int64), scratch, np.ones((1, 1), np.int64), ids, 0, 0, 1 + np.arange(len(ids))).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2", help="a float32 artifact")
    parser.add_argument("--blocks", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--bits", nargs="+", type=int, choices=(4, 8), default=[8, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--past", type=int, default=64)
    args = parser.parse_args()
    if any(block < 16 or block & (block - 1) for block in args.blocks):
        parser.error(f"--blocks must be powers of 2 from 16 (MatMulNBits), got {' '.join(map(str, args.blocks))}")
    if args.rounds < 1 or args.steps < 1 or args.past < 0:
        parser.error("--rounds and --steps must be >= 1, --past >= 0")
    try:
        artifact = open_artifact(args.artifact)
    except ArtifactError as exc:
        parser.error(str(exc))
    if artifact.quantization is not None or artifact.dtype != "float32":
        parser.error(f"{args.artifact}: give a float32 artifact, not a quantized or float16 one")
    config = artifact.config
    from kvserve.contract.tokenizer import load_tokenizer

    ids = np.asarray(load_tokenizer(artifact.tokenizer_path).encode(PROMPT), np.int64)
    reference = prompt_logits(DecoderRuntime(artifact.model_path, config.n_layer, "float32", "cpu"), config, ids)
    work = Path(tempfile.mkdtemp(prefix="quantize-blocks-"))
    graphs = []
    for bits in args.bits:
        scheme = {8: "int8", 4: "int4"}[bits]
        for block in args.blocks:
            model, _ = quantize_model(onnx.load(str(artifact.model_path)), scheme, block)
            directory = work / f"{scheme}-{block}"
            directory.mkdir()
            save_graph(model, directory)
            runtime = DecoderRuntime(directory / "model.onnx", config.n_layer, "float32", "cpu")
            kl = float(kl_divergence(reference, prompt_logits(runtime, config, ids)).mean())
            steps = {rows: onnx_step(runtime, config, args.past, rows, with_logits=False) for rows in (1, 16)}
            for step in steps.values():
                step()
            size = sum(p.stat().st_size for p in directory.iterdir())
            graphs.append((f"{scheme}, blocks of {block}", size, kl, steps))
    times = best_step_seconds({name: steps for name, _, _, steps in graphs}, args.rounds, args.steps)
    print(f"## MatMulNBits block sizes, {args.artifact}: decode step past {args.past}, {args.steps} steps a graph and batch per round, "
          f"{args.rounds} rounds alternating, the best round's median; KL over {len(ids)} prompt tokens against the float32 graph\n")
    print("| weights | graph MB | batch 1 ms | batch 16 ms | mean KL from float32 |")
    print("|---|---:|---:|---:|---:|")
    for name, size, kl, _ in graphs:
        print(f"| {name} | {size / 1e6:.0f} | {times[(name, 1)] * 1e3:.2f} | {times[(name, 16)] * 1e3:.2f} | {kl:.2e} |")
    print(f"\nmachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
