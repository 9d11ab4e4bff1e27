"""Choosing the next token from one row of logits, in numpy. Each sequence owns its random generator,
seeded from its request, so its tokens do not depend on what else shares the batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_probability(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token], computed stably in float64. logits: (V,)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    return float(shifted[token] - np.log(np.exp(shifted).sum()))


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, seen: np.ndarray | None) -> int:
    """logits: (V,) float32 for one sequence; seen: the token ids so far (for the repetition penalty)."""
    if params.repetition_penalty != 1.0 and seen is not None and len(seen):
        logits = logits.astype(np.float64)  # a copy, wide enough that the penalty never overflows
        ids = np.unique(seen)
        picked = logits[ids]
        logits[ids] = np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        cutoff = int(np.searchsorted(cumulative, params.top_p)) + 1  # keep the token that reaches top_p
        kept = np.zeros_like(probs)
        kept[order[:cutoff]] = probs[order[:cutoff]]
        probs = kept / kept.sum()
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), probs.size - 1))
