"""Checkpoints as transformers' save_pretrained writes them: a directory with config.json (and maybe
generation_config.json, whose eos_token_id wins) and the weights in model.safetensors, shards listed by
model.safetensors.index.json, or pytorch_model.bin. No network: everything is read from the directory.
Weights of any float dtype (bfloat16 included) load to float32; export casts to the artifact's dtype.

Every tensor is checked by its checkpoint name and shape, so an error names what the file holds:
- GPT-2 stores its linear layers as Conv1D, weight (in, out); ours are nn.Linear, weight (out, in), so the
  four matrices listed in TRANSPOSED are transposed on the way in and out. Everything else is a plain copy.
- Llama-family checkpoints store Q, K and V (and the MLP's gate and up) as separate matrices; ours are
  fused (llama.py), so FUSED lists which checkpoint tensors are stacked into which of ours, in order. Phi-3's
  checkpoints store them fused as ours are (STORED_FUSED), and are copied as they are.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvserve.contract.config import GPT2_ARCH, DecoderConfig
from kvserve.contract.hf_config import config_from_hf, config_to_hf
from kvserve.errors import UserError

from .decoders import Decoder, new_decoder

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry (GPT-2's causal mask, old Llama's rotary frequencies); ours compute them.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# Ours <- the checkpoint's, stacked along the output axis in this order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
STORED_FUSED = ("phi3",)  # model types whose checkpoints hold qkv_proj and gate_up_proj themselves
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the libraries' own errors name no file; ours does
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {exc})") from None


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of the checkpoint, and the file to name in errors (the index, for shards)."""
    index = directory / SHARD_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a shard index with a weight_map ({exc})") from None
        tensors = {}
        for shard in shards:
            if not (directory / shard).exists():
                raise CheckpointError(f"{index}: lists shard {shard}, which is missing")
            tensors.update(_read_file(directory / shard))
        unlisted = sorted(set(weight_map) - set(tensors))
        if unlisted:
            raise CheckpointError(f"{index}: tensor {unlisted[0]!r} is listed but in none of its shards")
        return tensors, index
    for name in WEIGHT_FILES:
        if (directory / name).exists():
            return _read_file(directory / name), directory / name
    raise CheckpointError(f"{directory}: no weights file (expected {' or '.join(WEIGHT_FILES)}, or {SHARD_INDEX} with its shards)")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def read_config(directory: Path) -> DecoderConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else None
    try:
        return config_from_hf(_read_json(path), generation)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def checkpoint_shapes(model: Decoder) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this model holds, by the checkpoint's own name, with its shape."""
    config = model.config
    shapes = {}
    for key, param in model.state_dict().items():
        if key.endswith(TRANSPOSED):
            shapes[key] = tuple(param.shape[::-1])
            continue
        fused = _fused_into(key, config)
        if fused is None:
            shapes[key] = tuple(param.shape)
            continue
        parts = _split_sizes(config, fused)
        for part, size in zip(FUSED[fused], parts):
            shapes[key.replace(fused, part)] = (size, *param.shape[1:])
    return shapes


def _fused_into(key: str, config: DecoderConfig) -> str | None:
    """The FUSED module a parameter of ours belongs to, None for a plain one (and for every one of a model whose
    checkpoints store them fused)."""
    if config.model_type in STORED_FUSED:
        return None
    return next((ours for ours in FUSED if f".{ours}." in key), None)


def _split_sizes(config: DecoderConfig, fused: str) -> tuple[int, ...]:
    if fused == "self_attn.qkv_proj":
        return config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_kv_head * config.head_dim
    return config.d_mlp, config.d_mlp


def _canonical_name(name: str, config: DecoderConfig) -> str:
    # GPT-2 is published both as transformers writes it ("transformer.h.0...") and as first released ("h.0...").
    if config.architecture == GPT2_ARCH and not name.startswith("transformer.") and name != "lm_head.weight":
        return f"transformer.{name}"
    return name


def load_checkpoint(directory: str | Path) -> Decoder:
    """Load a checkpoint directory, checking every tensor's name and shape against the config."""
    directory = Path(directory)
    config = read_config(directory)
    tensors, path = _read_tensors(directory)
    model = new_decoder(config)
    expected = checkpoint_shapes(model)
    found: dict[str, torch.Tensor] = {}
    lm_head = None
    for name, tensor in tensors.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        key = _canonical_name(name, config)
        if key == "lm_head.weight" and config.tie_word_embeddings:
            lm_head = tensor  # a tied head some checkpoints store anyway: it must be the embedding
            continue
        if key not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (not part of a {config.model_type} model with this config)")
        if tuple(tensor.shape) != expected[key]:
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected[key]}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {tensor.dtype}, expected a float type")
        found[key] = tensor.float()
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    state = {}
    for key, param in model.state_dict().items():
        fused = _fused_into(key, config)
        if fused is not None:
            state[key] = torch.cat([found[key.replace(fused, part)] for part in FUSED[fused]])
        else:
            state[key] = found[key].T if key.endswith(TRANSPOSED) else found[key]
    embedding = state["transformer.wte.weight" if config.architecture == GPT2_ARCH else "model.embed_tokens.weight"]
    if lm_head is not None and (lm_head.shape != embedding.shape or not torch.equal(lm_head.float(), embedding)):
        raise CheckpointError(
            f"{path}: lm_head.weight differs from the token embedding, but config.json says tie_word_embeddings"
            + (" (GPT-2 is always tied; untied heads are unsupported)" if config.architecture == GPT2_ARCH else "")
        )
    model.load_state_dict(state)
    return model.eval()


def save_checkpoint(model: Decoder, directory: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json + model.safetensors in the layout transformers' from_pretrained reads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    state = {}
    for key, tensor in model.state_dict().items():
        fused = _fused_into(key, model.config)
        if fused is not None:
            parts = tensor.split(_split_sizes(model.config, fused))
            state.update({key.replace(fused, name): part for name, part in zip(FUSED[fused], parts)})
        else:
            state[key] = tensor.T if key.endswith(TRANSPOSED) else tensor
    state = {key: tensor.contiguous().to(dtype) for key, tensor in state.items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def weights_checksum(model: Decoder) -> str:
    """sha256 over every parameter's name and float32 bytes: identifies the weights, not the file."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()
