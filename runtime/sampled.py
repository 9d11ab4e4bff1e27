"""What a step hands back to sampling, in host memory (step.py's slots steps and cuda_graphs.py's fixed ones)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampled:
    """A step's result for the K tokens it samples from."""

    logits: np.ndarray | None  # (K, V) float32; None when the step was asked for greedy tokens alone
    greedy_tokens: np.ndarray  # (K,) int64: each row's argmax
