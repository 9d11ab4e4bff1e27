"""Checkpoint loading: round trips, both GPT-2 layouts, and a clear error for every malformed input."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, weights_checksum
from kvserve.model.config import DecoderConfig, preset
from kvserve.model.hf_config import config_from_hf, config_to_hf
from kvserve.model.gpt2 import build


def test_save_then_load_round_trips_exactly(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == tiny_model.config
    assert weights_checksum(loaded) == weights_checksum(tiny_model)


def test_transformers_reads_what_we_save(tmp_path, tiny_model):
    from transformers import GPT2LMHeadModel

    save_checkpoint(tiny_model, tmp_path)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        mine, _ = tiny_model(ids, torch.ones_like(ids), torch.arange(4)[None], tiny_model.empty_cache(1))
    assert (theirs - mine).abs().max() <= 1e-5


def test_pytorch_bin_and_unprefixed_names_load(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    # the original GPT-2 release names tensors without the "transformer." prefix and carries mask buffers
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    torch.save(renamed, tmp_path / "pytorch_model.bin")
    assert weights_checksum(load_checkpoint(tmp_path)) == weights_checksum(tiny_model)


def test_hf_config_round_trip():
    config = DecoderConfig(vocab_size=300, n_ctx=64, d_model=48, n_head=6, n_layer=3, d_mlp=100, eos_token_ids=(299,))
    assert config_from_hf(config_to_hf(config)) == config


@pytest.fixture
def checkpoint(tmp_path):
    save_checkpoint(build(preset("tiny"), seed=1), tmp_path)
    return tmp_path


def _rewrite(checkpoint, edit):
    tensors = load_file(checkpoint / "model.safetensors")
    edit(tensors)
    save_file(tensors, checkpoint / "model.safetensors")


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda d: (d / "config.json").unlink(), "config.json: missing"),
        (lambda d: (d / "model.safetensors").unlink(), "no weights file"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "cannot read weights"),
        (lambda d: _rewrite(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")), "missing tensor(s): transformer.h.1.mlp.c_fc.bias"),
        (lambda d: _rewrite(d, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(64, 100)})),
         "'transformer.h.0.attn.c_attn.weight' has shape (64, 100), expected (64, 192)"),
        (lambda d: _rewrite(d, lambda t: t.update({"transformer.h.9.ln_1.weight": torch.zeros(64)})), "unexpected tensor 'transformer.h.9.ln_1.weight'"),
        (lambda d: _rewrite(d, lambda t: t.update({"lm_head.weight": torch.zeros(257, 64)})), "untied heads are unsupported"),
    ],
    ids=["no config", "no weights", "bad json", "corrupt weights", "missing tensor", "misshaped tensor", "extra tensor", "untied head"],
)
def test_malformed_checkpoints_are_named(checkpoint, breakage, message):
    breakage(checkpoint)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(checkpoint)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "falcon"}, "unsupported architecture: model_type 'falcon'"),
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"n_head": 5}, "not divisible by n_head"),
    ],
)
def test_unsupported_configs_are_named(checkpoint, edit, message):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(edit)
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(checkpoint)
    assert message in str(error.value)
