"""The eager PyTorch reference: config (config.py) and its config.json mapping (hf_config.py), the GPT-2 and
Llama-family decoders (gpt2.py, llama.py) over the shared attention and per-layer KV cache (attention.py),
decoders.py to pick one, checkpoints (checkpoint.py) and reference generation (generate.py).

Only the config is imported here: it is plain Python, so the torch-free server can read it too.
"""

from .config import PRESETS, DecoderConfig, preset

__all__ = ["DecoderConfig", "PRESETS", "preset"]
