"""int8 K/V scales (model/kv_storage.py), calibrated at export: the eager model reads calibration windows, and each
(layer, K/V head, channel) gets the largest |K| (rotated, as the cache holds it) and |V| seen, over 127, as its scale.

Windows come from text where the model has learned some (a checkpoint: held-out chapters after the ones verify's
text check reads, tokenized as the artifact will be), and from seeded random ids for a preset, whose random weights
have learned none (the K/V of random ids spread as those of any other ids).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.contract.tokenizer import load_tokenizer
from kvserve.model.corpus import CorpusUnavailable, load_corpus
from kvserve.model.decoders import Decoder
from kvserve.model.kv_storage import INT8_MAX

from .quality import WINDOWS as VERIFY_WINDOWS

WINDOWS, WINDOW_TOKENS = 8, 256
SMALLEST_SCALE = 1e-8  # a channel that was 0 throughout: any scale reads it back as 0


def calibration_windows(model: Decoder, tokenizer_path, from_text: bool, seed: int = 0) -> tuple[list[list[int]], str]:
    """WINDOWS windows of up to WINDOW_TOKENS ids, and how they were chosen (for the manifest)."""
    config = model.config
    length = min(WINDOW_TOKENS, config.n_ctx)
    if from_text:
        try:
            chapters = load_corpus().held_out[2 * VERIFY_WINDOWS :]  # verify's text check reads the first 2 x its windows
            ids = load_tokenizer(tokenizer_path).encode("\n".join(chapters[: 4 * WINDOWS]))
            if len(ids) >= WINDOWS * length and max(ids) < config.vocab_size:
                return ([ids[i * length : (i + 1) * length] for i in range(WINDOWS)],
                        f"held-out text: {WINDOWS} windows of {length} tokens")
        except CorpusUnavailable:
            pass
    generator = np.random.default_rng(seed)
    return (generator.integers(0, config.vocab_size, (WINDOWS, length)).tolist(),
            f"random ids (seed {seed}): {WINDOWS} windows of {length} tokens")


@torch.no_grad()
def calibrate_int8_scales(model: Decoder, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, K/V head, channel) scales of K and of V, each (L, H_kv, d_k) float32, from model's float K/V (its
    cache storing them as computed) over windows."""
    largest = None
    for window in windows:  # one at a time: a 151,936-token vocabulary's logits for all of them would take gigabytes
        ids = torch.tensor([window])  # (1, T)
        positions = torch.arange(ids.shape[1])[None]  # (1, T)
        _, presents = model(ids, torch.ones_like(ids), positions, model.empty_cache(1))  # per layer 2 x (1, H_kv, T, d_k)
        seen = torch.stack([torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]) for k, v in presents])  # (L, 2, H_kv, d_k)
        largest = seen if largest is None else torch.maximum(largest, seen)
    scales = (largest.float() / INT8_MAX).clamp(min=SMALLEST_SCALE)
    return scales[:, 0].contiguous(), scales[:, 1].contiguous()
