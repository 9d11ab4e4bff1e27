"""The decoder config (contract/config.py): derived defaults resolved once, and a config that cannot describe a model
refused by name."""

import pytest

from kvserve.contract.config import GPT2_ARCH, LLAMA_ARCH, DecoderConfig, RopeScaling

SMALL = dict(vocab_size=100, n_ctx=32, d_model=32, n_head=4, n_layer=1, d_mlp=64, eos_token_ids=(0,))


def test_derived_fields_are_resolved_once():
    gpt2 = DecoderConfig(**SMALL)
    assert (gpt2.n_kv_head, gpt2.head_dim, gpt2.d_head, gpt2.architecture, gpt2.eos_token_id) == (4, 8, 8, GPT2_ARCH, 0)
    llama = DecoderConfig(model_type="qwen2", **{**SMALL, "eos_token_ids": ()}, n_kv_head=2, head_dim=16)
    assert (llama.architecture, llama.n_kv_head, llama.head_dim, llama.eos_token_id) == (LLAMA_ARCH, 2, 16, None)


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="falcon"), "unsupported model_type 'falcon'"),
    (dict(n_layer=0), "DecoderConfig.n_layer must be positive"),
    (dict(n_head=5), r"d_model \(32\) is not divisible by n_head \(5\)"),
    (dict(n_kv_head=2), "DecoderConfig.n_kv_head is a Llama-family setting"),
    (dict(model_type="llama", n_kv_head=3), r"n_head \(4\) is not a multiple of n_kv_head \(3\)"),
    (dict(model_type="llama", head_dim=7), r"head_dim \(7\) x partial_rotary_factor \(1.0\) = 7 rotated channels: must be even"),
    (dict(model_type="phi3", head_dim=12, partial_rotary_factor=0.25), r"= 3 rotated channels: must be even"),
    (dict(model_type="llama", sliding_window=4, sliding_layers=(0,)), "model_type 'llama' has no sliding window"),
    (dict(model_type="mistral", sliding_window=4, sliding_layers=(5,)), r"sliding_layers \(5,\) needs a sliding_window and layers 0 .. 0"),
    (dict(model_type="gemma2", hidden_act="relu"), "hidden_act 'relu': kvserve implements silu, gelu_pytorch_tanh"),
    (dict(model_type="gemma2", attn_logit_softcapping=0.0), "attn_logit_softcapping must be positive and finite, or None"),
    (dict(model_type="gemma2", final_logit_softcapping=float("inf")), "final_logit_softcapping must be positive and finite, or None"),
    (dict(model_type="llama", rope_theta=float("nan")), "DecoderConfig.rope_theta must be a finite number, got nan"),
    (dict(layer_norm_eps=float("inf")), "DecoderConfig.layer_norm_eps must be a finite number, got inf"),
    (dict(qk_norm=True), "DecoderConfig.qk_norm is a Llama-family setting"),
    (dict(eos_token_ids=(100,)), "eos_token_id 100 is outside the vocabulary"),
])
def test_a_config_that_cannot_describe_a_model_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**SMALL, **fields})


@pytest.mark.parametrize("fields, message", [
    # a ZeroDivisionError while the tables were built at equal factors, NaN frequencies with them reversed
    (dict(factor=2.0, low_freq_factor=2.0, high_freq_factor=1.0), "must be 0 < low < high, got 2.0 and 1.0"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1), r"must be in \[2, 2147483648\), got 1"),  # yarn takes its log
    (dict(rope_type="linear", factor=-2.0), "rope_scaling's factor must be positive, got -2.0"),
    (dict(rope_type="yarn", factor=4.0, beta_fast=float("inf")), "rope_scaling's beta_fast must be a finite number, got inf"),
])
def test_a_rope_scaling_that_cannot_turn_frequencies_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(**fields)
