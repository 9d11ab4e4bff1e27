"""Which eager module implements a config: the one place that chooses between the architectures."""

from __future__ import annotations

import contextlib

from torch import nn

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
    with default_init_skipped():
        model = new_decoder(config)
    return model.init_weights(seed).eval()


@contextlib.contextmanager
def default_init_skipped():
    """torch's layers draw a default initialisation as they are built, which init_weights then overwrites in full: for a
    1B-parameter preset, 10 of the 25 s building it took (gemma3-1b, timed by hand on the 2-core Xeon VM). Within this
    block they draw nothing (their parameters hold whatever memory they were given until init_weights fills them)."""
    skipped = ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in skipped}
    try:
        for name in skipped:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)
