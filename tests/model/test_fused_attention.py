"""The fused slots step in eager torch (model/fused_attention.py's operator, what ONNX Runtime's GroupQueryAttention
computes), for the Llama family (rotated) and GPT-2 (not), with K/V stored as computed, in float16 or in int8
(model/kv_storage.py): prompts prefilled a chunk at a time into their rows, then rows decoding a token each, equal a
full forward whose cache stores K/V the same way."""

import contextlib

import pytest
import torch

from kvserve.model.fused_attention import supports_fused_attention
from kvserve.model.kv_storage import STORED_TYPES, kv_stored_as, kv_stores, read_back


def rows_of(cache, rows: slice):
    return [(k[rows], v[rows]) for k, v in cache]


def put_rows(cache, rows: slice, written):
    for (k, v), (new_k, new_v) in zip(cache, written):
        k[rows], v[rows] = new_k, new_v


NO_CHUNK = (torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.int64))  # chunk_ids, chunk_position_ids


def int8_scales(model):
    """Scales that round most K/V and clip a few: each (L, H_kv, d_k), a fifth of a channel's largest |value| over 127
    short of it on a random sequence."""
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    _, present = model(ids, torch.ones_like(ids), torch.arange(32)[None], model.empty_cache(1))
    largest = torch.stack([torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]) for k, v in present])  # (L, 2, H_kv, d_k)
    return (0.8 * largest / 127)[:, 0], (0.8 * largest / 127)[:, 1]


# How far the fused path's logits and K/V may be from the full forward's, of their largest |value|: float arithmetic in
# another order, and where K/V are rounded, a value that now and then rounds to the neighbouring stored one (float16: a
# unit in the last place, 2^-10 of it; int8: one scale, 0.8 / 127 of the channel's range here).
STORED_BOUNDS = {None: (1e-5, 1e-5), "float16": (1e-4, 2e-3), "int8": (1e-3, 1e-2)}


@pytest.mark.parametrize("stored", [None, "float16", "int8"])
@pytest.mark.parametrize("family", ["tiny_llama_model", "tiny_model"])
@torch.no_grad()
def test_fused_steps_equal_a_full_forward(family, stored, request):
    model = request.getfixturevalue(family)
    with kv_stored_as(model, stored, *(int8_scales(model) if stored == "int8" else ())) if stored else contextlib.nullcontext():
        fused_steps_equal_a_full_forward(model, stored)


def fused_steps_equal_a_full_forward(model, stored):
    config = model.config
    assert supports_fused_attention(config.head_dim)
    bound, kv_bound = STORED_BOUNDS[stored]
    sequence = torch.randint(0, config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    full, _ = model(sequence, torch.ones_like(sequence), torch.arange(14)[None].expand(2, 14), model.empty_cache(2))
    pool = [(k.to(STORED_TYPES[stored]), v.to(STORED_TYPES[stored])) if stored else (k, v) for k, v in model.empty_cache(2, config.n_ctx + 1)]
    scale = full.abs().max()
    # row 0's prompt in chunks of 4 and 3 as the step's only row (no chunk beside it)
    for start, end in ((0, 4), (4, 7)):
        logits, written, untouched = model.forward_slots_fused(
            sequence[:1, start:end], torch.arange(start, end)[None], *NO_CHUNK, torch.arange(end - start), rows_of(pool, slice(0, 1)),
            rows_of(pool, slice(1, 2)),
        )
        put_rows(pool, slice(0, 1), written)
        assert all(torch.equal(k, pk) and torch.equal(v, pv) for (k, v), (pk, pv) in zip(untouched, rows_of(pool, slice(1, 2))))
        assert (logits - full[0, start:end]).abs().max() <= bound * scale
    # row 0 decodes its positions 7.. while row 1's prompt goes in beside it, chunks of 6 and 4 (positions 0..9)
    for step, (start, end) in enumerate(((0, 6), (6, 10))):
        logits, written, chunk_written = model.forward_slots_fused(
            sequence[:1, 7 + step : 8 + step], torch.tensor([[7 + step]]), sequence[1:, start:end], torch.arange(start, end)[None],
            torch.tensor([end - start, 0]), rows_of(pool, slice(0, 1)), rows_of(pool, slice(1, 2)),
        )
        put_rows(pool, slice(0, 1), written)
        put_rows(pool, slice(1, 2), chunk_written)
        assert (logits[1] - full[0, 7 + step]).abs().max() <= bound * scale
        assert (logits[0] - full[1, end - 1]).abs().max() <= bound * scale
    # both rows decode a token each, at their own lengths (9 and 10): each reads its own columns only
    for step in range(3):
        positions = torch.tensor([[9 + step], [10 + step]])  # (B, 1)
        logits, written, _ = model.forward_slots_fused(sequence.gather(1, positions), positions, *NO_CHUNK, torch.tensor([1, 0]), pool,
                                                       rows_of(pool, slice(0, 1)))
        put_rows(pool, slice(0, 2), written)
        assert (logits[1] - full[0, 9 + step]).abs().max() <= bound * scale
        assert (logits[0] - full[1, 10 + step]).abs().max() <= bound * scale
    # what each row holds is the full forward's K/V at its real positions
    _, present = model(sequence, torch.ones_like(sequence), torch.arange(14)[None].expand(2, 14), model.empty_cache(2))
    for layer, ((k, v), (want_k, want_v)) in enumerate(zip(pool, present)):
        store = kv_stores(model)[layer].kv_store
        k = read_back(k, None if store is None else store.key_scale, torch.float32)  # (B, H_kv, C, d_k): as attention read them
        v = read_back(v, None if store is None else store.value_scale, torch.float32)
        for row, length in ((0, 12), (1, 13)):
            assert (k[row, :, :length] - want_k[row, :, :length]).abs().max() <= kv_bound * want_k.abs().max()
            assert (v[row, :, :length] - want_v[row, :, :length]).abs().max() <= kv_bound * want_v.abs().max()


@pytest.mark.parametrize("head_dim, fused", [(16, True), (32, True), (64, True), (24, False), (40, False), (8, False)])
def test_fused_attention_needs_head_dim_a_multiple_of_16(head_dim, fused):
    assert supports_fused_attention(head_dim) is fused
    assert supports_fused_attention(head_dim, head_dim // 4 * 3) is (fused and head_dim // 4 * 3 % 16 == 0)  # a partial rotation
