"""The Llama-family eager reference against transformers' LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM:
same weights (saved by save_pretrained, loaded by kvserve), same logits, same tokens, every cache layout."""

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
    pool = ours.empty_cache(2, capacity)
    _, pool = ours.forward_slots(
        torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1), capacity - 1), torch.ones(2, 1, dtype=torch.int64),
        sequence[:, :4], torch.arange(4)[None], torch.ones(1, 4, dtype=torch.int64), torch.tensor([0]), torch.tensor([5]), pool,
    )
    logits, pool = ours.forward_slots(
        sequence[:, 4:5].expand(2, 1), torch.tensor([[4], [capacity - 1]]), (torch.arange(5) <= 4).long()[None].expand(2, 5),
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
