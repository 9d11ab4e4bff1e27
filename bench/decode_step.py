"""One ONNX decode step, and a lone stream's greedy generation, through a slots graph as the server runs them; shared
by the benchmarks that time or profile them. No torch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from kvserve.runtime.pool import pool_capacity
from kvserve.runtime.pool import SlotPool
from kvserve.runtime.step import DecoderRuntime


def one_row_pool(runtime: DecoderRuntime, config) -> SlotPool:
    return runtime.new_pool(1, config.n_kv_head, config.head_dim, pool_capacity(config))


def onnx_step(runtime: DecoderRuntime, config, past_len: int, rows: int = 1, with_logits: bool = True):
    """A callable running one decode step of rows rows, each at position past_len (reading past_len + 1 columns);
    with_logits=False reads back the greedy tokens alone, as a greedy server step does. Every call writes the same
    columns, which changes nothing timed."""
    pool = runtime.new_pool(rows, config.n_kv_head, config.head_dim, pool_capacity(config))
    position = np.full(rows, past_len, np.int64)  # (B,)
    mask = np.ones((rows, past_len + 1), np.int64)  # (B, W)
    tokens, no_chunk, logits_index = np.full(rows, 42, np.int64), np.zeros(0, np.int64), np.arange(rows)
    return lambda: runtime.run_slots(pool, tokens, position, mask, no_chunk, 0, 0, logits_index, with_logits)


def slots_generate(runtime: DecoderRuntime, pool: SlotPool, prompt: list[int], n: int) -> list[int]:
    """Greedy through the slots graph as the server runs a lone stream: the prompt as one chunk of row 0, then
    one decode step per token (row 0 reads its own columns), each token the graph's greedy_tokens."""
    scratch = np.array([pool.capacity - 1])
    tokens = runtime.run_slots(pool, np.zeros(1, np.int64), scratch, np.ones((1, 1), np.int64), np.asarray(prompt, np.int64), 0, 0,
                               np.array([1 + len(prompt) - 1]), with_logits=False).greedy_tokens.tolist()
    length = len(prompt)
    while len(tokens) < n:
        position = np.array([length])
        mask = np.ones((1, length + 1), np.int64)  # (1, W): every column up to and including the new token's
        tokens += runtime.run_slots(pool, np.array(tokens[-1:], np.int64), position, mask, np.zeros(0, np.int64), 0, 0, np.array([0]),
                                    with_logits=False).greedy_tokens.tolist()
        length += 1
    return tokens


def best_step_seconds(graphs: dict[str, dict[int, Callable[[], object]]], rounds: int, steps: int) -> dict[tuple[str, int], float]:
    """{(graph, rows): seconds} for graphs = {graph: {rows: a step}}: each round times `steps` calls of every step, the
    graphs in turn (the order reversed every other round); a step's figure is its best round's median."""
    medians: dict[tuple[str, int], list[float]] = {}
    names = list(graphs)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            for rows, step in graphs[name].items():
                samples = []
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    samples.append(time.perf_counter() - start)
                medians.setdefault((name, rows), []).append(statistics.median(samples))
    return {key: min(values) for key, values in medians.items()}
