"""GPT-2-format checkpoints: a directory with config.json and model.safetensors (or pytorch_model.bin),
as transformers' save_pretrained writes it. No network: everything is read from the directory.

GPT-2 stores its linear layers as Conv1D, weight (in, out); ours are nn.Linear, weight (out, in), so the
four matrices listed in TRANSPOSED are transposed on the way in and out. Everything else is a plain copy.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvserve.errors import UserError

from .config import DecoderConfig
from .gpt2 import GPT2

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some GPT-2 checkpoints carry (the causal mask); ours computes the mask instead.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    for name in WEIGHT_FILES:
        path = directory / name
        if path.exists():
            break
    else:
        raise CheckpointError(f"{directory}: no weights file (expected {' or '.join(WEIGHT_FILES)})")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path)), path
        return torch.load(path, map_location="cpu", weights_only=True), path
    except Exception as exc:  # the libraries' own errors name no file; ours does
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {exc})") from None


def read_config(directory: Path) -> DecoderConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    try:
        return DecoderConfig.from_hf_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def load_checkpoint(directory: str | Path) -> GPT2:
    """Load a GPT-2 checkpoint directory, checking every tensor's name and shape against the config."""
    directory = Path(directory)
    config = read_config(directory)
    tensors, path = _read_tensors(directory)
    model = GPT2(config)
    expected = model.state_dict()
    # Both the transformers layout ("transformer.h.0...") and the original one ("h.0...") are in use.
    found: dict[str, torch.Tensor] = {}
    lm_head = None
    for name, tensor in tensors.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight":
            lm_head = tensor
            continue
        key = name if name.startswith("transformer.") else f"transformer.{name}"
        if key not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (not part of a GPT-2 with this config)")
        found[key] = tensor
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    state = {}
    for key, tensor in found.items():
        if key.endswith(TRANSPOSED):
            tensor = tensor.T
        if tuple(tensor.shape) != tuple(expected[key].shape):
            want = tuple(expected[key].shape[::-1]) if key.endswith(TRANSPOSED) else tuple(expected[key].shape)
            got = tuple(tensor.shape[::-1]) if key.endswith(TRANSPOSED) else tuple(tensor.shape)
            raise CheckpointError(f"{path}: tensor {key!r} has shape {got}, expected {want}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {tensor.dtype}, expected a float type")
        state[key] = tensor.float()
    wte = state["transformer.wte.weight"]
    if lm_head is not None and (lm_head.shape != wte.shape or not torch.equal(lm_head.float(), wte)):
        raise CheckpointError(f"{path}: lm_head.weight differs from transformer.wte.weight (untied heads are unsupported)")
    model.load_state_dict(state)
    return model.eval()


def save_checkpoint(model: GPT2, directory: str | Path) -> None:
    """Write config.json + model.safetensors in the layout GPT2LMHeadModel.from_pretrained reads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    state = {}
    for key, tensor in model.state_dict().items():
        state[key] = (tensor.T if key.endswith(TRANSPOSED) else tensor).contiguous().float()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def weights_checksum(model: GPT2) -> str:
    """sha256 over every parameter's name and float32 bytes: identifies the weights, not the file."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()
