"""The batch's rows (service/core/kv_rows.py): where a sequence joins and what a leaving one leaves, rows kept dense on the
CPU with only used columns moved, the prompt cache's least-recently-used eviction, and no K/V through the host."""

import mmap

import numpy as np
import pytest

from kvserve.runtime import KvTraffic, SlotPool
from kvserve.service.core.batch import SlotBatch
from kvserve.service.process.gate import _greedy_sequence
from kvserve.service.core.kv_rows import KvRows
from kvserve.service.core.scheduler import Scheduler

from ..conftest import random_prompt as prompt


def marked_rows(rows: int = 4, prompt_cache: bool = True, remap_rows: bool = True) -> KvRows:
    """KvRows over a small CPU pool (1 layer, 1 head, 64 columns of width 1) with nothing run in it (remap_rows: its rows
    padded to whole pages, so they move by remapping)."""
    pool = SlotPool(rows, 1, 1, 64, 1, np.float32, "cpu", KvTraffic(), remap_rows=remap_rows)
    pool.remap_min_columns = 0  # remapped however few columns a move takes
    return KvRows(pool, "cpu", 1, prompt_cache)


def join_writing(rows: KvRows, seq_id: int, prompt: list[int]):
    """A sequence joins and writes its whole prompt: column p of its row holds 1000 * id + p, in K and V."""
    seq = _greedy_sequence(seq_id, prompt, 4)
    rows.join(seq)
    for array in rows.pool.arrays:
        array[rows.held[seq].index, 0, : len(prompt), 0] = 1000 * seq_id + np.arange(len(prompt))  # (H=1, C, d_k=1)
    rows.held[seq].cached_tokens = len(prompt)
    return seq


def held(rows: KvRows, row: int, columns: int) -> list[float]:
    return rows.pool.arrays[0][row, 0, :columns, 0].tolist()


MOVES = pytest.mark.parametrize("remap_rows", [False, True], ids=["copied", "remapped"])


@MOVES
def test_a_leave_moves_the_last_row_into_the_hole_and_keeps_what_the_leaver_wrote(remap_rows):
    rows = marked_rows(remap_rows=remap_rows)
    a, b, c = (join_writing(rows, i, prompt(i, 20)[:5]) for i in (1, 2, 3))
    assert [rows.held[s].index for s in (a, b, c)] == [0, 1, 2]
    a.finished = True
    rows.release([a])
    assert rows.held[c].index == 0 and held(rows, 0, 5) == [3000 + p for p in range(5)]  # the last row's columns moved into the hole
    assert rows.cached_rows() == 1 and held(rows, 2, 5) == [1000 + p for p in range(5)]  # the leaver's K/V kept, at the end
    assert rows.pool.traffic.device_copies == 1 and rows.pool.traffic.host_bytes == 0


def test_a_prompt_takes_the_free_row_that_begins_like_it_and_the_least_recently_used_row_goes_first():
    rows = marked_rows(rows=2)
    shared = list(range(1, 33))  # two whole index blocks
    first = join_writing(rows, 1, shared + [100, 101])
    other = join_writing(rows, 2, [200 + i for i in range(34)])
    rows.release([first])
    rows.release([other])
    assert rows.cached_rows() == 2 and rows.free_rows() == 2
    again = _greedy_sequence(3, shared + [102], 4)
    assert rows.reusable_prompt_tokens(again) == 32
    rows.join(again)
    assert rows.held[again].cached_tokens == again.reused_prompt_tokens == 32 and held(rows, rows.held[again].index, 32) == [1000 + p for p in range(32)]
    newcomer = _greedy_sequence(4, [300, 301, 302], 4)  # matches nothing: takes the one cached row left
    rows.join(newcomer)
    assert rows.held[newcomer].cached_tokens == 0 and rows.cached_rows() == 0


@MOVES
def test_a_joiner_taking_a_cached_row_past_the_rows_in_use_moves_it_to_their_end(remap_rows):
    """Rows 1 and 2 cached (b's and c's K/V), row 0 in use: a prompt that begins as c's takes row 2's K/V, moved to row 1
    (the end of the rows in use), and b's goes to row 2."""
    rows = marked_rows(remap_rows=remap_rows)
    a, b, c = (join_writing(rows, i, prompt(i, 40)[:34]) for i in (1, 2, 3))
    c.finished = True
    rows.release([c])
    b.finished = True
    rows.release([b])
    again = _greedy_sequence(4, c.prompt_ids[:33] + [5], 4)
    rows.join(again)
    assert rows.held[again].index == 1 and again.reused_prompt_tokens == 33  # (its last prompt token is computed)
    assert held(rows, 1, 33) == [3000 + p for p in range(33)] and held(rows, 2, 34) == [2000 + p for p in range(34)]
    assert rows.cached_rows() == 1 and held(rows, 0, 34) == [1000 + p for p in range(34)]


def test_with_the_prompt_cache_off_a_leaver_keeps_nothing():
    rows = marked_rows(prompt_cache=False)
    seq = join_writing(rows, 1, list(range(40)))
    rows.release([seq])
    assert rows.cached_rows() == 0 and rows.reusable_prompt_tokens(_greedy_sequence(2, list(range(40)), 4)) == 0


@pytest.mark.parametrize("prompt_cache", [False, True], ids=["cache off", "cache on"])
def test_fifty_joins_and_leaves_move_no_kv_through_the_host(slots_graph, slots_runtime, slots_model, prompt_cache):
    slots_runtime.traffic.host_bytes = slots_runtime.traffic.device_copies = 0
    scheduler = Scheduler(SlotBatch(slots_runtime, slots_model.config, 4), step_token_budget=10, prompt_cache=prompt_cache)
    seqs = [_greedy_sequence(i, prompt(100 + i, 1 + (7 * i) % 40), 1 + (5 * i) % 17) for i in range(50)]
    results = scheduler.drive(seqs)
    assert all(s.finished for s in seqs) and not scheduler.kv.rows
    assert not [e for _, e in results if isinstance(e, BaseException)]
    assert slots_runtime.traffic.host_bytes == 0
    # a leave moves at most one row (on CPU; none under CUDA), a join at most one (a cached row moving into place)
    assert slots_runtime.traffic.device_copies <= (100 if prompt_cache else 50)
    if slots_runtime.device == "cpu" and not prompt_cache:
        assert slots_runtime.traffic.device_copies > 0  # leaves below the last row were compacted
    for seq in seqs[::7]:
        assert seq.generated == slots_graph.alone(seq)


def discarding(rows: KvRows) -> list[int | tuple[int, int]]:
    """The rows the pool is told to discard from now on, in order: a row given back whole, or (row, columns kept) for
    one whose first columns stay."""
    told: list[int | tuple[int, int]] = []
    discard = rows.pool.discard

    def record(row: int, keep_columns: int = 0) -> None:
        told.append((row, keep_columns) if keep_columns else row)
        discard(row, keep_columns)

    rows.pool.discard = record
    return told


def test_rows_that_hold_nothing_wanted_give_their_memory_back():
    rows = marked_rows(rows=3)
    told = discarding(rows)
    a, b, c = (join_writing(rows, i, prompt(i, 20)[:5]) for i in (1, 2, 3))
    assert told == []  # each joined an empty row: nothing held there to give back
    rows.held[c].cached_tokens = 0  # left before writing anything: nothing for the prompt cache
    c.finished = True
    rows.release([c])
    assert told == [2]
    told.clear()
    a.finished = True
    rows.release([a])  # a is cached: b moves into its hole, a's K/V to b's old row, and nothing is discarded
    assert told == [] and rows.cached_rows() == 1 and rows.held[b].index == 0
    rows.forget_cached()
    assert told == [1]


def test_a_joiner_writes_over_the_pages_of_the_cached_row_it_takes_and_gives_back_only_what_it_cannot_write():
    """A cached row taken by a sequence that reuses none of it, its rows copied (not remapped): its K/V moves to another
    free row, and the pages of the columns the joiner may write (its prompt and max_new_tokens) stay, written over as it
    goes; a longer tail goes back. Given back whole, every page would fault in again as the joiner writes it."""
    pool = SlotPool(3, 1, mmap.PAGESIZE // 4, 64, 1, np.float32, "cpu", KvTraffic(), remap_rows=False)  # a column a page
    rows = KvRows(pool, "cpu", 1, prompt_cache=True)
    long = join_writing(rows, 1, prompt(1, 60)[:40])
    long.finished = True
    rows.release([long])  # row 0 holds 40 cached columns
    told = discarding(rows)
    short = _greedy_sequence(2, [7, 8, 9], 4)  # may write 3 + 4 columns
    rows.join(short)
    assert rows.held[short].index == 0 and told == [(0, 7)]  # the cached K/V moved to an empty row, row 0's tail went back
    assert held(rows, 1, 40) == [1000 + p for p in range(40)] and rows.cached_rows() == 1
    mapped = rows.pool.arrays[0]
    assert mapped[0, 0, :7, 0].tolist() == [1000 + p for p in range(7)]  # kept pages: the joiner's own writes replace them
    assert not mapped[0, 0, 7:, 0].any()  # past what it may write: given back, zeros again
    short.finished = True
    rows.release([short])
    told.clear()
    roomy = _greedy_sequence(3, [5] * 3, 60)  # may write more than the cached row holds: nothing to give back
    rows.join(roomy)
    assert told == []


def test_a_joiner_taking_a_remapped_cached_row_gets_the_empty_rows_pages_and_gives_back_nothing():
    """As above with rows of whole pages: the cached row and an empty one trade pages, so the joiner's row holds the
    empty row's (none) and there is no tail to give back."""
    pool = SlotPool(3, 1, mmap.PAGESIZE // 4, 64, 1, np.float32, "cpu", KvTraffic())
    pool.remap_min_columns = 0
    rows = KvRows(pool, "cpu", 1, prompt_cache=True)
    long = join_writing(rows, 1, prompt(1, 60)[:40])
    long.finished = True
    rows.release([long])
    told = discarding(rows)
    short = _greedy_sequence(2, [7, 8, 9], 4)
    rows.join(short)
    assert rows.held[short].index == 0 and told == [] and not rows.pool.arrays[0][0].any()
    assert held(rows, 1, 40) == [1000 + p for p in range(40)] and rows.cached_rows() == 1
    assert pool.traffic.remapped_bytes > 0 and pool.traffic.device_copy_bytes == 0


def test_a_joiner_whose_row_trades_pages_with_a_cached_one_writes_over_them_and_gives_back_what_it_cannot_write():
    """The joiner's row (0) is cached, and so is the least recently used row (1): the two trade pages, so the joiner
    writes over row 1's old pages (none faults in) and gives back what lies past its reservation."""
    pool = SlotPool(2, 1, mmap.PAGESIZE // 4, 64, 1, np.float32, "cpu", KvTraffic())  # a column a page; no empty row
    pool.remap_min_columns = 0
    rows = KvRows(pool, "cpu", 1, prompt_cache=True)
    first, second = join_writing(rows, 1, prompt(1, 60)[:40]), join_writing(rows, 2, prompt(2, 60)[:30])
    second.finished = True
    rows.release([second])  # row 1 cached first: the least recently used
    first.finished = True
    rows.release([first])
    told = discarding(rows)
    short = _greedy_sequence(3, [7, 8, 9], 4)  # may write 3 + 4 columns
    rows.join(short)
    assert rows.held[short].index == 0 and held(rows, 1, 40) == [1000 + p for p in range(40)] and rows.cached_rows() == 1
    assert told == [(0, 7)] and pool.traffic.device_copy_bytes == 0
    assert held(rows, 0, 7) == [2000 + p for p in range(7)] and not pool.arrays[0][0, 0, 7:].any()  # row 1's old pages, trimmed


@MOVES
def test_without_the_prompt_cache_every_row_left_is_discarded_and_moves_leave_nothing_behind(remap_rows):
    rows = marked_rows(rows=3, prompt_cache=False, remap_rows=remap_rows)
    a, b, c = (join_writing(rows, i, prompt(i, 20)[:5]) for i in (1, 2, 3))
    told = discarding(rows)
    a.finished = True
    # c moves into a's row 0: copied over a's pages (past c's 5 columns they go back), or trading pages with it (a's
    # then in row 2); row 2 is left empty
    rows.release([a])
    assert told == ([2] if remap_rows else [(0, 5), 2]) and rows.held[c].index == 0 and held(rows, 0, 5) == [3000 + p for p in range(5)]
    if remap_rows:  # a row of whole pages: given back, it reads as zeros (a copied pool's rows share pages here)
        assert not rows.pool.arrays[0][2].any()
    assert rows.kv_bytes() == 2 * 5 * 2 * 4 and rows.cached_bytes() == 0  # two rows of 5 tokens' K and V, 4 bytes each


def budgeted_rows(rows: int, budget_tokens: int, prompt_cache: bool = True) -> KvRows:
    """marked_rows' pool under a K/V budget of budget_tokens tokens (a token: 1 layer's K and V of 1 head of width 1)."""
    pool = SlotPool(rows, 1, 1, 64, 1, np.float32, "cpu", KvTraffic())
    return KvRows(pool, "cpu", 1, prompt_cache, budget_bytes=budget_tokens * 2 * 4)


def test_a_sequence_fits_while_the_most_the_rows_may_hold_stays_within_the_budget():
    rows = budgeted_rows(4, budget_tokens=30)
    first = _greedy_sequence(1, prompt(1, 20)[:10], 4)  # reserves 14
    assert rows.reservation(first) == 14 * 8 and rows.fits(first)
    rows.join(first)
    second = _greedy_sequence(2, prompt(2, 20)[:10], 6)  # 16 more: 30 of 30
    assert rows.fits(second)
    rows.join(second)
    third = _greedy_sequence(3, [5], 0)  # one token more than the budget
    assert not rows.fits(third) and rows.free_rows() == 2  # rows are free; memory is not
    first.finished = True
    rows.release([first])
    assert rows.fits(third) and rows.reserved_bytes() == 16 * 8


def test_the_prompt_cache_gives_its_rows_back_first_least_recently_used_when_the_budget_needs_them():
    rows = budgeted_rows(4, budget_tokens=40)
    told = discarding(rows)
    a, b = join_writing(rows, 1, prompt(1, 20)[:10]), join_writing(rows, 2, prompt(2, 20)[:10])  # 14 reserved each
    told.clear()
    for seq in (a, b):
        seq.finished = True
        rows.release([seq])
    assert rows.cached_rows() == 2 and rows.cached_bytes() == 20 * 8 and told == []  # 20 cached tokens fit the budget beside nothing
    newcomer = _greedy_sequence(3, [300, 301, 302], 27)  # reserves 30: 30 + 20 cached > 40, so a cached row goes, a's first
    assert rows.fits(newcomer)
    rows.join(newcomer)
    assert rows.reserved_bytes() + rows.cached_bytes() <= 40 * 8
    assert rows.cached_rows() == 1 and len(told) >= 1
    (kept,) = rows.cached
    assert rows.prefixes.tokens(kept) == b.prompt_ids  # b, the more recently used, is what the cache kept


def test_kv_memory_stays_within_the_budget_while_a_flood_runs_through_rows_that_would_hold_far_more():
    # 16 rows of a 1-layer pool, 8 heads of 64 float32 (4 KiB a token) and 8,192 columns: 512 MiB of address space for
    # 16 sequences of 8,000 tokens, whose K/V the pool would commit as written; the budget holds 2 of them (64 MB).
    from ...runtime.test_pool import resident_bytes

    pool = SlotPool(16, 8, 64, 8192, 1, np.float32, "cpu", KvTraffic())
    rows = KvRows(pool, "cpu", 1, prompt_cache=True, budget_bytes=16_000 * 4096)
    waiting = [_greedy_sequence(i, [i] * 4000, 4000) for i in range(16)]
    before, peak, done = resident_bytes(), 0, 0
    while waiting or rows.rows:
        while waiting and rows.free_rows() and rows.fits(waiting[0]):  # the scheduler's admission, in order
            rows.join(waiting.pop(0))
        assert len(rows.rows) <= 2
        for seq in rows.rows:  # each writes its whole length at once, as a prefill and its decode would
            for array in pool.arrays:
                array[rows.held[seq].index, :, :8000] = seq.id + 1.0
            rows.held[seq].cached_tokens = 8000
        peak = max(peak, resident_bytes() - before)
        for seq in rows.rows:
            seq.finished = True
        done += len(rows.rows)
        rows.release(rows.rows)
    assert done == 16 and peak < 16_000 * 4096 + (16 << 20), peak  # the budget (64 MB) and some slack, never 512 MiB


def test_ring_rows_count_at_most_their_ring_and_hand_on_only_prefixes_their_rings_still_hold():
    """A pool whose layer 1 is a ring of 20 positions (layer 0 whole): a row's bytes grow by both layers' K/V a token up to
    the ring and by layer 0's after; the budget's tokens are solved from that; a cached row that wrote past its ring hands
    on a prefix only within 16 positions of its end (contract/config.py RING_SLACK)."""
    pool = SlotPool(4, 1, 1, 64, 2, np.float32, "cpu", KvTraffic(), rings={1: 21}, scratch_position=63)
    rows = KvRows(pool, "cpu", 2, budget_bytes=(30 + 20) * 8)  # 30 tokens of layer 0's K and V, 20 of the ring's
    assert pool.ring == 20 and pool.scratch == 63 and rows.token_bytes == 2 * 2 * 4
    assert [rows.tokens_bytes(n) for n in (10, 20, 30)] == [10 * 16, 20 * 16, 30 * 8 + 20 * 8]
    assert rows.budget_tokens() == 30 and rows.row_bytes() == (pool.shape[2] + 21) * 4 * 2  # layer 0 padded to a page
    rows = KvRows(pool, "cpu", 2)  # no budget: nothing cached is given back
    long, short = prompt(1, 64)[:48], prompt(2, 64)[:18]
    for ids in (long, short):
        seq = _greedy_sequence(len(ids), ids, 4)
        seq.max_new_tokens = 0
        rows.join(seq)
        rows.held[seq].cached_tokens, seq.finished = len(ids), True
        rows.release([seq])
    assert rows.reusable_prompt_tokens(_greedy_sequence(9, long[:32] + [7, 7], 4)) == 32  # 48 - 32 = 16: within 16 of its end
    assert rows.reusable_prompt_tokens(_greedy_sequence(9, long[:31] + [7, 7], 4)) == 0  # 17 short: not taken
    assert rows.reusable_prompt_tokens(_greedy_sequence(9, short[:16] + [7, 7], 4)) == 16  # never wrapped: any prefix


def test_a_ring_rows_refused_drafts_count_as_written_when_it_hands_on_a_prefix():
    """Drafts a ring row wrote and did not keep overwrote its ring's earliest columns as far as they reached: a prefix
    whose window they reached is never handed on, from a row still in use or from one that left holding them (the same
    pool as above: layer 1 a ring of 20, RING_SLACK 16)."""
    pool = SlotPool(4, 1, 1, 64, 2, np.float32, "cpu", KvTraffic(), rings={1: 21}, scratch_position=63)
    rows = KvRows(pool, "cpu", 2)
    assert rows.copies_from_busy
    long = prompt(1, 64)[:48]
    busy = _greedy_sequence(1, long, 20)
    rows.join(busy)
    hold = rows.held[busy]
    hold.cached_tokens = hold.written_columns = 48
    asked = _greedy_sequence(9, long[:36] + [7, 7], 4)
    assert rows.reusable_prompt_tokens(asked) == 36  # 48 - 36 = 12: its window still in the ring
    hold.written_columns = 60  # its first step checked 12 drafts and kept none: positions 48-59 wrote over 28-39
    assert rows.reusable_prompt_tokens(asked) == 0  # the window of 36 (29-35) is gone
    hold.cached_tokens = 49
    busy.finished = True
    rows.release([busy])  # it ends holding 11 columns of refused drafts (a stop sequence inside accepted drafts, say)
    assert rows.reusable_prompt_tokens(asked) == 0
    assert rows.reusable_prompt_tokens(_greedy_sequence(9, long[:30] + [7, 7], 4)) == 0
