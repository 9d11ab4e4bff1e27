"""Held-out perplexity of the trained default model: eager float32, its float32 artifact, its quantized artifacts and its
artifacts whose cache holds K/V in fewer bits (export --kv-dtype).

The whole held-out text (every 20th chapter of the King James Bible, kvserve.model.corpus; never trained on)
in consecutive windows of the model's context, each window one prefill through the slots graph with logits
at every position. Also the mean KL divergence of each artifact's next-token distributions from the eager
model's, and their top-1 agreement; and from the openings of the first windows (16 tokens each), how many greedy tokens
each artifact writes before it first departs from the eager model's. Prints a markdown table and the machine.

    python bench/quantization_quality.py [--checkpoint checkpoints/kjv-gpt2] [--schemes int8 int4] [--kv-dtypes float16 int8] [--work DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.contract.io_contract import KV_DTYPES, QUANTIZATIONS  # noqa: E402
from kvserve.export.parity import artifact_greedy  # noqa: E402
from kvserve.model.generate import generate  # noqa: E402
from kvserve.export.pipeline import export_artifact  # noqa: E402
from kvserve.contract.tolerances import kl_divergence, log_softmax  # noqa: E402
from kvserve.model.checkpoint import load_checkpoint  # noqa: E402
from kvserve.model.corpus import load_corpus  # noqa: E402
from kvserve.model.train import token_stream  # noqa: E402
from kvserve.runtime.pool import pool_capacity  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402


class SlotsPrefill:
    """One artifact's session and a one-row pool: a window's logits at every position, in one chunk."""

    def __init__(self, directory: Path):
        artifact = open_artifact(directory)
        config = artifact.config
        self.runtime = DecoderRuntime(artifact.model_path, config.n_layer, "float32", "cpu")
        self.pool = self.runtime.new_pool(1, config.n_kv_head, config.d_head, pool_capacity(config))

    def logits(self, window: np.ndarray) -> np.ndarray:
        """(T, V) for a (T,) window."""
        scratch = np.array([self.pool.scratch])
        return self.runtime.run_slots(self.pool, np.zeros(1, np.int64), scratch, np.ones((1, 1), np.int64), window, 0, 0,
                                      1 + np.arange(len(window))).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/kjv-gpt2")
    parser.add_argument("--schemes", nargs="*", choices=QUANTIZATIONS, default=list(QUANTIZATIONS), help="quantizations to compare (default: all)")
    parser.add_argument("--kv-dtypes", nargs="*", choices=KV_DTYPES[1:], default=list(KV_DTYPES[1:]),
                        help="K/V dtypes to compare, float32 weights (default: all)")
    parser.add_argument("--greedy-windows", type=int, default=16, help="window openings the greedy comparison continues (default 16)")
    parser.add_argument("--work", default=None, help="where the artifacts are written (default: a temporary directory)")
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint).resolve()
    model = load_checkpoint(checkpoint)
    work = Path(args.work or tempfile.mkdtemp(prefix="quantization-quality-"))
    source = {"kind": "checkpoint", "path": str(checkpoint)}
    artifacts = {}
    exports = [("float32", None, None), *((scheme, scheme, None) for scheme in args.schemes),
               *((f"float32, {kv} K/V", None, kv) for kv in args.kv_dtypes)]
    for name, quantize, kv_dtype in exports:
        directory = work / name.replace(", ", "-").replace(" ", "-").replace("/", "")
        export_artifact(model, source, directory, overwrite=True, provider="cpu", tokenizer_dir=checkpoint, quantize=quantize, kv_dtype=kv_dtype)
        artifacts[name] = SlotsPrefill(directory)
        artifacts[name].directory = directory

    from tokenizers import Tokenizer

    stream = token_stream(Tokenizer.from_file(str(checkpoint / "tokenizer.json")), load_corpus().held_out).numpy()
    n_ctx = model.config.n_ctx
    windows = [stream[s : s + n_ctx + 1] for s in range(0, len(stream) - n_ctx - 1, n_ctx)]
    nll = {name: 0.0 for name in ("eager", *artifacts)}
    kl = {name: 0.0 for name in artifacts}
    agree = {name: 0 for name in artifacts}
    count = 0
    for window in windows:
        inputs, targets = window[:-1], window[1:]
        with torch.no_grad():
            ids = torch.from_numpy(inputs)[None]  # (1, T)
            eager, _ = model(ids, torch.ones_like(ids), torch.arange(len(inputs))[None], model.empty_cache(1))
        eager = eager[0].numpy()  # (T, V)
        rows = np.arange(len(targets))
        nll["eager"] -= log_softmax(eager)[rows, targets].sum()
        for name, artifact in artifacts.items():
            logits = artifact.logits(inputs)
            nll[name] -= log_softmax(logits)[rows, targets].sum()
            kl[name] += kl_divergence(eager, logits).sum()
            agree[name] += int((logits.argmax(-1) == eager.argmax(-1)).sum())
        count += len(targets)
    ppl = {name: math.exp(total / count) for name, total in nll.items()}
    openings = [window[:16].tolist() for window in windows[: args.greedy_windows]]
    steps = min(32, n_ctx - 17)
    eager_tokens = generate(model, openings, steps).tokens.numpy()  # (N, steps)
    prefix = {name: np.cumprod(artifact_greedy(artifact.directory, openings, steps, "cpu") == eager_tokens, axis=1).sum(axis=1)
              for name, artifact in artifacts.items()}
    print(f"{checkpoint.name}: held-out perplexity over {count:,} tokens ({len(windows)} windows of {n_ctx}); greedy: {steps} tokens "
          f"after each of the first {len(openings)} windows' 16-token openings, tokens before the first departure from eager\n")
    print("| model | perplexity | vs eager | mean KL from eager | top-1 agreement | greedy prefix (mean) | greedy all equal |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| eager float32 (torch) | {ppl['eager']:.3f} | | | | | |")
    for name in artifacts:
        print(f"| {name} artifact (ONNX Runtime) | {ppl[name]:.3f} | {100 * (ppl[name] / ppl['eager'] - 1):+.2f}% | "
              f"{kl[name] / count:.2e} | {agree[name] / count:.4f} | {prefix[name].mean():.1f} of {steps} | "
              f"{int((prefix[name] == steps).sum())} of {len(openings)} |")
    print(f"\nmachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
