"""Which eager module implements a config: the one place that chooses between the architectures."""

from __future__ import annotations

from kvserve.contract.config import GPT2_ARCH, DecoderConfig

from .gpt2 import GPT2
from .llama import Llama

# Every eager decoder has the same interface: forward, forward_slots, empty_cache, init_weights, config.
Decoder = GPT2 | Llama


def new_decoder(config: DecoderConfig) -> Decoder:
    """An uninitialised decoder of config's architecture."""
    return GPT2(config) if config.architecture == GPT2_ARCH else Llama(config)


def build(config: DecoderConfig, seed: int = 0) -> Decoder:
    """A decoder with seeded random weights, in eval mode."""
    return new_decoder(config).init_weights(seed).eval()
