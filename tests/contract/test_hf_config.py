"""transformers' config.json <-> DecoderConfig (contract/hf_config.py), torch-free: a config reads back as itself, every
preset survives the trip, and what kvserve does not implement is refused by name."""

import json

import pytest

from kvserve.contract.config import DecoderConfig
from kvserve.contract.hf_config import config_from_hf, config_to_hf
from kvserve.model.presets import PRESETS, preset


def test_hf_config_round_trip():
    config = DecoderConfig(vocab_size=300, n_ctx=64, d_model=48, n_head=6, n_layer=3, d_mlp=100, eos_token_ids=(299,))
    assert config_from_hf(config_to_hf(config)) == config


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_survives_config_json(name):
    """An artifact's config.json is how export and serve agree on the model: every preset must read back as itself."""
    assert config_from_hf(json.loads(json.dumps(config_to_hf(preset(name))))) == preset(name)



LLAMA = {"model_type": "llama", "vocab_size": 100, "max_position_embeddings": 64, "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 48, "rms_norm_eps": 1e-5, "eos_token_id": 2,
         "hidden_act": "silu", "tie_word_embeddings": False}


def test_a_llama_config_maps_its_fields_and_generation_configs_eos_list_wins():
    config = config_from_hf(LLAMA, {"eos_token_id": [2, 3, 500]})
    assert (config.n_head, config.n_kv_head, config.head_dim, config.n_ctx, config.d_mlp) == (4, 2, 8, 64, 48)
    assert config.eos_token_ids == (2, 3) and not config.tie_word_embeddings  # 500 is outside the vocabulary: dropped


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "falcon"}, "unsupported architecture: model_type 'falcon'"),
    ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_scaling of type 'dynamic' lacks factor"),
    ({"rope_scaling": {"rope_type": "su", "factor": 4.0}}, r"unsupported rope_type 'su' \(kvserve implements 'default', 'linear', 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
     "'longrope' lacks original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}, "original_max_position_embeddings": 32},
     r"longrope's factors: 3 given, one per frequency \(4\) wanted"),
    ({"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 32}}, "'longrope' lacks short_factor, long_factor"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
    ({"model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "unsupported hidden_act 'gelu' \\(kvserve implements gemma2's GeGLU"),
    ({"rope_scaling": {"rope_type": "su"}}, "unsupported rope_type 'su'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' lacks original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "'llama3' lacks low_freq_factor, high_freq_factor, original_max"),
    ({"rope_scaling": {"rope_type": "linear"}}, "'linear' lacks factor"),
    ({"sliding_window": 0, "model_type": "mistral"}, "sliding_window must be a positive integer, got 0"),
    ({"sliding_window": 8, "model_type": "qwen2", "use_sliding_window": True, "layer_types": ["sliding_attention"]},
     "layer_types must name each of the 2 layers"),
    ({"vocab_size": "x"}, 'vocab_size must be a number, got "x"'),  # int("x") would name no field
    ({"rms_norm_eps": [1e-5]}, r"rms_norm_eps must be a number, got \[1e-05\]"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a number, got true"),
    # each of these raised an OverflowError or ZeroDivisionError (a traceback from export), or built a model of NaN logits
    ({"max_position_embeddings": float("inf")}, "max_position_embeddings must be a number, got Infinity"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a number, got NaN"),
    ({"num_attention_heads": 0.5}, r"num_attention_heads must be a whole number in \[1, 2147483648\), got 0.5"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be a whole number in \[1, 2147483648\), got 0"),
    ({"num_hidden_layers": 1e30}, "num_hidden_layers must be a whole number in"),
    ({"rms_norm_eps": -1e-5}, "layer_norm_eps must be at least 0, got -1e-05"),
    ({"rope_theta": 1.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     "rope_theta, the rotary frequencies' base, must be above 1, got 1.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
     "'llama3' blends between low_freq_factor and high_freq_factor, which must be 0 < low < high, got 0.0 and 4.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4, "high_freq_factor": 4, "original_max_position_embeddings": 16}},
     "0 < low < high, got 4.0 and 4.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "rope_scaling's factor must be a finite number, got nan"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling's factor must be positive, got 0.0"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 0.0, 1.0, 1.0], "long_factor": [2.0] * 4}, "original_max_position_embeddings": 32},
     "every short_factor and long_factor must be a positive finite number"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}, "original_max_position_embeddings": 1},
     r"original_max_position_embeddings must be a whole number in \[2, 2147483648\), got 1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1e30}},
     r"original_max_position_embeddings must be a whole number in \[2, 2147483648\)"),
    ({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": float("inf")},
     "final_logit_softcapping must be a number, got Infinity"),
    ({"rope_parameters": 1}, "rope_parameters must be an object, got 1"),  # an AttributeError
    ({"rope_scaling": ["linear", 2.0]}, r'rope_scaling must be an object, got \["linear", 2.0\]'),
    ({"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": {"full_attention": {}, "sliding_attention": 5}},
     "rope_parameters' sliding_attention must be an object, got 5"),
])
def test_what_kvserve_does_not_implement_is_refused_by_name(edit, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**LLAMA, **edit})


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0, "mscale": 0.7, "mscale_all_dim": 1.0,
     "truncate": False},
], ids=["linear", "llama3", "yarn", "yarn mscale"])
def test_each_rope_scaling_reads_back_as_itself_in_both_spellings(scaling):
    """transformers 4's rope_scaling and 5's rope_parameters name the same fields; what is written reads back unchanged."""
    old = config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": scaling})
    new = config_from_hf({**LLAMA, "rope_parameters": {"rope_theta": 5e5, **scaling}})
    assert old == new and old.rope_scaling.rope_type == scaling["rope_type"] and old.rope_scaling.factor == scaling["factor"]
    assert config_from_hf(json.loads(json.dumps(config_to_hf(old)))) == old


def test_a_qwen3_config_reads_its_norms_and_biases():
    qwen3 = {**LLAMA, "model_type": "qwen3", "head_dim": 64, "attention_bias": True, "use_sliding_window": False, "sliding_window": 16}
    config = config_from_hf(qwen3)
    assert config.qk_norm and config.qkv_bias and config.o_bias and config.head_dim == 64  # head_dim apart from hidden_size / heads
    assert config_from_hf(config_to_hf(config)) == config
    assert not config_from_hf({**LLAMA, "model_type": "qwen2"}).qk_norm


def test_a_phi3_longrope_config_keeps_its_whole_context_both_factor_sets_and_its_attention_factor():
    phi3 = {**LLAMA, "model_type": "phi3", "max_position_embeddings": 256, "original_max_position_embeddings": 64,
            "rope_scaling": {"type": "su", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]}, "partial_rotary_factor": 0.5}
    config = config_from_hf(phi3)
    assert config.n_ctx == 256 and config.rope_scaling.rope_type == "longrope" and config.rope_scaling.factor == 4.0  # 256 / 64
    assert config.rotary_dim == 4 and config.rope_scaling.short_factor == (1.0, 1.5) and config.rope_scaling.long_factor == (2.0, 3.0)
    assert config.long_rope_after == 64 and config_from_hf(LLAMA).long_rope_after is None
    assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


@pytest.mark.parametrize("edit, layers", [
    ({"model_type": "mistral", "sliding_window": 16}, (0, 1)),
    ({"model_type": "mistral", "sliding_window": 64}, ()),  # the whole context: no window
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}, (1,)),
    ({"model_type": "qwen2", "sliding_window": 16}, ()),  # use_sliding_window defaults to false, as transformers has it
    ({"model_type": "qwen3", "sliding_window": 16, "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"]}, (0,)),
])
def test_sliding_windows_are_read_as_transformers_reads_them(edit, layers):
    config = config_from_hf({**LLAMA, **edit})
    assert config.sliding_layers == layers and (config.sliding_window is None) == (not layers)
    assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


@pytest.mark.parametrize("model_type, attention_cap", [("gemma2", 7.0), ("gemma3_text", None)])
def test_gemma_soft_caps_are_those_transformers_applies(model_type, attention_cap):
    """Gemma 2 caps its attention scores and its logits; Gemma 3 keeps attn_logit_softcapping in its config but
    transformers' Gemma3Attention never applies it (Q/K norms bound its scores), so kvserve applies none either."""
    config = config_from_hf({**LLAMA, "model_type": model_type, "hidden_act": "gelu_pytorch_tanh", "attn_logit_softcapping": 7.0,
                             "final_logit_softcapping": 9.0})
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (attention_cap, 9.0)
