"""Property-based fuzzing of checkpoint files (hypothesis), as test_http_fuzz.py does the HTTP bodies: whatever a damaged
download or a hand edit leaves in a safetensors header, a shard index, config.json or generation_config.json, loading
the checkpoint gives the eager model or a CheckpointError naming the file, never another exception or a hang; and a
model that loads holds only finite weights read from inside the file."""

import json
import math
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kvserve.model.decoders import build
from kvserve.model.presets import preset

from ..conftest import json_strategies

EXAMPLES = 400

leaves, any_json = json_strategies(max_text=8, max_leaves=8)
# A header entry's fields, each near what it was (an offset a few bytes off, a dimension one more) or anything at all.
near = st.one_of(st.integers(-64, 64), st.sampled_from([-(2**63), 2**63, 2**64 + 8]))
dtypes = st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "", "f32"])


def _split(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join(path, header, data, length_delta=0):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", max(0, len(text) + length_delta)) + text + data)


@st.composite
def header_edits(draw):
    """(name of a tensor, {field: new value}) for up to three fields, or a change to the file's bytes."""
    kind = draw(st.sampled_from(["entry", "entry", "length", "cut", "flip", "metadata"]))
    if kind == "entry":
        fields = draw(st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "other"]), st.just(None), min_size=1, max_size=3))
        return kind, draw(st.integers(0, 10**6)), {field: draw(st.one_of(
            dtypes if field == "dtype" else st.lists(near, min_size=0, max_size=3) if field != "other" else any_json,
            any_json)) for field in fields}
    if kind == "length":
        return kind, draw(st.integers(-40, 40)), None
    if kind in ("cut", "flip"):
        return kind, draw(st.integers(0, 10**7)), draw(st.integers(0, 255))
    return kind, 0, draw(any_json)


@pytest.fixture(scope="module")
def clean_checkpoints(tmp_path_factory):
    """A tiny GPT-2 in one safetensors file, and a tiny Llama in shards with their index."""
    whole, sharded = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("sharded")
    save_checkpoint(build(preset("tiny"), seed=3), whole)
    save_checkpoint(build(preset("tiny-llama"), seed=3), sharded, shard_bytes=60_000)
    (whole / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    return whole, sharded


def _loads_or_names_the_checkpoint(directory):
    try:
        model = load_checkpoint(directory)
    except CheckpointError as error:
        assert str(directory) in str(error) and "\n" not in str(error)
        return False
    assert all(torch.isfinite(param).all() for param in model.parameters())
    return True


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(edit=header_edits())
def test_a_damaged_safetensors_file_loads_or_is_named(clean_checkpoints, tmp_path_factory, edit):
    directory = tmp_path_factory.mktemp("damaged", numbered=True)
    shutil.copytree(clean_checkpoints[0], directory, dirs_exist_ok=True)
    path = directory / "model.safetensors"
    header, data = _split(path)
    kind, number, change = edit
    if kind == "entry":
        names = sorted(name for name in header if name != "__metadata__")
        header[names[number % len(names)]] = {**header[names[number % len(names)]], **change}
        _join(path, header, data)
    elif kind == "length":
        _join(path, header, data, length_delta=number)
    elif kind == "metadata":
        header["__metadata__"] = change
        _join(path, header, data)
    else:
        raw = bytearray(path.read_bytes())
        at = number % len(raw)
        path.write_bytes(bytes(raw[:at]) if kind == "cut" else bytes(raw[:at]) + bytes([change]) + bytes(raw[at + 1 :]))
    _loads_or_names_the_checkpoint(directory)


config_fields = st.sampled_from(["vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                                 "intermediate_size", "max_position_embeddings", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                                 "rope_parameters", "tie_word_embeddings", "eos_token_id", "bos_token_id", "sliding_window",
                                 "partial_rotary_factor", "model_type", "hidden_act"])
rope = st.fixed_dictionaries({"rope_type": st.sampled_from(["linear", "dynamic", "llama3", "yarn", "longrope", "default", "su"])},
                             optional={"factor": leaves, "low_freq_factor": leaves, "high_freq_factor": leaves, "rope_theta": leaves,
                                       "original_max_position_embeddings": leaves, "beta_fast": leaves, "short_factor": any_json,
                                       "long_factor": any_json})


@st.composite
def index_and_config_edits(draw):
    edits = draw(st.dictionaries(config_fields, st.one_of(leaves, rope, any_json), max_size=3))
    shard = draw(st.one_of(st.none(), st.sampled_from(["../x.safetensors", "/dev/zero", "", "missing.safetensors", "."]), leaves))
    generation = draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(["eos_token_id", "bos_token_id"]), any_json, max_size=2),
                                any_json))
    return edits, shard, generation


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(edit=index_and_config_edits())
def test_a_damaged_shard_index_or_config_loads_or_is_named(clean_checkpoints, tmp_path_factory, edit):
    directory = tmp_path_factory.mktemp("edited", numbered=True)
    shutil.copytree(clean_checkpoints[1], directory, dirs_exist_ok=True)
    edits, shard, generation = edit
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | edits))
    if shard is not None:
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        index["weight_map"][sorted(index["weight_map"])[0]] = shard
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    _loads_or_names_the_checkpoint(directory)


def test_the_clean_checkpoints_load(clean_checkpoints):
    """The property above is not met by refusing everything."""
    for directory in clean_checkpoints:
        assert _loads_or_names_the_checkpoint(directory)
    assert math.isclose(sum(p.numel() for p in load_checkpoint(clean_checkpoints[0]).parameters()),
                        sum(p.numel() for p in build(preset("tiny"), seed=3).parameters()))
