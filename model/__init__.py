"""The eager PyTorch reference: config, GPT-2 decoder with a per-layer KV cache, checkpoints, generation."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint, weights_checksum
from .config import PRESETS, DecoderConfig, preset
from .generate import Generation, generate, left_pad, position_ids_from_mask
from .gpt2 import GPT2, build

__all__ = [
    "CheckpointError", "DecoderConfig", "GPT2", "Generation", "PRESETS", "build", "generate", "left_pad",
    "load_checkpoint", "position_ids_from_mask", "preset", "save_checkpoint", "weights_checksum",
]
