"""Which rows of the KV pool hold which tokens' K/V, found by a prompt's longest shared start (the prompt cache).

A row holds one sequence's K/V left-aligned (column p holds position p), so a row whose tokens begin like a new
prompt already holds that prefix's K/V in the columns the prompt needs: the new request prefills only the rest.

Rows are indexed by blocks of BLOCK_TOKENS token ids, each block's key chained to the blocks before it (a hash of
the previous key and the block's ids), so a key names a whole prefix. Finding the rows that share a prompt's start
walks the prompt's block keys while some row has them, then compares at most one block of ids per row left: its
cost follows the prompt's length, not the number of rows times their lengths. The row chosen is then checked
against its own ids (confirm), so a hash collision can only shorten a match, never make a wrong one.

Rows whose K/V differ for the same ids have different kinds (a longrope model's rows turned long, 1, and short, 0):
each row's chain of keys starts from its kind, so a prompt finds only rows of the kind it asks for.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Ids per indexed block: a prefix shorter than one block is not worth finding (it is a few tokens of one step).
BLOCK_TOKENS = 16


def _block_keys(tokens: Sequence[int], blocks: int, kind: int = 0) -> list[int]:
    """The chained keys of the first `blocks` whole blocks of tokens, the chain started from kind."""
    keys, key = [], kind
    for start in range(0, blocks * BLOCK_TOKENS, BLOCK_TOKENS):
        key = hash((key, *tokens[start : start + BLOCK_TOKENS]))
        keys.append(key)
    return keys


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


class PrefixIndex:
    """Rows and the token ids they hold (or will hold: a row's prompt is indexed when it joins), by prefix."""

    def __init__(self, events=None):
        """events: told of every block that comes to be held by some row, or held by none any more, and of a clear
        (kv_events.KvEventPublisher: stored, removed, cleared); None: nobody is."""
        self._tokens: dict[int, list[int]] = {}  # row -> its ids
        self._keys: dict[int, list[int]] = {}  # row -> its whole blocks' keys
        self._rows: dict[int, set[int]] = {}  # block key -> rows holding that prefix
        self._kinds: dict[int, int] = {}  # row -> its kind
        self.events = events

    def __contains__(self, row: int) -> bool:
        return row in self._tokens

    def tokens(self, row: int) -> list[int]:
        return self._tokens.get(row, [])

    def put(self, row: int, tokens: Sequence[int], kind: int = 0) -> None:
        """Row now holds tokens, their K/V of kind (replacing what it held)."""
        gone = self._remove(row)
        was_held = set(gone)  # blocks this row alone held a moment ago: held again, not new (a row re-put as it grows)
        tokens = list(tokens)
        keys = _block_keys(tokens, len(tokens) // BLOCK_TOKENS, kind)
        self._tokens[row], self._keys[row], self._kinds[row] = tokens, keys, kind
        new = []  # indices of the blocks no row held
        for index, key in enumerate(keys):
            rows = self._rows.setdefault(key, set())
            if not rows and key not in was_held:
                new.append(index)
            rows.add(row)
        if self.events is not None:
            self._announce_removed([key for key in gone if key not in self._rows])
            start = 0
            for end in range(1, len(new) + 1):  # each run of consecutive new blocks: one event, chained to the block before
                if end == len(new) or new[end] != new[end - 1] + 1:
                    first, last = new[start], new[end - 1]
                    self.events.stored(keys[first : last + 1], keys[first - 1] if first else None,
                                       tokens[first * BLOCK_TOKENS : (last + 1) * BLOCK_TOKENS])
                    start = end

    def remove(self, row: int) -> None:
        self._announce_removed(self._remove(row))

    def _remove(self, row: int) -> list[int]:
        """Forget row; returns the keys no row holds any more."""
        self._tokens.pop(row, None)
        self._kinds.pop(row, None)
        gone = []
        for key in self._keys.pop(row, ()):
            rows = self._rows[key]
            rows.discard(row)
            if not rows:
                del self._rows[key]
                gone.append(key)
        return gone

    def _announce_removed(self, keys: list[int]) -> None:
        if keys and self.events is not None:
            self.events.removed(keys)

    def swap(self, a: int, b: int) -> None:
        """Rows a and b exchanged their contents (the blocks held are the same: nothing to announce)."""
        (tokens_a, kind_a), (tokens_b, kind_b) = ((self._tokens.get(row), self._kinds.get(row, 0)) for row in (a, b))
        events, self.events = self.events, None
        try:
            self.remove(a)
            self.remove(b)
            if tokens_b is not None:
                self.put(a, tokens_b, kind_b)
            if tokens_a is not None:
                self.put(b, tokens_a, kind_a)
        finally:
            self.events = events

    def clear(self) -> None:
        self._tokens.clear()
        self._keys.clear()
        self._rows.clear()
        self._kinds.clear()
        if self.events is not None:
            self.events.cleared()

    def matches(self, prompt: Sequence[int], kind: int = 0) -> dict[int, int]:
        """{row: how many leading ids of prompt it shares} for every row of kind sharing at least one whole block."""
        found: dict[int, int] = {}
        candidates: set[int] = set()
        blocks = 0
        for key in _block_keys(prompt, len(prompt) // BLOCK_TOKENS, kind):
            rows = self._rows.get(key, set())
            narrowed = rows if blocks == 0 else candidates & rows
            if blocks:
                self._extend(candidates - narrowed, prompt, blocks, found)  # they part from the prompt in this block
            if not narrowed:
                return found
            candidates, blocks = set(narrowed), blocks + 1
        self._extend(candidates, prompt, blocks, found)
        return found

    def _extend(self, rows: set[int], prompt: Sequence[int], blocks: int, found: dict[int, int]) -> None:
        """found[row] for rows sharing the prompt's first `blocks` whole blocks (by key) and not the next: the ids of
        that next block say how far into it they agree."""
        start = blocks * BLOCK_TOKENS
        for row in rows:
            tail = self._tokens[row][start : start + BLOCK_TOKENS]
            found[row] = start + shared_length(tail, prompt[start : start + BLOCK_TOKENS])

    def confirm(self, row: int, prompt: Sequence[int], length: int) -> int:
        """How many of the first `length` ids of prompt row really holds (matches' keys can collide; the ids cannot):
        read for the one row chosen, so a choice costs the prompt's length once."""
        return shared_length(self._tokens.get(row, [])[:length], prompt[:length])
