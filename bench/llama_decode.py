"""Decode speed of a ~135M Llama-shaped model (the llama-135m preset: SmolLM2-135M's shape, random weights):
transformers' LlamaForCausalLM.generate vs our eager model vs our ONNX graphs as the server runs them, with
fused attention (GroupQueryAttention, what `kvserve export` writes for this model) and with standard ops.

Batch 1, greedy, a 128-token prompt, 128 new tokens, the same weights everywhere (the preset saved as a
checkpoint and read back by transformers). Decode tokens/s counts the 127 tokens after the first: time(128
tokens) - time(1 token), so prefill is excluded. The implementations take turns within every round; the
best round of each is kept. Before timing, all three must produce the same 16 greedy tokens. Prints a
markdown table and the machine it ran on.

A second table times one server step of each graph with 8 decoding rows (at position 128), alone and with
a 64-token prompt chunk beside them (a ninth row's), the graphs taking turns, best of 5 per round.

    python bench/llama_decode.py [--artifact artifacts/llama-135m] [--standard-artifact artifacts/llama-135m-standard]
                                 [--provider auto|cpu|cuda] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import PROMPT_LEN, NEW_TOKENS, decode_rates  # noqa: E402
from decode_step import one_row_pool, slots_generate  # noqa: E402
from machine import describe  # noqa: E402

from kvserve.contract.artifact import open_artifact  # noqa: E402
from kvserve.export.pipeline import export_artifact, load_source  # noqa: E402
from kvserve.model.checkpoint import save_checkpoint  # noqa: E402
from kvserve.model.generate import generate  # noqa: E402
from kvserve.runtime.pool import pool_capacity  # noqa: E402
from kvserve.runtime.step import DecoderRuntime  # noqa: E402

PRESET = "llama-135m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default=f"artifacts/{PRESET}", help="the preset's fused slots artifact; exported here first if missing")
    parser.add_argument("--standard-artifact", default=f"artifacts/{PRESET}-standard", help="the same with standard attention; exported if missing")
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, source = load_source(PRESET, None, seed=0)
    graphs = {}
    for path, attention in ((args.artifact, "fused"), (args.standard_artifact, "standard")):
        if not Path(path).exists():
            print(f"exporting the {PRESET} preset to {path} ({attention} attention) ...", file=sys.stderr)
            export_artifact(model, source, path, provider=args.provider, attention=attention)
        artifact = open_artifact(path)
        if artifact.manifest["source"] != source or artifact.kv_cache != "slots" or artifact.attention != attention:
            sys.exit(f"{path} is not the {PRESET} preset (seed 0) with the slots KV cache and {attention} attention")
        config = artifact.config
        runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, args.provider)
        graphs[attention] = (runtime, one_row_pool(runtime, config))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, PROMPT_LEN)]

    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf_ids = torch.tensor([prompt])

    def hf_run(n):
        with torch.no_grad():
            return hf.generate(input_ids=hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=None)

    # Same weights, same tokens: check before timing anything.
    theirs = hf_run(16)[0, PROMPT_LEN:].tolist()
    eager = generate(model, [prompt], 16).tokens[0].tolist()
    for attention, (runtime, pool) in graphs.items():
        ours = slots_generate(runtime, pool, prompt, 16)
        assert ours == eager == theirs, f"the implementations disagree ({attention}); not timing ({ours} / {eager} / {theirs})"

    provider = graphs["fused"][0].provider
    names = ["transformers LlamaForCausalLM.generate (torch, KV cache)", "kvserve eager model (torch, KV cache)",
             f"kvserve ONNX, slots, fused attention, as served ({provider})", f"kvserve ONNX, slots, standard attention, as served ({provider})"]
    runners = [hf_run, lambda n: generate(model, [prompt], n)] + [
        lambda n, graph=graph: slots_generate(*graph, prompt, n) for graph in graphs.values()
    ]
    rows = [(name, *rate) for name, rate in zip(names, decode_rates(args.repeats, runners))]
    hf_rate = rows[0][1]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"## Decode, {PRESET} preset ({params:.0f}M, {config.n_layer} layers, {config.n_head} query / {config.n_kv_head} K/V heads), "
          f"batch 1, greedy, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens\n")
    print("| implementation | decode tokens/s | ms/step | vs transformers |")
    print("|---|---:|---:|---:|")
    for name, rate, ms in rows:
        print(f"| {name} | {rate:.1f} | {ms:.2f} | {rate / hf_rate:.3f}x |")
    print("\n## One step with 8 decoding rows, ms (best of 5 a round, rounds alternating)\n")
    print("| graph | 8 rows decode | + a 64-token chunk beside them |")
    print("|---|---:|---:|")
    for attention, (decode_ms, mixed_ms) in batch_steps(graphs, config, args.repeats).items():
        print(f"| slots, {attention} attention | {decode_ms:.2f} | {mixed_ms:.2f} |")
    print(f"\nmachine: {describe(provider)}; torch {torch.__version__} ({torch.get_num_threads()} threads)")


def batch_steps(graphs: dict, config, repeats: int, rows: int = 8, chunk: int = 64) -> dict[str, tuple[float, float]]:
    """Best ms of a step of rows decoding rows, and of one with a chunk-token prompt in row rows beside them."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, config.vocab_size, rows + 1)
    piece = rng.integers(0, config.vocab_size, chunk)
    steps = {}
    for attention, (runtime, _) in graphs.items():
        pool = runtime.new_pool(rows + 1, config.n_kv_head, config.head_dim, pool_capacity(config))
        positions = np.full(rows + 1, PROMPT_LEN)
        positions[rows] = pool.scratch  # the chunk's row: a scratch token, as the batch (service/core/batch.py) feeds it
        mask = (np.arange(PROMPT_LEN + 1)[None] <= positions[:, None]).astype(np.int64)  # (B, W)
        empty = np.zeros(0, np.int64)
        steps[attention] = (
            lambda runtime=runtime, pool=pool, p=positions, m=mask: runtime.run_slots(pool, ids[:rows], p[:rows], m[:rows], empty, 0, 0, np.arange(rows)),
            lambda runtime=runtime, pool=pool, p=positions, m=mask: runtime.run_slots(pool, ids, p, m, piece, PROMPT_LEN, rows, np.arange(rows)),
        )
    best = {attention: [float("inf"), float("inf")] for attention in steps}
    for _ in range(repeats):
        for attention, pair in steps.items():
            for i, step in enumerate(pair):
                step()  # warm: the binding for this shape
                for _ in range(5):
                    start = time.perf_counter()
                    step()
                    best[attention][i] = min(best[attention][i], (time.perf_counter() - start) * 1e3)
    return {attention: tuple(ms) for attention, ms in best.items()}


if __name__ == "__main__":
    main()
