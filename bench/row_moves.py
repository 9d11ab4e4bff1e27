"""What moving K/V between rows costs the step thread on the CPU provider: the pool's copies, exchanges and discards
on an artifact's pool shape, and a request's end and the next one's join through KvRows as the scheduler makes them
(a leave below the last row, its K/V kept for the prompt cache, then a join that matches nothing). Every stream waits
for these: they run between two model calls.

Each figure is the median (and the least) of --repeats runs, for rows holding --tokens columns. A copy into pages the
pool gave back (discard) faults each page in again; into pages still held it is a memcpy. A move or an exchange
remaps the rows' pages where the pool's rows are whole pages (runtime/pool.py), copying nothing.

    python bench/row_moves.py [--artifact artifacts/gpt2] [--tokens 96,1024] [--repeats 15]

Run it from two checkouts (git worktree) to compare their KvRows and SlotPool, or with --copy-rows to move rows by
copying where this checkout would remap their pages.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

from kvserve.contract.artifact import ArtifactError, open_artifact  # noqa: E402
from kvserve.runtime import KvTraffic, SlotPool, pool_capacity  # noqa: E402
from kvserve.service.core.kv_rows import KvRows  # noqa: E402
from kvserve.service.process.gate import _greedy_sequence  # noqa: E402

ROWS = 16


def timed(action, prepare=None, repeats: int = 15) -> tuple[float, float]:
    """(median, least) milliseconds of action(), prepare() run untimed before each."""
    times = []
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


REMAP = {"remap_rows": True}  # --copy-rows: False (a checkout before rows were remapped has no such choice)


def new_pool(config, kv_dtype) -> SlotPool:
    remap = REMAP if "remap_rows" in inspect.signature(SlotPool).parameters else {}
    return SlotPool(ROWS, config.n_kv_head, config.head_dim, pool_capacity(config), config.n_layer, kv_dtype, "cpu", KvTraffic(), **remap)


def move_into_shorter(pool: SlotPool, source: int, destination: int, tokens: int) -> None:
    """A row of `tokens` columns moves into a row that held a fifth of them, as a leave's hole is filled: move_row,
    or (a checkout before it) the copy and trim KvRows made."""
    if hasattr(pool, "move_row"):
        pool.move_row(source, destination, tokens, tokens // 5)
    else:
        pool.copy_columns(source, destination, tokens)
        pool.discard(destination, tokens)


def fill(pool: SlotPool, row: int, tokens: int) -> None:
    for array in pool.arrays:
        array[row, :, :tokens] = 1  # (H, tokens, d_k): committed, as a sequence's writes commit them


def pool_operations(config, kv_dtype, tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    pool = new_pool(config, kv_dtype)
    for row in range(8):
        fill(pool, row, tokens)
    return {
        "copy into pages held": timed(lambda: pool.copy_columns(0, 1, tokens), repeats=repeats),
        "copy into pages given back": timed(lambda: pool.copy_columns(0, 2, tokens), lambda: pool.discard(2), repeats),
        "exchange two rows": timed(lambda: pool.exchange_rows(3, 4, tokens, tokens), repeats=repeats),
        "move into a row holding a fifth": timed(lambda: move_into_shorter(pool, 7, 8, tokens),
                                                 lambda: (pool.discard(8), fill(pool, 8, tokens // 5), fill(pool, 7, tokens)), repeats),
        "give a row back": timed(lambda: pool.discard(5), lambda: fill(pool, 5, tokens), repeats),
        # a checkout before discard(row, keep_columns) gives rows back whole only
        "give back past its first half": (timed(lambda: pool.discard(6, tokens // 2), lambda: fill(pool, 6, tokens), repeats)
                                          if "keep_columns" in inspect.signature(pool.discard).parameters else None),
    }


def request_turnover(config, kv_dtype, tokens: int, repeats: int) -> tuple[float, float]:
    """Rows in use but one, which holds a finished sequence's K/V (the prompt cache); the second row's sequence ends
    (its K/V cached: the last row in use moves into its place, the cached K/V to the end) and a new request that
    matches nothing joins (the cached K/V in the row it takes moves over the older cached row): the release and the
    join KvRows makes on the step thread, as in a server under steady load with the prompt cache on."""
    rows = KvRows(new_pool(config, kv_dtype), "cpu", config.n_layer, prompt_cache=True)
    vocab = config.vocab_size
    serial = iter(range(1, 1 << 30))

    def join_writing() -> None:
        seq = _greedy_sequence(next(serial), list(np.random.default_rng(next(serial)).integers(0, vocab, tokens)), 4)
        rows.join(seq)
        fill(rows.pool, rows.held[seq].index, tokens)
        rows.held[seq].cached_tokens = tokens

    for _ in range(ROWS):
        join_writing()
    last = rows.rows[-1]
    last.finished = True
    rows.release([last])  # the last row cached: a leave then leaves two cached rows, and the join moves one onto the other
    joiner = {}

    def turnover() -> None:
        leaving = rows.rows[1]
        leaving.finished = True
        rows.release([leaving])
        seq = _greedy_sequence(next(serial), list(np.random.default_rng(next(serial)).integers(0, vocab, tokens // 2)), tokens // 2)
        rows.join(seq)
        joiner["seq"] = seq

    def written() -> None:  # untimed: the joiner writes its prompt, as its prefill would
        seq = joiner.pop("seq", None)
        if seq is not None:
            fill(rows.pool, rows.held[seq].index, tokens)
            rows.held[seq].cached_tokens = tokens

    return timed(turnover, written, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="artifacts/gpt2")
    parser.add_argument("--tokens", default="96,1024", help="columns each row holds, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--copy-rows", action="store_true", help="rows moved by copying, not by remapping their pages")
    args = parser.parse_args()
    REMAP["remap_rows"] = not args.copy_rows
    try:
        lengths = [int(n) for n in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    try:
        artifact = open_artifact(args.artifact)
    except ArtifactError as exc:
        parser.error(str(exc))
    config = artifact.config
    if args.repeats < 1 or any(n < 2 or n > config.n_ctx for n in lengths):
        parser.error(f"--repeats must be >= 1 and every --tokens within [2, {config.n_ctx}]")
    kv_dtype = np.dtype(artifact.kv_dtype)
    columns_bytes = 2 * config.n_layer * config.n_kv_head * config.head_dim * kv_dtype.itemsize
    print(f"## K/V row moves on the CPU, {args.artifact} ({config.n_layer} layers, {config.n_kv_head} K/V heads of "
          f"{config.head_dim}, {kv_dtype.name} K/V: {columns_bytes / 1024:.0f} KiB a token), a pool of {ROWS} rows\n")
    how = "copied" if args.copy_rows or "remap_rows" not in inspect.signature(SlotPool).parameters else "remapped where they can be (a side of 256 columns or more, runtime/pool.py REMAP_MIN_COLUMNS)"
    print(f"Rows moved: {how}.\n")
    print("| tokens a row | MB a row | " + " | ".join(["copy into pages held", "copy into pages given back", "exchange two rows",
                                                      "move into a row holding a fifth", "give a row back",
                                                      "give back past its first half", "a request ends, one joins"])
          + " |\n|---:|---:|" + "---:|" * 7)
    for tokens in lengths:
        ops = pool_operations(config, kv_dtype, tokens, args.repeats)
        turnover = request_turnover(config, kv_dtype, tokens, args.repeats)
        cells = [f"{cell[0]:.2f} ({cell[1]:.2f})" if cell else "-" for cell in [*ops.values(), turnover]]
        print(f"| {tokens} | {tokens * columns_bytes / 1e6:.1f} | " + " | ".join(cells) + " |")
    print("\nms: median (least) of each; a request's end and join as KvRows makes them between two model calls")
    print(f"\nmachine: {describe('cpu')}")


if __name__ == "__main__":
    main()
