"""The running batch and its KV slots: which sequence holds which row of the pool, each row's length, the mask a
step reads, and every change of the pool (a row moved into a freed one when a sequence leaves, on the CPU
provider). One step thread calls it; the scheduler says what each step runs.

Each sequence holds one row of the pool, left-aligned: its token at position p lives in column p, so a
row's length is its own and no row pads another. A step runs, in one model call, one token for every row
that decodes and one chunk of one row's prompt (contract/io_contract.py, the slots layout). A row with
nothing to decode this step (the one whose prompt the chunk belongs to, or a free row below the last
used one) is fed a scratch token written at the pool's last column, which no real token ever occupies.

The pool (kvserve.runtime.pool) is allocated once, for max_rows rows of a whole context (n_ctx columns and the
scratch one), and touched when the batch is made, so no step ever allocates K/V.
Decode rows read only the columns up to the longest of them; a chunk reads its own row. So when no prompt
chunk runs and one row is much longer than the rest (a long prompt now decoding), that row's token goes
through the chunk instead, and the others read their own short widths, not the long one's.

A batch with fixed_decode (the runtime captures CUDA graphs) runs each decode-only step at a bucketed shape
instead (decode_shape: rows and width rounded up to powers of two), every shape bound, and captured, at warm-up
(prepare_decode_shapes); the rows beyond the batch's run scratch tokens. Steps with a chunk keep exact shapes.

A step whose sampled rows all take the graph's greedy token (Sequence.takes_greedy_token) asks the runtime for
those tokens alone, so its logits never leave the device; one row that samples, reports log-probabilities or
records its logits (the load gate's) makes the step read them (needs_logits).

Joining takes the lowest free row; leaving frees a row, and on the CPU provider the last row moves into
it (one row, in place) so rows 0..B-1 stay dense and a step computes no idle row. Under CUDA a free row
stays a hole until the next join fills it, so nothing moves at all: no K/V crosses to the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from kvserve.contract.io_contract import STANDARD
from kvserve.model.config import DecoderConfig
from kvserve.runtime.cuda_graphs import decode_shape, decode_shapes
from kvserve.runtime.pool import SlotPool, pool_capacity
from kvserve.runtime.step import DecoderRuntime

from .sequence import Sequence, StepEvent

log = logging.getLogger(__name__)

StepResults = list[tuple[Sequence, StepEvent | BaseException]]

# A decoding row takes the chunk's place (when free) once it is this much longer than every other row:
# reading its width in every row would cost more than the extra row the decode part then computes.
SOLO_MIN_RATIO, SOLO_MIN_EXTRA = 2, 32


@dataclass
class StepPlan:
    """What one step runs: decided by the scheduler, carried out by the batch."""

    joining: list[Sequence] = field(default_factory=list)  # admitted now: each takes a row before the step
    decode: list[Sequence] = field(default_factory=list)  # rows that decode one token
    chunk: Sequence | None = None  # the row whose prompt advances this step
    chunk_tokens: int = 0  # by this many tokens


def needs_logits(seqs: list[Sequence]) -> bool:
    """Whether a step sampling for seqs must read their logits back, or their greedy tokens will do."""
    return any(seq.needs_logits for seq in seqs)


def advance_each(seqs: list[Sequence], logits: np.ndarray | None, greedy_tokens: np.ndarray,
                 rows: list[int] | None = None) -> StepResults:
    """logits (K, V) (None: a step that returned greedy tokens alone) and greedy_tokens (K,):
    seqs[i]'s are row rows[i] (default: row i), read in place, not copied. One sequence's failure is that sequence's
    alone."""
    results: StepResults = []
    for i, seq in enumerate(seqs):
        row = i if rows is None else rows[i]
        try:
            results.append((seq, seq.advance(None if logits is None else logits[row], greedy_tokens[row])))
        except Exception as exc:  # a bug in one request's sampling or text must not stop the others
            log.exception("sequence %d failed", seq.id)
            seq.finished = True
            results.append((seq, exc))
    return results


class SlotBatch:
    """The rows of the running batch in a SlotPool. Not thread-safe: one step thread calls it."""

    def __init__(self, runtime: DecoderRuntime, config: DecoderConfig, max_rows: int, fixed_decode: bool | None = None):
        """fixed_decode: run decode-only steps at bucketed shapes (runtime.run_decode); default: when the runtime
        captures them as CUDA graphs."""
        self.runtime, self.config, self.max_rows = runtime, config, max_rows
        self.slots: list[Sequence | None] = []  # index = pool row; None = a free row below the last used one
        self.pool: SlotPool = runtime.new_pool(max_rows, config.n_kv_head, config.d_head, pool_capacity(config))
        self.compact = runtime.device == "cpu"  # fill a hole by moving the last row (see the module docstring)
        self.fixed_decode = runtime.captures_decode if fixed_decode is None else fixed_decode
        if self.fixed_decode and runtime.attention != STANDARD:
            raise ValueError("fixed-shape decode steps need a standard slots graph (a fused graph's If cannot be captured)")
        self._cell_bytes = 2 * config.n_layer * config.n_kv_head * config.d_head * np.dtype(runtime.kv_dtype).itemsize

    # --- what the engine and the scheduler read -----------------------------------------------------

    @property
    def rows(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def free_rows(self) -> int:
        return self.max_rows - len(self.rows)

    def row_bytes(self) -> int:
        """Bytes of K/V one sequence holds: its row of the pool, every column, K and V of every layer."""
        return self.pool.capacity * self._cell_bytes

    def kv_bytes(self) -> int:
        return len(self.rows) * self.row_bytes()

    # --- one step --------------------------------------------------------------------------------------

    def run(self, plan: StepPlan) -> StepResults:
        self.release([s for s in self.rows if s.cancelled])
        for seq in plan.joining:
            if not seq.cancelled:
                self._join(seq)
        decode = [s for s in plan.decode if s.slot is not None and not s.cancelled]
        chunk = plan.chunk if plan.chunk is not None and plan.chunk.slot is not None and not plan.chunk.cancelled else None
        results = self._step(decode, chunk, plan.chunk_tokens) if decode or chunk else []
        self.release([s for s in self.rows if s.finished])
        return results

    @staticmethod
    def _solo(decode: list[Sequence]) -> Sequence | None:
        """The decoding row to run through the chunk this step, if one is far longer than the others."""
        if len(decode) < 2:
            return None
        longest, second = sorted(decode, key=lambda s: s.cached_tokens)[-1:-3:-1]
        far = longest.cached_tokens >= SOLO_MIN_RATIO * second.cached_tokens + SOLO_MIN_EXTRA
        return longest if far else None

    def decode_shape(self, width: int) -> tuple[int, int]:
        """The fixed (rows, width) a decode-only step over the batch's rows, reading width columns, runs at."""
        return decode_shape(len(self.slots), width, self.max_rows, self.config.n_ctx)

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every shape decode_shape can return for this pool, smallest first."""
        return decode_shapes(self.max_rows, self.config.n_ctx)

    def close(self) -> None:
        """The batch is no longer used: the runtime forgets the decode steps bound to its pool (and their CUDA graphs)."""
        self.runtime.release_pool(self.pool)

    def prepare_decode_shapes(self) -> None:
        """Bind (and, under CUDA graphs, capture) every decode shape now, on an empty batch, so no request waits
        for a capture; on the thread that will run the steps (the graphs are that thread's). Every row runs a
        scratch token, written at the scratch column no real token is read from."""
        if self.slots:
            raise RuntimeError("decode shapes are prepared on an empty batch")
        scratch = self.pool.capacity - 1
        for rows, width in self.decode_shapes():
            positions = np.full(rows, scratch, dtype=np.int64)  # (B,)
            self.runtime.run_decode(self.pool, np.zeros(rows, np.int64), positions, np.ones((rows, width), np.int64))

    def _decode_fixed(self, decode: list[Sequence]) -> StepResults:
        """A decode-only step at its fixed shape (decode_shape): rows past the batch's, and holes, run a scratch token."""
        width = int(max(seq.cached_tokens for seq in decode)) + 1
        rows, columns = self.decode_shape(width)
        input_ids = np.zeros(rows, dtype=np.int64)  # (B,)
        position_ids = np.full(rows, self.pool.capacity - 1, dtype=np.int64)  # (B,): scratch unless a row decodes
        for seq in decode:
            input_ids[seq.slot] = seq.generated[-1]
            position_ids[seq.slot] = seq.cached_tokens
        attention_mask = (np.arange(columns)[None, :] <= position_ids[:, None]).astype(np.int64)  # (B, W)
        sampled = self.runtime.run_decode(self.pool, input_ids, position_ids, attention_mask, needs_logits(decode))  # B rows
        for seq in decode:
            seq.cached_tokens += 1
        return advance_each(decode, sampled.logits, sampled.greedy_tokens, [seq.slot for seq in decode])

    def _step(self, decode: list[Sequence], chunk: Sequence | None, chunk_tokens: int) -> StepResults:
        if self.fixed_decode and chunk is None:
            return self._decode_fixed(decode)
        # A fused graph reads each row's own columns only, so no row needs to step aside.
        solo = self._solo(decode) if chunk is None and self.runtime.attention == STANDARD else None
        if solo is not None:
            decode = [s for s in decode if s is not solo]
        pool = self.pool
        rows = len(self.slots)
        scratch = pool.capacity - 1
        input_ids = np.zeros(rows, dtype=np.int64)  # (B,): free rows and the chunk's row get a scratch token
        position_ids = np.full(rows, scratch, dtype=np.int64)  # (B,)
        for seq in decode:
            input_ids[seq.slot] = seq.generated[-1]
            position_ids[seq.slot] = seq.cached_tokens  # its position, and the column it is written at
        width = int(max((seq.cached_tokens for seq in decode), default=0)) + 1
        attention_mask = (np.arange(width)[None, :] <= position_ids[:, None]).astype(np.int64)  # (B, W)
        logits_index = [seq.slot for seq in decode]
        start, piece, completes = 0, np.zeros(0, dtype=np.int64), False
        if solo is not None:  # a decode token, fed as a one-token chunk of its own row
            start, piece = solo.cached_tokens, np.array([solo.generated[-1]], dtype=np.int64)
            logits_index.append(rows)
        elif chunk is not None:
            start = chunk.cached_tokens
            piece = np.asarray(chunk.prompt_ids[start : start + chunk_tokens], dtype=np.int64)  # (T,)
            completes = start + len(piece) == len(chunk.prompt_ids)
            if completes:
                logits_index.append(rows + len(piece) - 1)  # the prompt's last token: the first new one follows
        chunk_row = solo if solo is not None else chunk
        decoded = decode + ([solo] if solo is not None else [])  # a token each
        sampling = decoded + ([chunk] if completes else [])  # logits_index's order
        sampled = self.runtime.run_slots(
            pool, input_ids, position_ids, attention_mask, piece, start, chunk_row.slot if chunk_row is not None else 0,
            np.asarray(logits_index, dtype=np.int64), needs_logits(sampling),
        )
        for seq in decoded:
            seq.cached_tokens += 1
        if chunk is not None:
            chunk.cached_tokens = start + len(piece)
        return advance_each(sampling, sampled.logits, sampled.greedy_tokens)

    def fail_all(self, error: BaseException) -> StepResults:
        """Every sequence holding a row fails with error; the batch is empty afterwards."""
        failed = [(s, error) for s in self.rows]
        for seq in self.rows:
            seq.slot = None
        self.slots = []
        return failed

    # --- joins and leaves ---------------------------------------------------------------------------------

    def _join(self, seq: Sequence) -> None:
        free = next((row for row, s in enumerate(self.slots) if s is None), None)
        if free is None:
            free = len(self.slots)
            self.slots.append(None)
        self.slots[free] = seq
        seq.slot = free
        seq.cached_tokens = 0

    def release(self, leaving: list[Sequence]) -> None:
        """Free the rows of sequences that left; on CPU keep rows dense."""
        if not leaving:
            return
        for seq in leaving:
            if seq.slot is not None:
                self.slots[seq.slot] = None
                seq.slot = None
        while True:
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            hole = next((row for row, s in enumerate(self.slots) if s is None), None)
            if hole is None or not self.compact:
                break
            last = self.slots.pop()  # the last row moves into the hole: one row, on the device
            self.pool.move_row(len(self.slots), hole, last.cached_tokens)
            self.slots[hole], last.slot = last, hole
