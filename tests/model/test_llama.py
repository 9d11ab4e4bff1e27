"""The Llama-family eager reference against transformers' own ForCausalLM of each family (Llama, Qwen2, Mistral, Qwen3,
Gemma 2, Gemma 3, Phi-3, SmolLM3; tests/conftest.py LLAMA_CONFIGS): same weights (saved by save_pretrained, loaded by
kvserve), same logits, same tokens, every cache layout."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvserve.model.checkpoint import load_checkpoint
from kvserve.model.generate import generate
from kvserve.model.llama import Llama
from tests.conftest import LLAMA_CONFIGS
from tests.hf_reference import hf_greedy, padded_logits_gap

PROMPTS = [[5, 17, 42], [1, 3, 4, 5, 6, 7, 8, 9, 10], [250], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module", params=list(LLAMA_CONFIGS), ids=list(LLAMA_CONFIGS))
def pair(request, make_hf_llama):
    model_type, config = LLAMA_CONFIGS[request.param]
    hf, directory = make_hf_llama(model_type, seed=len(request.param), **config)
    return hf, load_checkpoint(directory)


def test_config_is_read_as_written(pair):
    hf, ours = pair
    config = ours.config
    assert config.architecture == "llama" and config.model_type == hf.config.model_type
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert (config.n_head, config.n_kv_head, config.head_dim) == (hf.config.num_attention_heads, hf.config.num_key_value_heads, head_dim)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    # the cache holds the K/V heads, not the query heads
    assert ours.empty_cache(2, 5)[0][0].shape == (2, hf.config.num_key_value_heads, 5, head_dim)


def test_logits_match_transformers_on_a_padded_batch(pair):
    hf, ours = pair
    # Most configs agree to the bit; with one K/V head (grouped here, repeated there) the matrix products sum in
    # another order: 1.2e-6 of the largest logit on an AMD EPYC with AVX2 only. The bound leaves 4x for CPUs whose
    # kernels sum otherwise (AVX-512, AMX); any arithmetic that differs moves logits by 1e-3 and more (the mutations).
    assert padded_logits_gap(hf, ours, PROMPTS, relative=True) <= 5e-6


def test_greedy_generation_matches_transformers_token_for_token(pair):
    hf, ours = pair
    mine = generate(ours, PROMPTS, 40).tokens.numpy()  # (4, 40)
    assert len(set(mine[0].tolist())) > 3  # a continuation that depends on its context, not one token repeated
    np.testing.assert_array_equal(mine, hf_greedy(hf, PROMPTS, 40))


def test_rotary_frequencies_and_attention_factor_equal_transformers(pair):
    """Bit for bit: a frequency off in its last place turns into a visible angle error thousands of positions in."""
    hf, ours = pair
    rotary = hf.model.rotary_emb
    if hasattr(rotary, "full_attention_inv_freq"):  # Gemma 3: a base per layer type
        assert ours.rotary.inv_freq == rotary.full_attention_inv_freq.tolist()
        assert ours.local_rotary.inv_freq == rotary.sliding_attention_inv_freq.tolist()
        assert ours.rotary.scale == rotary.full_attention_attention_scaling
        return
    assert ours.rotary.inv_freq == rotary.inv_freq.tolist()
    assert ours.rotary.scale == rotary.attention_scaling


@torch.no_grad()
def test_every_cache_layout_gives_the_same_logits(pair):
    """concat decode steps and a slots step (decode rows beside a prompt chunk) both equal a
    full forward over the whole sequence (within float32 noise: logits here reach 10, and the sums run in another order)."""
    close = 1e-4
    _, ours = pair
    sequence = torch.tensor([[7, 8, 9, 10, 11, 12, 13]])
    T = sequence.shape[1]
    full, _ = ours(sequence, torch.ones_like(sequence), torch.arange(T)[None], ours.empty_cache(1))

    _, past = ours(sequence[:, :4], torch.ones(1, 4, dtype=torch.int64), torch.arange(4)[None], ours.empty_cache(1))
    for t in range(4, T):  # concat: one token at a time
        step, past = ours(sequence[:, t : t + 1], torch.ones(1, t + 1, dtype=torch.int64), torch.tensor([[t]]), past)
        assert (step[0, -1] - full[0, t]).abs().max() <= close

    capacity = T + 3  # a pool row wider than the sequence
    # slots: row 0 decodes its 5th token while row 1's prompt (the same sequence) runs as one chunk
    pool = ours.empty_cache(2, capacity, rings=True)
    scratch = ours.config.n_ctx if ours.config.kv_ring else capacity - 1  # io_contract: a ring graph's scratch position
    _, pool = ours.forward_slots(
        torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1), scratch), torch.ones(2, 1, dtype=torch.int64),
        sequence[:, :4], torch.arange(4)[None], torch.ones(1, 4, dtype=torch.int64), torch.tensor([0]), torch.tensor([5]), pool,
    )
    logits, pool = ours.forward_slots(
        sequence[:, 4:5].expand(2, 1), torch.tensor([[4], [scratch]]), (torch.arange(5) <= 4).long()[None].expand(2, 5),
        sequence, torch.arange(T)[None], torch.ones(1, T, dtype=torch.int64), torch.tensor([1]), torch.tensor([0, 2 + T - 1]), pool,
    )
    assert (logits[0] - full[0, 4]).abs().max() <= close  # row 0's decode token
    assert (logits[1] - full[0, T - 1]).abs().max() <= close  # the chunk's last token


LONGROPE = [name for name in LLAMA_CONFIGS if "longrope" in name]


@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_past_the_original_context_matches_transformers_token_for_token(make_hf_llama, name):
    """A prompt that crosses the original context while it generates (transformers recomputes its cache there, and so
    does generate), one longer than it from the start (long factors throughout), one that stays within (short)."""
    model_type, config = LLAMA_CONFIGS[name]
    hf, directory = make_hf_llama(model_type, seed=len(name), **config)
    ours = load_checkpoint(directory)
    after = ours.config.long_rope_after
    prompts = [[(7 * j) % 290 + 3 for j in range(after - 5)], [(3 * j) % 290 + 5 for j in range(after + 6)], [5, 17, 42]]
    mine = generate(ours, prompts, 24).tokens.numpy()  # (3, 24)
    np.testing.assert_array_equal(mine, hf_greedy(hf, prompts, 24))
    rotary = hf.model.rotary_emb
    assert ours.rotary.long_inv_freq == rotary.long_inv_freq.tolist() != ours.rotary.inv_freq  # set by the long prompts
    # the long factors matter: a model whose long set is its short one continues both long prompts otherwise
    scaling = ours.config.rope_scaling
    short_only = Llama(replace(ours.config, rope_scaling=replace(scaling, long_factor=scaling.short_factor)))
    short_only.load_state_dict(ours.state_dict())
    differs = generate(short_only, prompts, 24).tokens.numpy() != mine  # (3, 24)
    assert differs[0, 6:].any() and differs[1].any() and not differs[2].any()


@pytest.mark.parametrize("name", [name for name in LLAMA_CONFIGS if "dynamic-rope" in name])
def test_dynamic_rope_up_to_the_last_position_of_the_context_matches_transformers(make_hf_llama, name):
    """Dynamic NTK RoPE raises its base only for sequences past max_position_embeddings, the context kvserve serves: a
    sequence that ends on the context's last position turns as transformers turns it, and the context is not stretched."""
    model_type, config = LLAMA_CONFIGS[name]
    hf, directory = make_hf_llama(model_type, seed=len(name), **config)
    ours = load_checkpoint(directory)
    assert ours.config.rope_scaling.rope_type == "dynamic" and ours.config.n_ctx == hf.config.max_position_embeddings
    prompt = [[(5 * j) % 250 + 3 for j in range(ours.config.n_ctx - 24)]]
    np.testing.assert_array_equal(generate(ours, prompt, 24).tokens.numpy(), hf_greedy(hf, prompt, 24))
    assert ours.rotary.inv_freq == hf.model.rotary_emb.original_inv_freq.tolist()


WINDOWED = [name for name in LLAMA_CONFIGS if LLAMA_CONFIGS[name][1].get("sliding_window") and
            LLAMA_CONFIGS[name][1].get("use_sliding_window", True)]


@torch.no_grad()
@pytest.mark.parametrize("name", WINDOWED)
def test_ring_rows_hold_the_window_and_give_the_whole_rows_logits(make_hf_llama, name):
    """A standard slots pool whose windowed layers are rings (DecoderConfig.kv_ring: the window and a block, then the
    scratch column) gives the logits of a full forward, and of transformers, far past the ring: decode rows of two
    lengths; prompt chunks longer than the ring, shorter, and one that wraps; a row that took another row's ring
    with a prefix a few tokens short of that row's end (what the prompt cache hands on) goes on as a cold one would."""
    model_type, config = LLAMA_CONFIGS[name]
    hf, directory = make_hf_llama(model_type, seed=5, **config)
    ours = load_checkpoint(directory)
    ring, rings = ours.config.kv_ring, set(ours.config.ring_layers())
    assert ring == ours.config.sliding_window + 16 and rings == set(ours.config.sliding_layers)
    T = 2 * ring + 9
    sequence = torch.tensor([[(13 * i + 7) % 250 + 3 for i in range(T)]])  # (1, T)
    full, _ = ours(sequence, torch.ones_like(sequence), torch.arange(T)[None], ours.empty_cache(1))  # (1, T, V)
    theirs = hf(sequence).logits  # (1, T, V)
    assert (full - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    capacity = ours.config.n_ctx + 1
    pool = ours.empty_cache(3, capacity, rings=True)
    assert all(pool[layer][0].shape[2] == (ring + 1 if layer in rings else capacity) for layer in range(ours.config.n_layer))
    scratch = ours.config.n_ctx
    none = torch.zeros(1, 0, dtype=torch.int64)

    def chunk(row: int, start: int, end: int, decode_tokens=None, decode_positions=None):
        """Row's tokens [start, end) as one chunk, beside decode tokens of rows 0..B-1 (scratch unless given)."""
        tokens = torch.zeros(3, 1, dtype=torch.int64) if decode_tokens is None else decode_tokens
        positions = torch.full((3, 1), scratch) if decode_positions is None else decode_positions
        width = int(positions[positions < scratch].max()) + 1 if (positions < scratch).any() else 1
        mask = (torch.arange(width)[None] <= positions).long()  # (3, W)
        piece = sequence[:, start:end]
        index = torch.cat([torch.arange(3), 3 + torch.arange(end - start)])
        return ours.forward_slots(tokens, positions, mask, piece, torch.arange(start, end)[None], torch.ones(1, end, dtype=torch.int64),
                                  torch.tensor([row]), index, pool)

    # row 0: a chunk longer than the ring, then one of 5, then decode steps; row 1: chunks of 3; row 2 stays empty
    logits, pool = chunk(0, 0, ring + 7)
    assert (logits[3:] - full[0, : ring + 7]).abs().max() <= 1e-4 * full.abs().max()
    logits, pool = chunk(0, ring + 7, ring + 12)
    assert (logits[3:] - full[0, ring + 7 : ring + 12]).abs().max() <= 1e-4 * full.abs().max()
    for start in range(0, 9, 3):
        logits, pool = chunk(1, start, start + 3)
    # a chunk of more than 16 tokens that wraps: its later tokens overwrite positions its earlier ones still see
    logits, pool = chunk(1, 9, 29)
    assert (logits[3:] - full[0, 9:29]).abs().max() <= 1e-4 * full.abs().max()
    lengths = [ring + 12, 29]
    while lengths[0] < T:
        positions = torch.tensor([[lengths[0]], [lengths[1]], [scratch]])
        tokens = torch.tensor([[sequence[0, lengths[0]]], [sequence[0, lengths[1]]], [0]])
        logits, pool = chunk(2, 0, 0, tokens, positions)  # decode only: an empty chunk
        for row in (0, 1):
            assert (logits[row] - full[0, lengths[row]]).abs().max() <= 1e-4 * full.abs().max(), (row, lengths[row])
        lengths = [n + 1 for n in lengths]
    # row 2 takes row 0's rings and whole-context columns as the pool copies them (SlotPool.copy_columns: min(P, ring)
    # ring columns) for a prefix of T - 16 tokens (row 0 wrote T), then prefills the rest and decodes
    taken = T - 16
    pool = [tuple(part.clone() for part in layer) for layer in pool]
    for layer, (k, v) in enumerate(pool):
        columns = min(taken, ring) if layer in rings else taken
        k[2, :, :columns], v[2, :, :columns] = k[0, :, :columns], v[0, :, :columns]
    logits, pool = chunk(2, taken, T - 1)
    assert (logits[3:] - full[0, taken : T - 1]).abs().max() <= 1e-4 * full.abs().max()
