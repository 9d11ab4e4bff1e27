"""The peer on the same GPU: kvserve's eager model decoding under torch's CUDA graphs (torch.compile, mode
"reduce-overhead": inductor's fused kernels, replayed as CUDA graphs), at the shapes bench/cuda_graph_decode.py
times ONNX Runtime's captured steps at.

The eager model's own slots step (GPT2/Llama.forward_slots: the same cache layout the artifacts are exported from)
runs one token a row over a pool of fixed shape: every input a static buffer, the read width fixed (the widest
column the run reaches), so one compiled graph serves every step; the K/V each step writes are copied back into the
pool inside the compiled function (the pool and inputs marked static, so torch captures it: it skips CUDA graphs for
a function that mutates inputs it does not know to be static, and says so on stderr). Batch 1 (128-token context, 128 new tokens) and a static batch of 64 rows (32 +
64): ms per step, tokens/s, best of --rounds rounds after the compile and a warm-up. Random weights (the preset's,
seed 0: the artifact's own); timing only, no tokens compared. --backend cudagraphs keeps torch's CUDA graphs without
inductor (for a host without Triton). Prints a markdown table and the machine.

    python bench/torch_graph_decode.py [--preset gpt2] [--rounds 3] [--backend reduce-overhead|cudagraphs|eager]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.model.decoders import build  # noqa: E402
from kvserve.model.presets import preset  # noqa: E402

SHAPES = {"batch 1": (1, 128, 128), "static batch 64": (64, 32, 64)}  # rows, context before decoding, new tokens


def decode_steps(model, rows: int, start: int, new_tokens: int, backend: str, rounds: int) -> float:
    """Best seconds per decode step of rows rows, each from position start for new_tokens steps."""
    config = model.config
    width = start + new_tokens  # every step reads this many columns, its mask saying which are real
    device = next(model.parameters()).device
    pool = model.empty_cache(rows, width + 1)  # (B, H_kv, C, d_k) per layer; the last column is the scratch one
    ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)  # (B, 1)
    positions = torch.full((rows, 1), start, dtype=torch.int64, device=device)  # (B, 1)
    mask = torch.zeros(rows, width, dtype=torch.int64, device=device)  # (B, W)
    chunk = torch.zeros(1, 0, dtype=torch.int64, device=device)  # (1, 0): no prompt chunk
    chunk_mask = torch.ones(1, 1, dtype=torch.int64, device=device)  # (1, 1)
    chunk_slot = torch.zeros(1, dtype=torch.int64, device=device)  # (1,)
    every_row = torch.arange(rows, device=device)  # (B,)
    # Static addresses: a captured graph may write the pool in place and read the inputs where they are (torch skips
    # CUDA graphs for a function that mutates inputs it does not know to be static).
    for tensor in [ids, positions, mask, chunk, chunk_mask, chunk_slot, every_row] + [t for layer in pool for t in layer]:
        torch._dynamo.mark_static_address(tensor)

    def step():
        logits, presents = model.forward_slots(ids, positions, mask, chunk, chunk, chunk_mask, chunk_slot, every_row, pool)
        for (past_k, past_v), (k, v) in zip(pool, presents):
            past_k.copy_(k)
            past_v.copy_(v)
        return logits.argmax(-1)  # (B,): greedy, as the captured ONNX steps return

    run = step if backend == "eager" else torch.compile(step, mode="reduce-overhead") if backend == "reduce-overhead" \
        else torch.compile(step, backend="cudagraphs")
    best = float("inf")
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 compiles and warms up
            positions.fill_(start)
            mask.zero_()
            mask[:, : start + 1] = 1
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(new_tokens):
                tokens = run()
                ids.copy_(tokens[:, None])
                positions.add_(1)
                mask.scatter_(1, positions.clamp(max=width - 1), 1)
            torch.cuda.synchronize()
            if round_:
                best = min(best, (time.perf_counter() - began) / new_tokens)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="reduce-overhead", choices=("reduce-overhead", "cudagraphs", "eager"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device: this peer runs on a GPU")
    model = build(preset(args.preset), seed=0).half().cuda().eval()
    print(f"{args.preset} float16, torch {torch.__version__}, backend {args.backend}, {torch.cuda.get_device_name()}, "
          f"best of {args.rounds} rounds\n")
    print("| shape | rows | ms/step | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, (rows, start, new_tokens) in SHAPES.items():
        torch._dynamo.reset()
        seconds = decode_steps(model, rows, start, new_tokens, args.backend, args.rounds)
        print(f"| {name} | {rows} | {seconds * 1e3:.2f} | {rows / seconds:.1f} |", flush=True)
    print(f"\nmachine: {describe('CUDAExecutionProvider')}")


if __name__ == "__main__":
    main()
