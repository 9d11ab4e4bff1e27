"""The slots pool (runtime/pool.py): rows of K/V touched once, copies and exchanges of a row's used columns within the
pool's memory, counted in the runtime's traffic, and the 2-D copies CUDA runs, checked on host memory."""

import ctypes

import numpy as np

from kvserve.contract.config import DecoderConfig
from kvserve.runtime import KvTraffic, SlotPool, pool_capacity


def host_pool(rows: int = 3, layers: int = 2, heads: int = 2, columns: int = 9, width: int = 4) -> SlotPool:
    return SlotPool(rows, heads, width, columns, layers, np.float32, "cpu", KvTraffic())


def filled(pool: SlotPool, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    for array in pool.arrays:
        array[...] = rng.normal(size=array.shape)
    return [array.copy() for array in pool.arrays]


def test_a_pool_is_every_layers_k_and_v_zeroed_and_a_row_past_the_context_is_scratch():
    pool = host_pool()
    assert len(pool.arrays) == len(pool.values) == 2 * 2 and pool.shape == (3, 2, 9, 4)
    assert all(not array.any() for array in pool.arrays)  # touched (zeroed) before any step
    assert pool.row_bytes == 2 * 9 * 4 * 4  # one layer's K of one row
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
