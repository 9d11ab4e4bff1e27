"""The KV cache: cached decoding equals recomputation, padding changes nothing, shapes are (B, H, S, d_k)."""

import torch

from kvserve.model.generate import generate, left_pad, position_ids_from_mask


@torch.no_grad()
def test_cache_shapes_are_per_layer_per_head(tiny_model):
    config = tiny_model.config
    ids, mask = left_pad([[1, 2, 3, 4, 5]])
    _, present = tiny_model(ids, mask, position_ids_from_mask(mask), tiny_model.empty_cache(1))
    assert len(present) == config.n_layer
    for k, v in present:
        assert k.shape == v.shape == (1, config.n_head, 5, config.d_head)


@torch.no_grad()
def test_cached_decode_equals_full_recompute(tiny_model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    result = generate(tiny_model, [prompt], 12)
    sequence = prompt + result.tokens[0].tolist()
    for step in range(12):
        prefix = sequence[: len(prompt) + step]
        ids, mask = left_pad([prefix])
        logits, _ = tiny_model(ids, mask, position_ids_from_mask(mask), tiny_model.empty_cache(1))
        assert (logits[0, -1] - result.step_logits[step, 0]).abs().max() <= 1e-5


@torch.no_grad()
def test_each_row_of_a_padded_batch_equals_that_prompt_alone(tiny_model):
    prompts = [[7], [10, 20, 30, 40, 50, 60, 70], [100, 101, 102]]
    batch = generate(tiny_model, prompts, 24)
    for row, prompt in enumerate(prompts):
        alone = generate(tiny_model, [prompt], 24)
        assert torch.equal(batch.tokens[row], alone.tokens[0])
        assert (batch.step_logits[:, row] - alone.step_logits[:, 0]).abs().max() <= 1e-4  # float32 rounding differs between batch shapes; logits are O(5)


@torch.no_grad()
def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    a = generate(tiny_model, [[1, 2, 3]], 20, temperature=1.0, top_k=50, top_p=0.9, seed=7).tokens
    b = generate(tiny_model, [[1, 2, 3]], 20, temperature=1.0, top_k=50, top_p=0.9, seed=7).tokens
    c = generate(tiny_model, [[1, 2, 3]], 20, temperature=1.0, top_k=50, top_p=0.9, seed=8).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
