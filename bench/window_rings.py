"""K/V memory of sliding-window models: rows whose windowed layers are rings (DecoderConfig.kv_ring) against rows that
keep every layer's whole context (the layout before rings), at published shapes, for rows x tokens.

Each layout is the serving pool itself (runtime.SlotPool, as SlotBatch makes it on the CPU provider: reserved, committed
as written) with its rows' columns written where a step writes each position (a ring layer's position p in column
p mod R, a whole-context layer's in column p); the bytes are the process's resident memory before and after, beside
what the K/V budget counts for those rows (service/core/kv_rows.py KvRows.tokens_bytes). The layers' K/V geometry (layers,
K/V heads, head_dim, window, which layers slide) is the published model's; nothing else of the model matters here.

    python bench/window_rings.py [--rows 8] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.config import DecoderConfig  # noqa: E402
from kvserve.runtime.pool import KvTraffic, SlotPool  # noqa: E402
from kvserve.service.core.kv_rows import KvRows  # noqa: E402

# K/V geometry of published checkpoints (their config.json): layers, K/V heads, head_dim, window, sliding layers
SHAPES = {
    "Gemma-3-4B": DecoderConfig(model_type="gemma3_text", vocab_size=8, eos_token_ids=(1,), n_ctx=131072, d_model=8, n_head=8, n_kv_head=4, head_dim=256,
                                n_layer=34, d_mlp=8, sliding_window=1024, sliding_layers=tuple(i for i in range(34) if (i + 1) % 6)),
    "Gemma-3-1B": DecoderConfig(model_type="gemma3_text", vocab_size=8, eos_token_ids=(1,), n_ctx=32768, d_model=8, n_head=4, n_kv_head=1, head_dim=256,
                                n_layer=26, d_mlp=8, sliding_window=512, sliding_layers=tuple(i for i in range(26) if (i + 1) % 6)),
    "Mistral-7B-v0.1": DecoderConfig(model_type="mistral", vocab_size=8, eos_token_ids=(1,), n_ctx=32768, d_model=8, n_head=32, n_kv_head=8, head_dim=128,
                                     n_layer=32, d_mlp=8, sliding_window=4096, sliding_layers=tuple(range(32))),
}


def resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def measure(config: DecoderConfig, rows: int, tokens: int, rings: bool) -> tuple[int, int]:
    """(resident bytes the pool's rows take once each holds tokens positions, what KvRows counts for them)."""
    ring = config.kv_ring if rings else None
    columns = {} if ring is None else {layer: ring + 1 for layer in config.ring_layers()}
    capacity = config.n_ctx + 1
    gc.collect()
    before = resident()
    pool = SlotPool(rows, config.n_kv_head, config.head_dim, capacity, config.n_layer, np.float16, "cpu", KvTraffic(), columns, config.n_ctx)
    positions = np.arange(tokens)
    for index, array in enumerate(pool.arrays):
        written = np.unique(positions % ring) if pool.rings[index] else positions  # the columns steps write
        for row in range(rows):
            array[row, :, written] = 1  # (H_kv, columns, d_k): committed as a step's write commits it
    taken = resident() - before
    counted = rows * KvRows(pool, "cpu", config.n_layer).tokens_bytes(tokens)
    del pool
    gc.collect()
    return taken, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    print(f"K/V of {args.rows} rows x {args.tokens} tokens, float16 K/V (bytes scale with the K/V dtype alike)\n")
    print("| shape | window, sliding layers | whole-context rows (before) | ring rows | ratio | counted by the budget (rings) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, config in SHAPES.items():
        config = replace(config, n_ctx=max(config.n_ctx, args.tokens + 1))
        whole, _ = measure(config, args.rows, args.tokens, rings=False)
        ringed, counted = measure(config, args.rows, args.tokens, rings=True)
        print(f"| {name} | {config.sliding_window}, {len(config.sliding_layers)} of {config.n_layer} | {whole / 1e9:.2f} GB | "
              f"{ringed / 1e9:.2f} GB | {ringed / whole:.3f}x | {counted / 1e9:.2f} GB |")
    print(f"\n{describe('CPUExecutionProvider')}")


if __name__ == "__main__":
    main()
