"""Weights read a tensor (or rows of one) at a time: a checkpoint's files as CheckpointWeights, and the eager reference
that loads each block as it runs (streamed_reference), against the model loaded whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model.checkpoint import CheckpointError, CheckpointWeights, load_checkpoint, save_checkpoint, weights_checksum
from kvserve.model.decoders import build
from kvserve.model.generate import generate
from kvserve.model.presets import preset
from kvserve.model.weights import ModelWeights, parameter, reference_model, streamed_reference, weight_source_of
from kvserve.model.weights import weights_checksum as source_checksum


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def sharded(request, tmp_path_factory):
    """A preset saved in bfloat16 as several shards with their index, and the model those weights make."""
    directory = tmp_path_factory.mktemp(request.param)
    save_checkpoint(build(preset(request.param), seed=5), directory, torch.bfloat16, shard_bytes=30_000)
    return directory, load_checkpoint(directory)


def test_checkpoint_rows_are_the_loaded_parameters(sharded):
    directory, model = sharded
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 2
    weights = CheckpointWeights(directory)
    for key, tensor in model.state_dict().items():
        assert weights.shape(key) == tuple(tensor.shape)
        assert torch.equal(parameter(weights, key), tensor), key
        rows = tensor.shape[0]
        assert torch.equal(weights.rows(key, rows // 3, rows - 1), tensor[rows // 3 : rows - 1]), key  # crossing fused parts
    assert source_checksum(weights) == weights_checksum(model)


def test_streamed_reference_computes_what_the_loaded_model_does(sharded):
    directory, model = sharded
    streamed = streamed_reference(CheckpointWeights(directory))
    blocks = streamed.transformer.h if hasattr(streamed, "transformer") else streamed.model.layers
    matrices = [m for m in blocks.modules() if isinstance(m, nn.Linear)]
    assert matrices and all(m.weight.device.type == "meta" for m in matrices)  # no matrix held between its runs
    ids = torch.tensor([[5, 9, 2, 7, 1, 3], [4, 4, 8, 0, 6, 2]])
    mask, positions = torch.ones_like(ids), torch.arange(6).expand(2, -1)
    with torch.no_grad():
        ours, ours_kv = streamed(ids, mask, positions, streamed.empty_cache(2))
        theirs, theirs_kv = model(ids, mask, positions, model.empty_cache(2))
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for layer_a, layer_b in zip(ours_kv, theirs_kv) for a, b in zip(layer_a, layer_b))
    assert all(m.weight.device.type == "meta" for m in matrices)
    assert torch.equal(generate(streamed, [[1, 2, 3]], 6).tokens, generate(model, [[1, 2, 3]], 6).tokens)


def test_reference_model_streams_only_what_is_large(sharded, monkeypatch):
    directory, _ = sharded
    weights = CheckpointWeights(directory)
    whole = reference_model(weights)
    assert all(p.device.type == "cpu" for p in whole.parameters()) and weight_source_of(whole) is weights
    monkeypatch.setattr("kvserve.model.weights.IN_MEMORY_REFERENCE_BYTES", 0)
    streamed = reference_model(weights)
    assert any(p.device.type == "meta" for p in streamed.parameters()) and weight_source_of(streamed) is weights
    assert isinstance(weight_source_of(build(preset("tiny"))), ModelWeights)


def test_a_shard_cut_short_is_named_when_opened_and_when_read(tmp_path):
    save_checkpoint(build(preset("tiny-llama")), tmp_path, torch.bfloat16)
    path = tmp_path / "model.safetensors"
    whole = path.read_bytes()
    weights = CheckpointWeights(tmp_path)
    path.write_bytes(whole[:-1000])  # cut after it was opened: found when a tensor past the end is read
    with pytest.raises(CheckpointError, match="model.safetensors: ends inside a tensor"):
        for key in weights.keys():
            parameter(weights, key)
    with pytest.raises(CheckpointError, match="model.safetensors: .* lie outside the file's"):  # its header lists bytes past the end
        CheckpointWeights(tmp_path)
