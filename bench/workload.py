"""A mixed workload shared by the scripts that serve it, so that kvserve's server and a static-batch peer get the same
requests: each request's new tokens drawn uniformly from a range, seeded, in the order the load's streams send them
(stream w's k-th request is number w * requests_per_stream + k)."""

from __future__ import annotations

import argparse

import numpy as np


def new_token_counts(requests: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Each request's new tokens, uniform in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, requests).tolist()


def token_range(text: str) -> tuple[int, int]:
    """LOW,HIGH with 1 <= LOW <= HIGH (an argparse type: its error says so)."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW,HIGH (two whole numbers)") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return low, high
