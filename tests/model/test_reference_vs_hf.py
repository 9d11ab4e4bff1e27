"""The eager reference against transformers' GPT2LMHeadModel: same weights, same logits, same tokens."""

import numpy as np
import pytest

from kvserve.model.checkpoint import load_checkpoint
from kvserve.model.generate import generate
from tests.hf_reference import hf_greedy, padded_logits_gap

CONFIGS = {
    # heads other than 12, d_model not a power of two, an MLP width that is not 4 x d_model
    "6 heads x 48": dict(vocab_size=300, n_positions=96, n_embd=48, n_head=6, n_layer=3),
    "5 heads x 80": dict(vocab_size=1000, n_positions=128, n_embd=80, n_head=5, n_layer=2, n_inner=200),
    "3 heads x 96": dict(vocab_size=512, n_positions=80, n_embd=96, n_head=3, n_layer=4, layer_norm_epsilon=1e-6),
}
PROMPTS = [[5, 17, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [250], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, make_hf_checkpoint):
    hf, directory = make_hf_checkpoint(seed=len(request.param), **CONFIGS[request.param])
    return hf, load_checkpoint(directory)


def test_logits_match_transformers_on_a_padded_batch(pair):
    hf, ours = pair
    assert padded_logits_gap(hf, ours, PROMPTS) <= 1e-5


def test_greedy_generation_matches_transformers_token_for_token(pair):
    hf, ours = pair
    mine = generate(ours, PROMPTS, 40).tokens.numpy()  # (4, 40)
    np.testing.assert_array_equal(mine, hf_greedy(hf, PROMPTS, 40))
