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

A step with constrained rows (a response_format, structured.py) computes their masks on a thread of its own while
the model runs, samples the unconstrained rows first, then each constrained row among the ids its mask allows.

A leaving sequence's row keeps its K/V and the ids it wrote (a cached row, prompt_cache.py); a joining one takes
the free row holding the longest start of its prompt, or has the start copied from a row in use, or takes an empty
row, else the least recently used cached one, and prefills only the rest. On the CPU provider rows 0..B-1 stay
dense, so a step computes no idle row: a leave moves the last row into the hole (and the hole's cached K/V to the
last row's place), a join moves the row it takes to the end of the rows in use; only used columns move, within the
pool's memory. Under CUDA a free row stays where it is (a hole the steps run a scratch token in) and only a prefix
copied from a row in use moves, on the device: no K/V crosses to the host.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvserve.contract.io_contract import STANDARD
from kvserve.contract.config import DecoderConfig
from kvserve.runtime import DecoderRuntime, SlotPool, decode_shape, decode_shapes, pool_capacity

from .prompt_cache import PrefixIndex
from .sequence import Sequence, StepEvent
from .structured import FormatError, TokenMasks

log = logging.getLogger(__name__)

StepResults = list[tuple[Sequence, StepEvent | BaseException]]

# A decoding row takes the chunk's place (when free) once it is this much longer than every other row:
# reading its width in every row would cost more than the extra row the decode part then computes.
SOLO_MIN_RATIO, SOLO_MIN_EXTRA = 2, 32

# A new request takes a prompt prefix from a row in use (a device copy) rather than from the best free row only when
# the row in use holds at least this many more of its tokens. bench/prompt_cache.py measures the copy against the
# prefill it saves (docs/serving.md, "Prompt cache"); on both providers a copy costs far less than computing one
# token, so the line sits at one index block (prompt_cache.BLOCK_TOKENS), the shortest prefix the index finds.
PREFIX_COPY_MIN_TOKENS = {"cpu": 16, "cuda": 16}


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
                 rows: list[int] | None = None, masks=None) -> StepResults:
    """logits (K, V) (None: a step that returned greedy tokens alone) and greedy_tokens (K,):
    seqs[i]'s are row rows[i] (default: row i), read in place, not copied; masks (None: no row is constrained): waits
    for the constrained ones' allowed tokens (SlotBatch._start_masks), called after every unconstrained one has its
    token. One sequence's failure is that sequence's alone."""
    results: StepResults = []
    order = range(len(seqs))
    if masks is not None:  # unconstrained first (a stable sort), while the masks finish
        order = sorted(order, key=lambda i: seqs[i].constraint is not None)
    allowed = None
    for i in order:
        seq = seqs[i]
        row = i if rows is None else rows[i]
        try:
            if seq.constraint is not None and allowed is None and masks is not None:
                allowed = masks()
            mask = allowed.get(seq) if allowed is not None and seq.constraint is not None else None
            results.append((seq, seq.advance(None if logits is None else logits[row], greedy_tokens[row], mask)))
        except FormatError as exc:  # the request's format failed (outgrew its limits): its error, not a bug
            log.info("sequence %d: %s", seq.id, exc)
            seq.finished = True
            results.append((seq, exc))
        except Exception as exc:  # a bug in one request's sampling or text must not stop the others
            log.exception("sequence %d failed", seq.id)
            seq.finished = True
            results.append((seq, exc))
    return results


class SlotBatch:
    """The rows of the running batch in a SlotPool. Not thread-safe: one step thread calls it."""

    def __init__(self, runtime: DecoderRuntime, config: DecoderConfig, max_rows: int, fixed_decode: bool | None = None,
                 prompt_cache: bool = True):
        """fixed_decode: run decode-only steps at bucketed shapes (runtime.run_decode); default: when the runtime
        captures them as CUDA graphs. prompt_cache: finished rows keep their K/V for later prompts that begin alike."""
        self.runtime, self.config, self.max_rows = runtime, config, max_rows
        self.slots: list[Sequence | None] = []  # index = pool row; None = a free row below the last used one
        self.pool: SlotPool = runtime.new_pool(max_rows, config.n_kv_head, config.d_head, pool_capacity(config))
        self.compact = runtime.device == "cpu"  # fill a hole by moving the last row (see the module docstring)
        self.fixed_decode = runtime.captures_decode if fixed_decode is None else fixed_decode
        if self.fixed_decode and runtime.attention != STANDARD:
            raise ValueError("fixed-shape decode steps need a standard slots graph (a fused graph's If cannot be captured)")
        self.prefixes = PrefixIndex() if prompt_cache else None  # every row's tokens, in use or cached
        self.cached: OrderedDict[int, None] = OrderedDict()  # free rows holding K/V, least recently used first
        self.copies_from_busy = prompt_cache and self.pool.copies_rows
        self._cell_bytes = 2 * config.n_layer * config.n_kv_head * config.d_head * np.dtype(runtime.kv_dtype).itemsize
        self._masks: TokenMasks | None = None  # made for the first constrained sequence

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

    def run(self, plan: StepPlan, before_model: Callable[[], None] | None = None) -> StepResults:
        """Carry out plan: one model call (none when nothing is left to run), before_model called just before it."""
        self.release([s for s in self.rows if s.cancelled])
        for seq in plan.joining:
            if not seq.cancelled:
                self._join(seq)
        decode = [s for s in plan.decode if s.slot is not None and not s.cancelled]
        chunk = plan.chunk if plan.chunk is not None and plan.chunk.slot is not None and not plan.chunk.cancelled else None
        results = self._step(decode, chunk, plan.chunk_tokens, before_model) if decode or chunk else []
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
        if self._masks is not None:
            self._masks.close()

    def _start_masks(self, sampling: list[Sequence]):
        """Start computing the allowed tokens of the constrained sequences among sampling, beside the model step that
        follows (and the unconstrained rows' sampling after it); returns a function that waits for them
        ({sequence: the ids it may take, ascending}), or None when none is constrained. A step waits only for what
        is left of them then, each bounded by llguidance's fuel."""
        constrained = [seq for seq in sampling if seq.constraint is not None]
        if not constrained:
            return None
        if self._masks is None:
            self._masks = TokenMasks(self.config.vocab_size)
        return self._masks.start(constrained).result

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

    def _decode_fixed(self, decode: list[Sequence], before_model: Callable[[], None] | None) -> StepResults:
        """A decode-only step at its fixed shape (decode_shape): rows past the batch's, and holes, run a scratch token."""
        width = int(max(seq.cached_tokens for seq in decode)) + 1
        rows, columns = self.decode_shape(width)
        input_ids = np.zeros(rows, dtype=np.int64)  # (B,)
        position_ids = np.full(rows, self.pool.capacity - 1, dtype=np.int64)  # (B,): scratch unless a row decodes
        for seq in decode:
            input_ids[seq.slot] = seq.generated[-1]
            position_ids[seq.slot] = seq.cached_tokens
        attention_mask = (np.arange(columns)[None, :] <= position_ids[:, None]).astype(np.int64)  # (B, W)
        masks = self._start_masks(decode)
        sampled = self.runtime.run_decode(self.pool, input_ids, position_ids, attention_mask, needs_logits(decode), before_model)  # B rows
        for seq in decode:
            seq.cached_tokens += 1
        return advance_each(decode, sampled.logits, sampled.greedy_tokens, [seq.slot for seq in decode], masks)

    def _step(self, decode: list[Sequence], chunk: Sequence | None, chunk_tokens: int,
              before_model: Callable[[], None] | None) -> StepResults:
        if self.fixed_decode and chunk is None:
            return self._decode_fixed(decode, before_model)
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
        attention_mask = None  # a fused graph reads each row's own length from its position
        if self.runtime.attention == STANDARD:
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
        masks = self._start_masks(sampling)
        sampled = self.runtime.run_slots(
            pool, input_ids, position_ids, attention_mask, piece, start, chunk_row.slot if chunk_row is not None else 0,
            np.asarray(logits_index, dtype=np.int64), needs_logits(sampling), before_model,
        )
        for seq in decoded:
            seq.cached_tokens += 1
        if chunk is not None:
            chunk.cached_tokens = start + len(piece)
        return advance_each(sampling, sampled.logits, sampled.greedy_tokens, masks=masks)

    def fail_all(self, error: BaseException) -> StepResults:
        """Every sequence holding a row fails with error; the batch is empty afterwards, and, the pool's contents being
        unknown after a failed step, so is the prompt cache."""
        failed = [(s, error) for s in self.rows]
        for seq in self.rows:
            seq.slot = None
        self.slots = []
        self.cached.clear()
        if self.prefixes is not None:
            self.prefixes.clear()
        return failed

    # --- joins and leaves ---------------------------------------------------------------------------------

    def cached_rows(self) -> int:
        """Free rows that hold a finished sequence's K/V for the prompt cache."""
        return len(self.cached)

    def forget_cached(self) -> None:
        """Free rows forget what they hold (the warm-up's rows, say): nothing is matched against them any more."""
        for row in self.cached:
            self.prefixes.remove(row)
        self.cached.clear()

    def _best_matches(self, prompt: list[int]) -> tuple[tuple[int | None, int], tuple[int | None, int]]:
        """((free row, tokens), (row in use, tokens)): the rows holding the longest start of prompt, the last prompt
        token left out (it is always computed: its logits give the first new token)."""
        if self.prefixes is None:
            return (None, 0), (None, 0)
        reusable = len(prompt) - 1
        free, busy = (None, 0), (None, 0)
        for row, shared in self.prefixes.matches(prompt).items():
            holder = self.slots[row] if row < len(self.slots) else None
            if holder is None:
                usable = min(shared, reusable, len(self.prefixes.tokens(row)))
                if usable > free[1]:
                    free = (row, usable)
            elif self.copies_from_busy:
                usable = min(shared, reusable, holder.cached_tokens)  # a row in use holds its K/V up to there
                if usable > busy[1]:
                    busy = (row, usable)
        confirmed = []
        for row, length in (free, busy):
            length = self.prefixes.confirm(row, prompt, length) if row is not None else 0
            confirmed.append((row, length) if length else (None, 0))
        return confirmed[0], confirmed[1]

    def _prefix_source(self, prompt: list[int]) -> tuple[int | None, int, bool]:
        """(the row to take the start of prompt from, how many tokens, whether that row is in use): a row in use only
        when it holds at least PREFIX_COPY_MIN_TOKENS more than the best free row (its columns are copied)."""
        (free, free_len), (busy, busy_len) = self._best_matches(prompt)
        if busy is not None and busy_len >= free_len + PREFIX_COPY_MIN_TOKENS[self.runtime.device]:
            return busy, busy_len, True
        return free, free_len, False

    def reusable_prompt_tokens(self, seq: Sequence) -> int:
        """How many of seq's prompt tokens it would find in the cache if it joined now (the scheduler sizes its first
        chunk by what is left)."""
        return self._prefix_source(seq.prompt_ids)[1]

    def _victim(self) -> int:
        """The free row a new sequence overwrites: the lowest that holds nothing, else the least recently used."""
        active = {row for row, s in enumerate(self.slots) if s is not None}
        empty = next((row for row in range(self.max_rows) if row not in active and row not in self.cached), None)
        return empty if empty is not None else next(iter(self.cached))

    def _join(self, seq: Sequence) -> None:
        """seq takes a row: the free row holding the longest start of its prompt, or a free row into which the rows in
        use give a longer one (copied on the device), else the victim; it then prefills only the rest. On CPU the row
        it computes in is the one after the last (rows stay dense): the row chosen moves there, and what that row held
        moves to the victim's place."""
        source, reused, take_busy = self._prefix_source(seq.prompt_ids)
        busy = source if take_busy else None
        pool = self.pool
        if self.compact:
            row = len(self.slots)
            if not take_busy and source is not None:
                if source != row:  # row's own cached K/V (if any) goes where the chosen one was
                    pool.exchange_rows(source, row, reused, len(self.prefixes.tokens(row)) if row in self.cached else 0)
                    self._swap_cached(source, row)
            elif row in self.cached:
                victim = self._victim()
                if victim != row:
                    pool.copy_columns(row, victim, len(self.prefixes.tokens(row)))
                    self._drop_cached(victim)
                    self._swap_cached(row, victim)
        else:
            row = source if not take_busy and source is not None else self._victim()
        if take_busy:
            pool.copy_columns(busy, row, reused)
        self._drop_cached(row)
        if self.prefixes is not None:
            self.prefixes.put(row, seq.prompt_ids)  # its K/V up to seq.cached_tokens, as the prefill writes them
        while len(self.slots) <= row:
            self.slots.append(None)
        self.slots[row] = seq
        seq.slot = row
        seq.cached_tokens = seq.reused_prompt_tokens = reused

    def _drop_cached(self, row: int) -> None:
        """Row no longer holds a cached sequence (it is taken, or overwritten)."""
        if self.cached.pop(row, False) is not False:
            self.prefixes.remove(row)

    def _swap_cached(self, a: int, b: int) -> None:
        """Rows a and b traded contents: their index entries and their places in the least-recently-used order follow."""
        if self.prefixes is None:
            return
        self.prefixes.swap(a, b)
        self.cached = OrderedDict((b if row == a else a if row == b else row, None) for row in self.cached)

    def release(self, leaving: list[Sequence]) -> None:
        """Free the rows of sequences that left, each keeping what it wrote for the prompt cache; on CPU keep the rows
        in use dense."""
        if not leaving:
            return
        for seq in leaving:
            if seq.slot is None:
                continue
            row = seq.slot
            self.slots[row] = None
            seq.slot = None
            if self.prefixes is not None:
                if seq.cached_tokens:
                    self.prefixes.put(row, (seq.prompt_ids + seq.generated)[: seq.cached_tokens])  # exactly what it wrote
                    self.cached[row] = None
                    self.cached.move_to_end(row)
                else:
                    self.prefixes.remove(row)
        while True:
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            hole = next((row for row, s in enumerate(self.slots) if s is None), None)
            if hole is None or not self.compact:
                break
            last = self.slots.pop()  # the last row moves into the hole, and the hole's cached K/V (if any) to its place
            source = len(self.slots)
            held = len(self.prefixes.tokens(hole)) if self.prefixes is not None and hole in self.cached else 0
            if held:
                self.pool.exchange_rows(source, hole, last.cached_tokens, held)
            else:
                self.pool.copy_columns(source, hole, last.cached_tokens)
                self._drop_cached(hole)
            self._swap_cached(source, hole)
            self.slots[hole], last.slot = last, hole
