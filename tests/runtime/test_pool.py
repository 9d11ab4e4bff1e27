"""The slots pool (runtime/pool.py): rows of K/V that read as zeros and commit memory only as they are written, a
discarded row's pages given back, copies and exchanges of a row's used columns within the pool's memory, counted in
the runtime's traffic, and the 2-D copies CUDA runs, checked on host memory."""

import ctypes
import mmap

import numpy as np

from kvserve.contract.config import DecoderConfig
from kvserve.runtime import KvTraffic, SlotPool, pool_capacity
from kvserve.runtime.pool import page_remap, remap_columns


def host_pool(rows: int = 3, layers: int = 2, heads: int = 2, columns: int = 9, width: int = 4, remap_rows: bool = True) -> SlotPool:
    """A small CPU pool; remap_rows: its rows padded to whole pages and remapped however few columns a move takes."""
    pool = SlotPool(rows, heads, width, columns, layers, np.float32, "cpu", KvTraffic(), remap_rows=remap_rows)
    pool.remap_min_columns = 0
    return pool


def filled(pool: SlotPool, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    for array in pool.arrays:
        array[...] = rng.normal(size=array.shape)
    return [array.copy() for array in pool.arrays]


class DeferredCopies:
    """The pool's row copies under CUDA (runtime.pool.DeviceCopies) as the GPU does them: cudaMemcpy2D returns before a
    device-to-device copy is done, so here each copy is only queued, and runs (as the same 2-D memory copy on the host
    pool, a memmove per head) when the pool waits for them."""

    def __init__(self):
        self.queued, self.waits = [], 0

    def copy_2d(self, destination: int, source: int, pitch: int, width: int, height: int) -> None:
        self.queued.append((destination, source, pitch, width, height))

    def wait(self) -> None:
        for destination, source, pitch, width, height in self.queued:
            for head in range(height):
                ctypes.memmove(destination + head * pitch, source + head * pitch, width)
        self.queued.clear()
        self.waits += 1


def as_under_cuda(pool: SlotPool, monkeypatch) -> tuple[list[np.ndarray], DeferredCopies]:
    """pool seen as under CUDA (only addresses: its arrays hidden), its copies deferred: (its arrays, the copies)."""
    import kvserve.runtime.pool as pool_module

    copies = DeferredCopies()
    monkeypatch.setattr(pool_module, "device_copies", lambda: copies)
    arrays, pool.arrays = pool.arrays, None
    return arrays, copies


def test_a_pool_is_every_layers_k_and_v_zeroed_and_a_row_past_the_context_is_scratch():
    pool = host_pool(remap_rows=False)
    assert len(pool.arrays) == len(pool.values) == 2 * 2 and pool.shape == (3, 2, 9, 4)
    assert all(not array.any() for array in pool.arrays)  # zeros: rows read padding columns
    assert pool.row_bytes == 2 * 9 * 4 * 4 and pool.scratch == 8  # one layer's K of one row; the context's last column
    padded = host_pool()  # rows that move by remapping: padded to whole pages, the scratch column where it was
    assert page_remap() is not None  # Linux 5.7 or later, as every machine this project runs on
    assert padded.shape == (3, 2, mmap.PAGESIZE // (2 * 4 * 4), 4) and padded.scratch == 8
    assert padded.value_row_bytes(0) == mmap.PAGESIZE and all(not array.any() for array in padded.arrays)
    assert remap_columns(9, 2 * 4 * 4) == 128 and remap_columns(1025, 12 * 64 * 4) == 1028 and remap_columns(8192, 2048) == 8192
    assert pool_capacity(DecoderConfig(model_type="gpt2", vocab_size=10, n_ctx=16, d_model=8, n_head=2, n_layer=1, d_mlp=8,
                                       eos_token_ids=(0,))) == 17  # a whole context, then the scratch column


def test_copy_columns_moves_only_the_columns_asked_and_counts_them():
    pool = host_pool()
    before = filled(pool)
    pool.copy_columns(source=0, destination=2, columns=5)
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[2, :, :5], want[0, :, :5]) and np.array_equal(got[2, :, 5:], want[2, :, 5:])
        assert np.array_equal(got[:2], want[:2])
    assert (pool.traffic.device_copies, pool.traffic.device_copy_bytes, pool.traffic.host_bytes) == (1, 5 * 2 * 4 * 4 * 4, 0)
    pool.copy_columns(1, 1, 5)  # onto itself: nothing moves, nothing is counted
    pool.copy_columns(0, 1, 0)
    assert pool.traffic.device_copies == 1


def test_exchange_rows_trades_each_rows_used_columns():
    pool = host_pool()
    before = filled(pool, seed=1)
    pool.exchange_rows(0, 2, a_columns=3, b_columns=6)
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[2, :, :3], want[0, :, :3]) and np.array_equal(got[0, :, :6], want[2, :, :6])
        assert np.array_equal(got[1], want[1])
    assert pool.row_to_host(0, 6)[0].shape == (2, 6, 4)  # (H, columns, d_k)


def test_row_copies_under_cuda_are_the_2d_copies_of_each_heads_columns():
    """SlotPool.pitched_copies is what cudaMemcpy2D runs under CUDA; here each copy runs as the same 2-D memory copy on
    the host pool (a memmove per head), and must equal the columns copied by numpy."""
    pool = host_pool(rows=3, layers=2, heads=4, columns=257, width=16)  # tiny's shape: every head a block of 257 x 16
    rng = np.random.default_rng(1)
    for array in pool.arrays:
        array[...] = rng.normal(size=array.shape)
    expected = [array.copy() for array in pool.arrays]
    for array in expected:
        array[2, :, :7] = array[0, :, :7]
    for destination, source, pitch, width, height in pool.pitched_copies(0, 2, 7):
        for head in range(height):
            ctypes.memmove(destination + head * pitch, source + head * pitch, width)
    for got, want in zip(pool.arrays, expected):
        assert np.array_equal(got, want)


def test_an_exchange_under_cuda_moves_each_heads_columns_through_one_spare_row(monkeypatch):
    """exchange_rows under CUDA (cudaMemcpy2D through a spare row kept on the device), its copies run as the same 2-D
    memory copies on the host pool, done by the time it returns: the rows trade their used columns, the third row is
    untouched."""
    pool = host_pool(rows=3, layers=2, heads=4, columns=257, width=16)
    before = filled(pool, seed=2)
    arrays, copies = as_under_cuda(pool, monkeypatch)
    spare = np.zeros((4, 257, 16), np.float32)  # (H, C, d_k): one row of one layer

    class Spare:
        def data_ptr(self):
            return spare.ctypes.data

    pool._spare = Spare()
    pool.exchange_rows(2, 0, a_columns=7, b_columns=3)
    assert not copies.queued and copies.waits == 1  # one wait for the exchange's 12 copies, before it returned
    for got, want in zip(arrays, before):
        assert np.array_equal(got[0, :, :7], want[2, :, :7]) and np.array_equal(got[2, :, :3], want[0, :, :3])
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[0, :, 7:], want[0, :, 7:])
    assert pool.traffic.device_copies == 1


def test_a_prefix_copied_under_cuda_is_in_place_when_the_copy_returns(monkeypatch):
    """copy_columns under CUDA (a prompt's prefix taken from another row): its 2-D copies are done, waited for, before it
    returns, since the next step's stream would not wait for them."""
    pool = host_pool(rows=3, layers=2, heads=4, columns=257, width=16)
    before = filled(pool, seed=3)
    arrays, copies = as_under_cuda(pool, monkeypatch)
    pool.copy_columns(source=1, destination=0, columns=9)
    assert not copies.queued and copies.waits == 1
    for got, want in zip(arrays, before):
        assert np.array_equal(got[0, :, :9], want[1, :, :9]) and np.array_equal(got[0, :, 9:], want[0, :, 9:])
        assert np.array_equal(got[1:], want[1:])


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def test_memory_is_committed_as_columns_are_written_and_a_discarded_row_gives_it_back():
    # 8 arrays of 16 rows x 8 heads x 8,192 columns x 64 float32: 2.1 GB of address space
    before = resident_bytes()
    pool = SlotPool(16, 8, 64, 8192, 4, np.float32, "cpu", KvTraffic())
    assert pool.arrays[0].nbytes == 16 * 8 * 8192 * 64 * 4
    assert resident_bytes() - before < 16 << 20  # made: nothing committed
    for array in pool.arrays:
        array[:, :, :100] = 1.0  # 100 columns of every row and head: 25.6 KB each, 7 pages
    written = resident_bytes() - before
    assert 25 << 20 < written < 48 << 20, written  # 8 x 16 x 8 x 7 pages = 28 MiB, not 2.1 GB
    for row in range(16):
        pool.discard(row)
    assert resident_bytes() - before < written // 4
    assert all(not array.any() for array in pool.arrays)  # discarded rows read as zeros


def test_discard_keeps_the_neighbours_pages_it_shares():
    pool = SlotPool(3, 2, 4, 1000, 1, np.float32, "cpu", KvTraffic(), remap_rows=False)  # a row is 32,000 bytes: not whole pages
    before = filled(pool)
    pool.discard(1)
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[2], want[2])
        assert (got[1] == 0).mean() > 0.8 and np.array_equal(got[1][got[1] != 0], want[1][got[1] != 0])


def test_discard_keeping_a_rows_first_columns_gives_back_only_each_heads_tail():
    pool = SlotPool(3, 2, mmap.PAGESIZE // 4, 40, 2, np.float32, "cpu", KvTraffic())  # a column of a head is one page
    before = filled(pool, seed=3)
    pool.discard(1, keep_columns=12)
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[1, :, :12], want[1, :, :12])  # every head keeps its first 12 columns
        assert not got[1, :, 12:].any()  # and gives the rest back
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[2], want[2])
    pool.discard(1, keep_columns=40)  # keeps everything: nothing goes
    assert all(np.array_equal(got[1, :, :12], want[1, :, :12]) for got, want in zip(pool.arrays, before))


def test_an_exchange_longer_than_the_host_spare_moves_its_columns_in_pieces(monkeypatch):
    import kvserve.runtime.pool as pool_module

    monkeypatch.setattr(pool_module, "HOST_SPARE_BYTES", 2 * 4 * 4 * 3)  # 3 columns of 2 heads of width 4 at a time
    pool = host_pool(rows=3, layers=2, heads=2, columns=17, width=4, remap_rows=False)
    before = filled(pool, seed=4)
    pool.exchange_rows(2, 0, a_columns=11, b_columns=16)  # 11 columns through the spare: 4 pieces
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[0, :, :11], want[2, :, :11]) and np.array_equal(got[2, :, :16], want[0, :, :16])
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[0, :, 11:], want[0, :, 11:])
    assert pool._host_spare.nbytes == 2 * 4 * 4 * 3  # one spare, kept: no memory made for each exchange


def test_rows_of_whole_pages_trade_their_pages_and_copy_no_byte():
    pool = host_pool(rows=4)
    before = filled(pool, seed=5)
    pool.exchange_rows(0, 2, a_columns=3, b_columns=6)  # whole rows trade: every column, not only those asked
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[0], want[2]) and np.array_equal(got[2], want[0]) and np.array_equal(got[1], want[1])
    row_bytes = pool.value_row_bytes(0)
    assert (pool.traffic.device_copies, pool.traffic.device_copy_bytes, pool.traffic.remapped_bytes) == (1, 0, 4 * 2 * row_bytes)
    left = pool.move_row(source=3, destination=1, columns=5, destination_columns=7)
    for got, want in zip(pool.arrays, before):  # the destination's old K/V is gone, and the source holds nothing
        assert np.array_equal(got[1], want[3]) and not got[3].any() and np.array_equal(got[0], want[2])
    assert left == 0 and pool.traffic.device_copy_bytes == 0 and pool.traffic.remapped_bytes == (4 * 2 + 4) * row_bytes  # each value: two rows, then one
    before = [array.copy() for array in pool.arrays]
    assert pool.move_row(source=0, destination=2, columns=5, destination_columns=6, trade=True) == 6
    for got, want in zip(pool.arrays, before):  # traded: the source holds the destination's old pages, to write over
        assert np.array_equal(got[2], want[0]) and np.array_equal(got[0], want[2])
    assert pool.move_row(0, 2, 5, trade=True) is None  # what the destination held unknown: so is what the source holds


def test_a_move_without_remapping_copies_into_the_destination_and_gives_back_its_longer_tail():
    pool = SlotPool(3, 1, mmap.PAGESIZE // 4, 40, 2, np.float32, "cpu", KvTraffic(), remap_rows=False)  # a column a page
    before = filled(pool, seed=6)
    assert pool.move_row(source=0, destination=2, columns=10, destination_columns=30) == 10  # the source keeps its own
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[2, :, :10], want[0, :, :10]) and not got[2, :, 10:].any()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert pool.traffic.remapped_bytes == 0 and pool.traffic.device_copy_bytes == 2 * 2 * 10 * mmap.PAGESIZE
    before = [array.copy() for array in pool.arrays]
    pool.move_row(source=1, destination=2, columns=20, destination_columns=10)  # held fewer: nothing past to give back
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[2, :, :20], want[1, :, :20])


def test_a_ring_layers_rows_not_whole_pages_are_copied_beside_the_remapped_ones():
    pool = SlotPool(3, 1, 4, 100, 2, np.float32, "cpu", KvTraffic(), rings={1: 21}, scratch_position=99)
    pool.remap_min_columns = 0
    assert pool.columns == [256, 256, 21, 21] and pool._remaps == [True, True, False, False]
    before = filled(pool, seed=7)
    pool.exchange_rows(0, 1, a_columns=30, b_columns=12)
    for index, (got, want) in enumerate(zip(pool.arrays, before)):
        if index < 2:
            assert np.array_equal(got[0], want[1]) and np.array_equal(got[1], want[0])
        else:  # the ring's held columns: at most its 20
            assert np.array_equal(got[1, :, :20], want[0, :, :20]) and np.array_equal(got[0, :, :12], want[1, :, :12])
    assert pool.traffic.remapped_bytes == 2 * 2 * pool.value_row_bytes(0) and pool.traffic.device_copy_bytes > 0


def test_a_remap_the_system_refuses_leaves_the_rows_as_they_were_and_copies_from_then_on(caplog):
    pool = host_pool(rows=3)
    before = filled(pool, seed=8)

    def refused(source, destination, length):
        raise OSError(12, "mremap: Cannot allocate memory")

    pool._remap = refused
    pool.exchange_rows(0, 2, a_columns=9, b_columns=9)  # copied instead: the columns asked
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[0, :, :9], want[2, :, :9]) and np.array_equal(got[2, :, :9], want[0, :, :9])
    assert not any(pool._remaps) and pool.traffic.remapped_bytes == 0 and "copied from now on" in caplog.text


def test_a_move_under_cuda_is_the_2d_copy_of_the_columns_asked(monkeypatch):
    """move_row under CUDA (no pages to remap or give back): cudaMemcpy2D of the columns moved, run here as the same 2-D
    memory copies on the host pool, done when it returns; the source keeps its own K/V, none of it wanted."""
    pool = host_pool(rows=3, layers=2, heads=4, columns=257, width=16, remap_rows=False)
    before = filled(pool, seed=9)
    arrays, copies = as_under_cuda(pool, monkeypatch)
    assert pool.move_row(source=2, destination=0, columns=7, destination_columns=20, trade=True) == 7
    assert not copies.queued and copies.waits == 1
    for got, want in zip(arrays, before):
        assert np.array_equal(got[0, :, :7], want[2, :, :7]) and np.array_equal(got[0, :, 7:], want[0, :, 7:])
        assert np.array_equal(got[1:], want[1:])
    assert pool.traffic.device_copies == 1 and pool.traffic.remapped_bytes == 0


def test_rows_shorter_than_the_remap_line_are_copied_and_longer_ones_remapped():
    pool = SlotPool(3, 1, 4, 600, 1, np.float32, "cpu", KvTraffic())
    assert pool.remap_min_columns == 256 and all(pool._remaps)
    before = filled(pool, seed=10)
    pool.exchange_rows(0, 1, a_columns=100, b_columns=255)  # both short: copied
    assert pool.traffic.remapped_bytes == 0 and pool.traffic.device_copy_bytes > 0
    assert pool.move_row(source=1, destination=2, columns=100, destination_columns=100) == 100  # short: copied, kept
    assert pool.traffic.remapped_bytes == 0
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[2, :, :100], want[0, :, :100])  # (row 1 held row 0's first 100 after the exchange)
    before = [array.copy() for array in pool.arrays]
    pool.move_row(source=2, destination=0, columns=256)  # long enough: remapped, no byte copied
    copied = pool.traffic.device_copy_bytes
    assert pool.traffic.remapped_bytes == 2 * pool.value_row_bytes(0) and pool.traffic.device_copy_bytes == copied
    for got, want in zip(pool.arrays, before):
        assert np.array_equal(got[0], want[2]) and not got[2].any() and np.array_equal(got[1], want[1])
