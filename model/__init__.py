"""The eager PyTorch reference: config (config.py), the GPT-2 decoder with its per-layer KV cache (gpt2.py),
checkpoints (checkpoint.py) and reference generation (generate.py).

Only the config is imported here: it is plain Python, so the torch-free server can read it too.
"""

from .config import PRESETS, DecoderConfig, preset

__all__ = ["DecoderConfig", "PRESETS", "preset"]
