"""The rows of the KV pool: which sequence holds which row, where a joining sequence goes, what a leaving one leaves
behind, and the prompt cache over the free rows (vLLM's KV-cache manager plays this part there). The scheduler
(scheduler.py) owns it and asks it for rows; the batch (batch.py) runs steps in the rows a plan hands it; every row
move is made here, through the pool.

Each sequence holds one row of the pool, left-aligned: its token at position p lives in column p, so a row's length is
its own and no row pads another (a sliding-window layer's rows are rings of its window instead: position p in column
p mod R, so such a row hands on only the prefixes its rings still hold, _ring_allows). The pool
(kvserve.runtime.SlotPool) is allocated once, for max_rows rows of a whole context (n_ctx columns and the scratch one),
so no step ever allocates K/V. On the CPU provider its memory is
committed as tokens are written and a row emptied gives its pages back (discard): a row that leaves with nothing kept
for the prompt cache, a row whose contents moved; a cached row taken by a sequence that reuses none of it gives back
what lies past the most that sequence may write (its reservation), and a row a move fills gives back what lies past
the columns moved. So the K/V held follows the tokens live and cached, not rows x context; a row keeps at most the
pages of the longest contents it held since it was last emptied, and a sequence's row at most its reservation's
beyond what it wrote. A long row that changes place trades pages with the row it goes to where the pool's rows are
whole pages (runtime/pool.py move_row, exchange_rows, REMAP_MIN_COLUMNS: no byte copied); else its columns are copied
into pages still held wherever they can be: into pages given back, every page faults in again (a 7 MB row 10-20x
slower, bench/row_moves.py), and the step thread's moves are a gap in every stream.

A budget (serve --kv-cache-memory) bounds that memory: a sequence is given a row only when the most it can hold (its
prompt and max_new_tokens, every layer's K and V) fits beside what the sequences in rows may hold (fits), so no step
can outgrow it; the prompt cache's rows count too, and are the first memory given back, least recently used first,
when a sequence joins or the cache outgrows what the budget leaves (settle).

A leaving sequence's row keeps its K/V and the ids it wrote (a cached row, prompt_cache.py); a joining one takes the
free row holding the longest start of its prompt, or has the start copied from a row in use, or takes an empty row,
else the least recently used cached one, and prefills only the rest. Rows 0..B-1 stay dense, so a step computes no
idle row: a leave moves the last row into the hole (and the hole's cached K/V to the last row's place), a join moves
the row it takes to the end of the rows in use; within the pool's memory, a long row by trading pages on the CPU,
else only used columns copied (under CUDA on the device, cudaMemcpy2D, runtime/pool.py: no K/V crosses to the host).
Only where no CUDA runtime can be loaded for those copies does a free row stay where it is, a hole the steps run a
scratch token in. (An idle row costs a standard graph its bucketed width of reads; a fused graph's operator reads the
idle row's whole width, every layer, every step.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvserve.contract.config import RING_SLACK
from kvserve.runtime import SlotPool

from .prompt_cache import PrefixIndex
from .sequence import Sequence

log = logging.getLogger(__name__)

# A new request takes a prompt prefix from a row in use (a device copy) rather than from the best free row only when
# the row in use holds at least this many more of its tokens. bench/prompt_cache.py measures the copy against the
# prefill it saves (docs/serving.md, "Prompt cache"); on both providers a copy costs far less than computing one
# token, so the line sits at one index block (prompt_cache.BLOCK_TOKENS), the shortest prefix the index finds.
PREFIX_COPY_MIN_TOKENS = {"cpu": 16, "cuda": 16}


@dataclass(eq=False)
class HeldRow:
    """A sequence's hold on one row of the pool: made when it joins, dropped when it leaves (KvRows), moved with the row;
    the batch counts the columns each step writes into it."""

    index: int  # the pool row
    cached_tokens: int = 0  # columns holding the K/V of its tokens, in order: the next token's position
    written_columns: int = 0  # columns written so far, drafts it did not keep included (those are never read)

    @property
    def overshoot(self) -> int:
        """Columns past cached_tokens holding drafts it did not keep (until its later tokens overwrite them)."""
        return max(self.written_columns - self.cached_tokens, 0)


class KvRows:
    """The rows of one SlotPool and the sequences in them. Not thread-safe: the step thread calls it."""

    def __init__(self, pool: SlotPool, device: str, n_layer: int, prompt_cache: bool = True, budget_bytes: int | None = None):
        """device: where the pool lives ("cpu": rows are kept dense); prompt_cache: finished rows keep their K/V for later
        prompts that begin alike; budget_bytes: what the K/V of the sequences in rows and the cached rows may take
        together (None: no bound but the pool's, as under CUDA, where the pool is allocated whole)."""
        self.pool, self.device, self.max_rows = pool, device, pool.rows
        self.slots: list[Sequence | None] = []  # index = pool row; None = a free row below the last used one
        self.held: dict[Sequence, HeldRow] = {}  # every sequence in a row, and what it holds there
        # Fill a hole by moving the last row (see the module docstring): on the CPU, and under CUDA where rows can be
        # copied on the device. Then a step computes no idle row: a fused graph's idle row reads its whole width.
        self.compact = device == "cpu" or pool.copies_rows
        self.prefixes = PrefixIndex() if prompt_cache else None  # every row's tokens, in use or cached
        # free rows holding K/V, least recently used first, each with the bytes its indexed tokens take: the cache's size
        # is asked every step (the metrics' gauge) and at every join and leave (the budget), so no row is measured again
        self.cached: OrderedDict[int, int] = OrderedDict()
        self.copies_from_busy = prompt_cache and pool.copies_rows
        self.commits_as_written = device == "cpu"  # the pool's memory follows what rows hold (runtime/pool.py)
        _, n_kv_head, _, d_head = pool.shape
        self.token_bytes = 2 * n_layer * n_kv_head * d_head * np.dtype(pool.kv_dtype).itemsize  # K and V of one token, every layer
        # of which the ring layers' (runtime/pool.py): a row holds at most pool.ring of their tokens
        self.ring_token_bytes = sum(pool.rings) * pool.column_bytes
        self.budget_bytes = budget_bytes
        self._reserved = 0  # the most the sequences in rows may hold (reservation(seq) each)

    @property
    def rows(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def free_rows(self) -> int:
        return self.max_rows - len(self.rows)

    def row_bytes(self) -> int:
        """Bytes of K/V one sequence holds: its row of the pool, every column, K and V of every layer."""
        return sum(columns for columns in self.pool.columns) * self.pool.column_bytes

    def tokens_bytes(self, tokens: int) -> int:
        """Bytes of K/V a row's first `tokens` positions take: every layer's, a ring layer's at most its ring's."""
        ring = self.pool.ring
        return tokens * (self.token_bytes - self.ring_token_bytes) + (tokens if ring is None else min(tokens, ring)) * self.ring_token_bytes

    def _holding(self, tokens: int) -> int:
        """Bytes of K/V a row holding tokens takes: theirs where the pool commits memory as written (to a page), else
        the whole row."""
        return self.tokens_bytes(tokens) if self.commits_as_written else self.row_bytes()

    def held_bytes(self, seq: Sequence) -> int:
        """Bytes of K/V seq holds."""
        return self._holding(self.held[seq].cached_tokens)

    def kv_bytes(self) -> int:
        """Bytes of K/V the sequences in rows hold."""
        return sum(self.held_bytes(seq) for seq in self.rows)

    @staticmethod
    def reservation_tokens(seq: Sequence) -> int:
        """The most positions seq can write: its prompt and every token it may generate (the last is never written)."""
        return len(seq.prompt_ids) + seq.max_new_tokens

    def reservation(self, seq: Sequence) -> int:
        """The most K/V seq can hold: the bytes of its reservation_tokens."""
        return self.tokens_bytes(self.reservation_tokens(seq))

    def reserved_bytes(self) -> int:
        return self._reserved

    def fits(self, *seqs: Sequence) -> bool:
        """Whether seqs may take rows now under the budget (cached rows give way to them)."""
        return self.budget_bytes is None or self._reserved + sum(self.reservation(seq) for seq in seqs) <= self.budget_bytes

    def budget_tokens(self) -> int | None:
        """Tokens of K/V one row may hold under the budget (None: no budget); a model whose every layer is a ring holds
        any length once its rings fit (a whole context: the pool's)."""
        if self.budget_bytes is None:
            return None
        budget, ring, whole = self.budget_bytes, self.pool.ring, self.token_bytes - self.ring_token_bytes
        if ring is None or budget < ring * self.token_bytes:
            return budget // self.token_bytes
        return self.pool.capacity - 1 if whole == 0 else ring + (budget - ring * self.token_bytes) // whole

    def settle(self) -> None:
        """Give back cached rows, least recently used first, while the cache takes more than the budget leaves."""
        if self.budget_bytes is None:
            return
        while self.cached and self._reserved + self.cached_bytes() > self.budget_bytes:
            row = next(iter(self.cached))
            self._drop_cached(row)
            self.pool.discard(row)

    def cached_bytes(self) -> int:
        """Bytes of K/V the prompt cache's rows hold."""
        return sum(self.cached.values())

    def clear(self) -> list[Sequence]:
        """Every sequence leaves its row, the pool's contents being unknown (a step failed): the prompt cache forgets
        every row too. Returns the sequences that held rows."""
        held = self.rows
        for row in range(self.max_rows):  # a join writes over an empty row's pages as they are: nothing stale stays
            self.pool.discard(row)
        self.held.clear()
        self.slots = []
        self._reserved = 0
        self.cached.clear()
        if self.prefixes is not None:
            self.prefixes.clear()
        self.publish_events()
        return held

    def publish_events(self) -> None:
        """Send the prompt cache's changes as a KV event message (kv_events.py), if it publishes: when due, or at once when
        no sequence holds a row (no step may follow soon)."""
        if self.prefixes is not None and self.prefixes.events is not None:
            try:
                self.prefixes.events.flush(now=not self.rows)
            except Exception:  # events are advice to a router: their failure never fails a step
                log.exception("KV events not published; serving goes on")

    def cached_rows(self) -> int:
        """Free rows that hold a finished sequence's K/V for the prompt cache."""
        return len(self.cached)

    def forget_cached(self) -> None:
        """Free rows forget what they hold (the warm-up's rows, say): nothing is matched against them any more, and
        their memory goes back."""
        for row in self.cached:
            self.prefixes.remove(row)
            self.pool.discard(row)
        self.cached.clear()

    def _best_matches(self, prompt: list[int], kind: int) -> tuple[tuple[int | None, int], tuple[int | None, int]]:
        """((free row, tokens), (row in use, tokens)): the rows of kind (prompt_cache.py) holding the longest start of
        prompt, the last prompt token left out (it is always computed: its logits give the first new token)."""
        if self.prefixes is None:
            return (None, 0), (None, 0)
        reusable = len(prompt) - 1
        free, busy = (None, 0), (None, 0)
        for row, shared in self.prefixes.matches(prompt, kind).items():
            in_use = row < len(self.slots) and self.slots[row] is not None
            if in_use and not self.copies_from_busy:
                continue
            usable = self._ring_allows(min(shared, reusable, self._written(row)), row)
            if in_use and usable > busy[1]:
                busy = (row, usable)
            elif not in_use and usable > free[1]:
                free = (row, usable)
        confirmed = []
        for row, length in (free, busy):
            length = self._ring_allows(self.prefixes.confirm(row, prompt, length), row) if row is not None else 0  # shortened: the rings again
            confirmed.append((row, length) if length else (None, 0))
        return confirmed[0], confirmed[1]

    def _written(self, row: int) -> int:
        """Positions of K/V row holds: a row in use up to its sequence's cached tokens, a cached row all it wrote."""
        holder = self.slots[row] if row < len(self.slots) else None
        return len(self.prefixes.tokens(row)) if holder is None else self.held[holder].cached_tokens

    def _ring_allows(self, usable: int, row: int) -> int:
        """usable, or 0 where row no longer holds the window of its first `usable` positions: its ring layers' later
        positions overwrote earlier ones (contract/config.py RING_SLACK: a prefix that stops at most that many positions
        short of the row's end is still whole)."""
        ring, written = self.pool.ring, self._written(row)
        holder = self.slots[row] if row < len(self.slots) else None
        if holder is not None:  # drafts it did not keep overwrote its ring's earliest columns as far as they reached
            written = max(written, self.held[holder].written_columns)
        return usable if ring is None or written <= ring or usable >= written - RING_SLACK else 0

    def _prefix_source(self, prompt: list[int], kind: int) -> tuple[int | None, int, bool]:
        """(the row to take the start of prompt from, how many tokens, whether that row is in use): a row in use only
        when it holds at least PREFIX_COPY_MIN_TOKENS more than the best free row (its columns are copied)."""
        (free, free_len), (busy, busy_len) = self._best_matches(prompt, kind)
        if busy is not None and busy_len >= free_len + PREFIX_COPY_MIN_TOKENS[self.device]:
            return busy, busy_len, True
        return free, free_len, False

    def reusable_prompt_tokens(self, seq: Sequence) -> int:
        """How many of seq's prompt tokens it would find in the cache if it joined now (join takes them)."""
        return self._prefix_source(seq.prompt_ids, seq.long_rope)[1]

    def _victim(self) -> int:
        """The free row a new sequence overwrites: the lowest that holds nothing, else the least recently used."""
        active = {row for row, s in enumerate(self.slots) if s is not None}
        empty = next((row for row in range(self.max_rows) if row not in active and row not in self.cached), None)
        return empty if empty is not None else next(iter(self.cached))

    def join(self, seq: Sequence) -> None:
        """seq takes a row: the free row holding the longest start of its prompt, or a free row into which the rows in
        use give a longer one (copied on the device), else the victim; it then prefills only the rest. On CPU the row
        it computes in is the one after the last (rows stay dense): the row chosen moves there, and what that row held
        moves to the victim's place."""
        source, reused, take_busy = self._prefix_source(seq.prompt_ids, seq.long_rope)
        busy = source if take_busy else None
        pool = self.pool
        stale = None  # columns of dead K/V the row holds (None: unknown)
        if self.compact:
            row = len(self.slots)
            stale = 0  # a free row that is not cached was emptied when it was freed
            if not take_busy and source is not None:
                if source != row:  # row's own cached K/V (if any) goes where the chosen one was
                    pool.exchange_rows(source, row, reused, len(self.prefixes.tokens(row)) if row in self.cached else 0)
                    self._swap_cached(source, row)
            elif row in self.cached:
                stale = len(self.prefixes.tokens(row))  # moved to the victim's place, or dropped: dead here either way
                victim = self._victim()
                if victim != row:
                    victim_held = len(self.prefixes.tokens(victim)) if victim in self.cached else 0
                    # the joiner writes over what row is left holding (the victim's pages, traded, or its own)
                    stale = pool.move_row(row, victim, stale, victim_held, trade=True)
                    self._drop_cached(victim)
                    self._swap_cached(row, victim)
        else:
            row = source if not take_busy and source is not None else self._victim()
        if reused == 0 and stale is None:
            pool.discard(row)  # whatever it held is dead: the sequence writes it from its first column
        elif reused == 0 and stale > (most := self.reservation_tokens(seq)):
            # Past the most it may write (its reservation), the pages go back; the rest it writes over, pages still
            # held: given back, every page it writes would fault in again (runtime/pool.py discard).
            pool.discard(row, most)
        if take_busy:
            pool.copy_columns(busy, row, reused)
        self._drop_cached(row)
        if self.prefixes is not None:
            self.prefixes.put(row, seq.prompt_ids, seq.long_rope)  # its K/V up to its cached tokens, as the prefill writes them
        while len(self.slots) <= row:
            self.slots.append(None)
        self.slots[row] = seq
        self.held[seq] = HeldRow(row, reused)
        seq.reused_prompt_tokens = reused
        self._reserved += self.reservation(seq)
        self.settle()

    def refill(self, seq: Sequence) -> None:
        """seq's row is computed again from its first column, every token so far turned by longrope's long factors: it
        is about to grow past the original context (scheduler.py). It keeps its row and its reservation."""
        hold = self.held[seq]
        seq.long_rope, seq.refill_ids, hold.cached_tokens = True, seq.prompt_ids + seq.generated, 0
        if self.prefixes is not None:
            self.prefixes.put(hold.index, seq.refill_ids, seq.long_rope)

    def _drop_cached(self, row: int) -> None:
        """Row no longer holds a cached sequence (it is taken, or overwritten)."""
        if self.cached.pop(row, False) is not False:
            self.prefixes.remove(row)

    def _swap_cached(self, a: int, b: int) -> None:
        """Rows a and b traded contents: their index entries and their places in the least-recently-used order follow."""
        if self.prefixes is None:
            return
        self.prefixes.swap(a, b)
        self.cached = OrderedDict((b if row == a else a if row == b else row, held) for row, held in self.cached.items())

    def release(self, leaving: list[Sequence]) -> None:
        """Free the rows of sequences that left, each keeping what it wrote for the prompt cache; on CPU keep the rows
        in use dense."""
        if not leaving:
            return
        emptied = set()  # rows left holding nothing: given back once the rows in use are dense (a move may fill one)
        for seq in leaving:
            hold = self.held.pop(seq, None)
            if hold is None:
                continue
            row = hold.index
            self.slots[row] = None
            self._reserved -= self.reservation(seq)
            if self.prefixes is not None:
                # a ring row holding refused drafts keeps nothing: they overwrote positions a prefix's window reads
                if hold.cached_tokens and not (self.pool.ring is not None and hold.overshoot):
                    written = (seq.prompt_ids + seq.generated)[: hold.cached_tokens]  # exactly what it wrote
                    if seq.long_rope_from:  # turned short up to there, long after: the short part is a prefix of its kind
                        self.prefixes.put(row, written[: seq.long_rope_from], False)
                    else:
                        self.prefixes.put(row, written, seq.long_rope)
                    self.cached[row] = self._holding(len(self.prefixes.tokens(row)))
                    self.cached.move_to_end(row)
                    continue
                self.prefixes.remove(row)
            emptied.add(row)
        while True:
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            hole = next((row for row, s in enumerate(self.slots) if s is None), None)
            if hole is None or not self.compact:
                break
            moved = self.slots.pop()  # the last row moves into the hole, and the hole's cached K/V (if any) to its place
            source, last = len(self.slots), self.held[moved]
            held = len(self.prefixes.tokens(hole)) if self.prefixes is not None and hole in self.cached else 0
            if held:
                self.pool.exchange_rows(source, hole, last.cached_tokens, held)
            else:  # the last row's K/V alone in the hole: what source is left holding goes below
                self.pool.move_row(source, hole, last.cached_tokens)
                self._drop_cached(hole)
                emptied.discard(hole)
                emptied.add(source)  # moved out, nothing left behind
            self._swap_cached(source, hole)
            self.slots[hole], last.index = moved, hole
        for row in emptied:
            self.pool.discard(row)
        self.settle()
