"""transformers' config.json <-> DecoderConfig (contract/hf_config.py), torch-free: a config reads back as itself, every
preset survives the trip, and what kvserve does not implement is refused by name."""

import json

import pytest

from kvserve.contract.config import DecoderConfig
from kvserve.contract.hf_config import config_from_hf, config_to_hf
from kvserve.model.presets import preset


def test_hf_config_round_trip():
    config = DecoderConfig(vocab_size=300, n_ctx=64, d_model=48, n_head=6, n_layer=3, d_mlp=100, eos_token_ids=(299,))
    assert config_from_hf(config_to_hf(config)) == config


@pytest.mark.parametrize("name", ["tiny", "gpt2", "tiny-llama", "llama-135m"])
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
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"sliding_window": 16, "use_sliding_window": True, "model_type": "qwen2"}, "sliding"),
])
def test_what_kvserve_does_not_implement_is_refused_by_name(edit, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**LLAMA, **edit})
