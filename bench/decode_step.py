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


# A lone stream's row: its columns at most (a 40,960-token model's whole row would be 9.4 GB of float32 K/V).
LONE_ROW_COLUMNS = 8192


def one_row_pool(runtime: DecoderRuntime, config) -> SlotPool:
    return runtime.new_pool(1, config.n_kv_head, config.head_dim, min(pool_capacity(config), LONE_ROW_COLUMNS + 1))


def onnx_step(runtime: DecoderRuntime, config, past_len: int, rows: int = 1, with_logits: bool = True, chunk: int = 0,
              pool: SlotPool | None = None):
    """A callable running one decode step of rows rows, each at position past_len (reading past_len + 1 columns),
    and with chunk > 0 a prompt chunk of that many tokens in row `rows` beside them (its last token sampled too);
    with_logits=False reads back the greedy tokens alone, as a greedy server step does. pool: the rows to run in
    (default: a pool of its own, as wide as the step reads plus the scratch column: the server's rows are a whole context
    wide, which the step's reads and writes do not depend on). Every call writes the same columns, which changes nothing timed."""
    if pool is None:
        columns = min(pool_capacity(config), max(past_len + 1, chunk) + 1)
        pool = runtime.new_pool(rows + (chunk > 0), config.n_kv_head, config.head_dim, columns)
    position = np.full(rows, past_len, np.int64)  # (B,)
    mask = np.ones((rows, past_len + 1), np.int64)  # (B, W)
    tokens, chunk_ids = np.full(rows, 42, np.int64), np.full(chunk, 7, np.int64)  # (B,), (T,)
    logits_index = np.append(np.arange(rows), rows + chunk - 1) if chunk else np.arange(rows)
    chunk_slot = rows if chunk else 0  # no chunk: row 0, which the step passes through
    return lambda: runtime.run_slots(pool, tokens, position, mask, chunk_ids, 0, chunk_slot, logits_index, with_logits)


def slots_generate(runtime: DecoderRuntime, pool: SlotPool, prompt: list[int], n: int,
                   on_token: Callable[[int], object] | None = None) -> list[int]:
    """Greedy through the slots graph as the server runs a lone stream: the prompt as one chunk of row 0, then
    one decode step per token (row 0 reads its own columns), each token the graph's greedy_tokens; on_token, where
    given, is called with each token as soon as the step that made it returns."""
    scratch = np.array([pool.scratch])
    tokens = runtime.run_slots(pool, np.zeros(1, np.int64), scratch, np.ones((1, 1), np.int64), np.asarray(prompt, np.int64), 0, 0,
                               np.array([1 + len(prompt) - 1]), with_logits=False).greedy_tokens.tolist()
    if on_token is not None:
        on_token(tokens[0])
    length = len(prompt)
    while len(tokens) < n:
        position = np.array([length])
        mask = np.ones((1, length + 1), np.int64)  # (1, W): every column up to and including the new token's
        tokens += runtime.run_slots(pool, np.array(tokens[-1:], np.int64), position, mask, np.zeros(0, np.int64), 0, 0, np.array([0]),
                                    with_logits=False).greedy_tokens.tolist()
        if on_token is not None:
            on_token(tokens[-1])
        length += 1
    return tokens


def step_samples(graphs: dict[str, dict[int, Callable[[], object]]], rounds: int, steps: int) -> dict[tuple[str, int], list[list[float]]]:
    """{(graph, rows): [each round's step seconds]} for graphs = {graph: {rows: a step}}: each round times `steps` calls
    of every step, the graphs in turn (the order reversed every other round)."""
    samples: dict[tuple[str, int], list[list[float]]] = {}
    names = list(graphs)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            for rows, step in graphs[name].items():
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                samples.setdefault((name, rows), []).append(times)
    return samples


def best_step_seconds(graphs: dict[str, dict[int, Callable[[], object]]], rounds: int, steps: int) -> dict[tuple[str, int], float]:
    """{(graph, rows): seconds}, as step_samples times them: a step's figure is its best round's median."""
    return {key: min(statistics.median(times) for times in per_round) for key, per_round in step_samples(graphs, rounds, steps).items()}
