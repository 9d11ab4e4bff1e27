"""Checkpoint loading: round trips, both GPT-2 layouts, and a clear error for every malformed input."""

import json
import os
import signal
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.contract.hf_config import config_from_hf, config_to_hf
from kvserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, weights_checksum
from kvserve.model.decoders import build
from kvserve.model.presets import preset


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


def test_a_pytorch_bin_in_torchs_legacy_format_loads(tmp_path, tiny_model):
    """torch < 1.6 wrote pytorch_model.bin as a plain pickle, which cannot be mapped: it was refused ("mmap can only be
    used with files saved with ...")."""
    save_checkpoint(tiny_model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert weights_checksum(load_checkpoint(tmp_path)) == weights_checksum(tiny_model)


@pytest.fixture
def checkpoint(tmp_path):
    save_checkpoint(build(preset("tiny"), seed=1), tmp_path)
    return tmp_path


def _rewrite(checkpoint, edit):
    tensors = load_file(checkpoint / "model.safetensors")
    edit(tensors)
    save_file(tensors, checkpoint / "model.safetensors")


def _set_value(checkpoint, name, index, value):
    _rewrite(checkpoint, lambda tensors: tensors[name].__setitem__(index, value))


def _rewrite_header(checkpoint, edit):
    """model.safetensors with its JSON header changed by edit (the tensors' bytes as they were)."""
    path = checkpoint / "model.safetensors"
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _first_tensor_moved(offset):
    def edit(header):
        entry = header["transformer.h.0.attn.c_attn.bias"]
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [begin + offset, end + offset]

    return edit


def _pytorch_bin_with_nan(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["transformer.h.1.attn.c_proj.weight"][5, 2] = float("nan")
    torch.save(tensors, checkpoint / "pytorch_model.bin")
    (checkpoint / "model.safetensors").unlink()


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda d: (d / "config.json").unlink(), "config.json: missing"),
        (lambda d: (d / "model.safetensors").unlink(), "no weights file"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json: not a JSON object"),  # the path said once
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "cannot read weights"),
        (lambda d: _rewrite(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")), "missing tensor(s): transformer.h.1.mlp.c_fc.bias"),
        (lambda d: _rewrite(d, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(64, 100)})),
         "'transformer.h.0.attn.c_attn.weight' has shape (64, 100), expected (64, 192)"),
        (lambda d: _rewrite(d, lambda t: t.update({"transformer.h.9.ln_1.weight": torch.zeros(64)})), "unexpected tensor 'transformer.h.9.ln_1.weight'"),
        (lambda d: _rewrite(d, lambda t: t.update({"lm_head.weight": torch.zeros(257, 64)})), "untied heads are unsupported"),
        # a tensor placed before the data section read the header's own bytes as weights, and exported them
        (lambda d: _rewrite_header(d, _first_tensor_moved(-8)), "'transformer.h.0.attn.c_attn.bias': its bytes -8..760 lie outside"),
        (lambda d: _rewrite_header(d, _first_tensor_moved(10**9)), "lie outside the file's"),
        (lambda d: _rewrite_header(d, lambda h: h["transformer.wte.weight"].update(shape=[257, 64.0])), "has shape (257, 64.0), not a list"),
        (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}"), "its header length 1099511627776 is past"),
        (lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()), "model.safetensors: not a regular file"),
        # damaged weights failed parity with no word of why
        (lambda d: _set_value(d, "transformer.h.0.mlp.c_fc.weight", (3, 7), float("nan")),
         "tensor 'transformer.h.0.mlp.c_fc.weight' holds NaN or infinite values (row 3)"),
        (lambda d: _set_value(d, "transformer.wte.weight", (200, 0), float("-inf")), "'transformer.wte.weight' holds NaN or infinite values (row 200)"),
        (_pytorch_bin_with_nan, "pytorch_model.bin: tensor 'transformer.h.1.attn.c_proj.weight' holds NaN or infinite values (row 5)"),
        (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), "config.json: not valid JSON ('utf-8' codec"),
        (lambda d: (d / "generation_config.json").write_bytes(b"\xff\xfe{}"), "generation_config.json: not valid JSON"),
        # a float was rounded to another id, a string named config.json
        (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": 2.5}'),
         "generation_config.json: eos_token_id must be a token id or a list of them, got 2.5"),
        (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [1, "2"]}'), "generation_config.json: eos_token_id must be"),
        (lambda d: _edit_config(d, eos_token_id=True), "config.json: eos_token_id must be a token id or a list of them, got true"),
        # 10^7 layers' modules were built (minutes, gigabytes) before a tensor was compared
        (lambda d: _edit_config(d, n_layer=10**7), "model.safetensors: config.json says 10000000 layers and the weights hold 2"),
        (lambda d: _edit_config(d, vocab_size=2**30), "'transformer.wte.weight' has shape (257, 64), and config.json says (1073741824, 64)"),
    ],
    ids=["no config", "no weights", "bad json", "json list", "corrupt weights", "missing tensor", "misshaped tensor", "extra tensor", "untied head",
         "offsets before the data", "offsets past the end", "shape of floats", "header past the end", "weights a directory",
         "nan weight", "infinite embedding", "nan in a .bin", "config not utf-8", "generation config not utf-8", "float eos",
         "string eos in a list", "boolean eos", "layers the weights lack", "a vocabulary the weights lack"],
)
def test_malformed_checkpoints_are_named(checkpoint, breakage, message):
    breakage(checkpoint)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(checkpoint)
    assert message in str(error.value) and str(error.value).count("config.json") <= 1


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "falcon"}, "unsupported architecture: model_type 'falcon'"),
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"n_head": 5}, "not divisible by n_head"),
    ],
)
def test_unsupported_configs_are_named(checkpoint, edit, message):
    assert message in _refusal_after_editing_config(checkpoint, edit)


def _edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | fields))


def _refusal_after_editing_config(directory, edit: dict) -> str:
    """The CheckpointError loading directory gives once edit is merged into its config.json."""
    config = json.loads((directory / "config.json").read_text())
    config.update(edit)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory)
    return str(error.value)


# --- the Llama family -------------------------------------------------------------------------------------


def _llama(make_hf_llama, **overrides):
    from tests.conftest import LLAMA_CONFIGS

    model_type, config = LLAMA_CONFIGS["llama gqa 4:1 head_dim 24 untied"]
    return make_hf_llama(model_type, **(config | overrides))


@torch.no_grad()
def test_sharded_bfloat16_checkpoint_loads_exactly(make_hf_llama):
    """save_pretrained in bfloat16, split in shards with model.safetensors.index.json: every weight arrives, as float32."""
    hf, directory = _llama(make_hf_llama, dtype=torch.bfloat16, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").exists() and len(list(directory.glob("model-*.safetensors"))) > 2
    ours = load_checkpoint(directory)
    assert next(ours.parameters()).dtype == torch.float32
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    theirs = hf(input_ids=ids).logits  # hf: the same bfloat16 weights, widened to float32
    mine, _ = ours(ids, torch.ones_like(ids), torch.arange(8)[None], ours.empty_cache(1))
    assert (mine - theirs).abs().max() <= 1e-5


def test_llama_save_then_load_round_trips_and_transformers_reads_it(tmp_path, make_hf_llama):
    from transformers import LlamaForCausalLM

    _, directory = _llama(make_hf_llama)
    ours = load_checkpoint(directory)
    save_checkpoint(ours, tmp_path)
    again = load_checkpoint(tmp_path)
    assert again.config == ours.config and weights_checksum(again) == weights_checksum(ours)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[7, 7, 8, 9]])
    with torch.no_grad():
        mine, _ = ours(ids, torch.ones_like(ids), torch.arange(4)[None], ours.empty_cache(1))
        assert (hf(input_ids=ids).logits - mine).abs().max() <= 1e-5


def test_eos_ids_come_from_generation_config_as_a_list(make_hf_llama):
    _, directory = _llama(make_hf_llama, generation={"eos_token_id": [2, 7, 299], "bos_token_id": 1})
    config = load_checkpoint(directory).config
    assert config.eos_token_ids == (2, 7, 299) and config.eos_token_id == 2
    assert config_from_hf(config_to_hf(config)) == config  # the list survives into an artifact's config.json


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "gemma"}, "unsupported architecture: model_type 'gemma'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 10000.0, "factor": 4.0}}, "unsupported rope_type 'ntk-by-parts'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "'yarn' lacks original_max_position_embeddings"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.5}}, "partial_rotary_factor must be in (0, 1]"),
        ({"model_type": "mistral", "sliding_window": -4}, "sliding_window must be a positive integer, got -4"),
        ({"model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"num_key_value_heads": 3}, "n_head (8) is not a multiple of n_kv_head (3)"),
        ({"hidden_size": None}, "lacks required field 'hidden_size'"),
    ],
    ids=["architecture", "activation", "rope type", "rope field", "partial rotary", "mistral window", "bidirectional", "kv heads", "no width"],
)
def test_unsupported_llama_configs_are_named(make_hf_llama, edit, message):
    _, directory = _llama(make_hf_llama)
    assert message in _refusal_after_editing_config(directory, edit)


def test_a_window_covering_the_context_and_older_rope_fields_are_accepted(make_hf_llama):
    """Mistral with a sliding window as long as the context attends as Llama does (no window); transformers 4's rope_theta and
    rope_scaling spelling (most published configs) read the same as transformers 5's rope_parameters."""
    _, directory = _llama(make_hf_llama)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters")
    config |= {"model_type": "mistral", "sliding_window": 128, "rope_theta": 500000.0,
               "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}
    (directory / "config.json").write_text(json.dumps(config))
    loaded = load_checkpoint(directory).config
    assert loaded.model_type == "mistral" and loaded.rope_theta == 500000.0 and loaded.rope_scaling.factor == 8.0
    assert loaded.sliding_window is None


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "missing tensor(s): model.layers.1.self_attn.k_proj.weight"),
        (lambda t: t.pop("lm_head.weight"), "missing tensor(s): lm_head.weight"),
        (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(96, 96)}),
         "'model.layers.0.self_attn.k_proj.weight' has shape (96, 96), expected (48, 96)"),
    ],
    ids=["missing k_proj", "untied head missing", "k_proj with query heads"],
)
def test_malformed_llama_checkpoints_are_named(make_hf_llama, edit, message):
    _, directory = _llama(make_hf_llama)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory)
    assert message in str(error.value)


def test_a_shard_index_naming_a_missing_shard_is_named(make_hf_llama):
    _, directory = _llama(make_hf_llama, max_shard_size="40KB")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}, which is missing"):
        load_checkpoint(directory)


def _shard_listed_as(directory, name: str) -> None:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "shard, message",
    [
        ("../elsewhere.safetensors", "lists shard '../elsewhere.safetensors', which is not a file name inside the checkpoint directory"),
        ("/dev/zero", "lists shard '/dev/zero', which is not a file name inside the checkpoint directory"),
        ("", "lists shard '', which is not a file name inside"),
        ("queue.safetensors", "queue.safetensors: not a regular file"),  # a FIFO: reading it blocked the export forever
    ],
    ids=["parent", "absolute", "empty", "fifo"],
)
def test_a_shard_index_may_name_only_files_of_its_directory(make_hf_llama, tmp_path, shard, message):
    import shutil

    _, made = _llama(make_hf_llama, max_shard_size="40KB")
    directory = tmp_path / "checkpoint"
    shutil.copytree(made, directory)
    shutil.copy(next(made.glob("model-*.safetensors")), tmp_path / "elsewhere.safetensors")  # the real tensors, outside
    os.mkfifo(directory / "queue.safetensors")
    _shard_listed_as(directory, shard)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("loading blocked"))
    signal.alarm(30)
    try:
        with pytest.raises(CheckpointError) as error:
            load_checkpoint(directory)
    finally:
        signal.alarm(0)
    assert message in str(error.value)


def test_a_shard_that_links_outside_its_directory_loads(make_hf_llama, tmp_path):
    """The hub's cache keeps a snapshot's files as links into a blobs/ directory beside it."""
    import shutil

    hf, made = _llama(make_hf_llama, max_shard_size="40KB")
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(made, blobs)
    snapshot.mkdir()
    for path in blobs.iterdir():
        (snapshot / path.name).symlink_to(path)
    assert weights_checksum(load_checkpoint(snapshot)) == weights_checksum(load_checkpoint(made))


