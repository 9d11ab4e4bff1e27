"""The fused slots step in eager torch (model/fused_attention.py's operator, what ONNX Runtime's GroupQueryAttention
computes): prompts prefilled a chunk at a time into their rows, then decode rows beside a chunk, equal a full forward."""

import pytest
import torch

from kvserve.model.fused_attention import supports_fused_attention


def rows_of(cache, rows: slice):
    return [(k[rows], v[rows]) for k, v in cache]


def put_rows(cache, rows: slice, written):
    for (k, v), (new_k, new_v) in zip(cache, written):
        k[rows], v[rows] = new_k, new_v


@torch.no_grad()
def test_fused_steps_equal_a_full_forward(tiny_llama_model):
    model = tiny_llama_model
    config = model.config
    assert supports_fused_attention(config.head_dim)
    sequence = torch.randint(0, config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    full, _ = model(sequence, torch.ones_like(sequence), torch.arange(14)[None].expand(2, 14), model.empty_cache(2))
    pool = model.empty_cache(3, config.n_ctx + 1)  # rows 0 and 1, and row 2 for throwaway decode tokens
    spare = slice(2, 3)
    token = torch.zeros(1, 1, dtype=torch.int64)
    # row 0's prompt in chunks of 4 and 3, row 1's in one chunk of 10; the decode part is the spare row's token at column 0
    for row, start, end in ((0, 0, 4), (0, 4, 7), (1, 0, 10)):
        logits, decode_rows, chunk_row = model.forward_slots_fused(
            token, token, sequence[row : row + 1, start:end], torch.arange(start, end)[None], torch.arange(1, 1 + end - start),
            rows_of(pool, spare), rows_of(pool, slice(row, row + 1)),
        )
        put_rows(pool, spare, decode_rows)
        put_rows(pool, slice(row, row + 1), chunk_row)
        assert (logits - full[row, start:end]).abs().max() <= 1e-5 * full.abs().max()
    # row 0 decodes its position 7 while row 1's chunk of 3 (positions 10..12) goes through the chunk part
    logits, decode_rows, chunk_row = model.forward_slots_fused(
        sequence[:1, 7:8], torch.tensor([[7]]), sequence[1:, 10:13], torch.arange(10, 13)[None], torch.tensor([0, 3]),
        rows_of(pool, slice(0, 1)), rows_of(pool, slice(1, 2)),
    )
    assert (logits[0] - full[0, 7]).abs().max() <= 1e-5 * full.abs().max()
    assert (logits[1] - full[1, 12]).abs().max() <= 1e-5 * full.abs().max()
    # what each row holds is the full forward's K/V at its real positions
    _, present = model(sequence[:1, :8], torch.ones(1, 8, dtype=torch.int64), torch.arange(8)[None], model.empty_cache(1))
    for (k, v), (want_k, want_v) in zip(decode_rows, present):
        assert (k[0, :, :8] - want_k[0]).abs().max() <= 1e-5 * want_k.abs().max()
        assert (v[0, :, :8] - want_v[0]).abs().max() <= 1e-5 * want_v.abs().max()


@pytest.mark.parametrize("head_dim, fused", [(16, True), (32, True), (64, True), (24, False), (40, False), (8, False)])
def test_fused_attention_needs_head_dim_a_multiple_of_16(head_dim, fused):
    assert supports_fused_attention(head_dim) is fused
