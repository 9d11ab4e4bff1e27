"""Choosing the next token from one row of logits, in numpy. Each sequence owns its random generator,
seeded from its request, so its tokens do not depend on what else shares the batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int = 0
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far; 0: off
    frequency_penalty: float = 0.0  # subtracted from a token's logit once for each time it was generated so far; 0: off
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the likeliest (after temperature); 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): before everything else

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether the logits are changed before the argmax (then greedy is not the graph's argmax)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


MAX_SEED = 2**63 - 1


def nth_seed(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling of the index-th of several completions of one prompt: seed, seed + 1, ... (wrapping within
    [1, MAX_SEED]); a seed of 0 stays 0, so each completion gets a seed of its own choosing."""
    if not params.seed:
        return params
    return dataclasses.replace(params, seed=(params.seed - 1 + index) % MAX_SEED + 1)


def log_probability(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token], computed stably in float64. logits: (V,)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    return float(shifted[token] - np.log(np.exp(shifted).sum()))


def top_log_probabilities(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k likeliest tokens of log softmax(logits) as (id, log-probability), likeliest first (ties: lower id)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    log_probs = shifted - np.log(np.exp(shifted).sum())
    top = np.argpartition(-log_probs, k - 1)[:k] if k < log_probs.size else np.arange(log_probs.size)
    top = sorted(top.tolist(), key=lambda i: (-log_probs[i], i))
    return [(int(i), float(log_probs[i])) for i in top]


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, seen: np.ndarray | None,
           generated: list[int] | None = None, allowed: np.ndarray | None = None) -> int:
    """logits: (V,) float32 for one sequence; seen: the token ids so far, prompt included (for the repetition
    penalty); generated: the tokens generated so far (for the presence and frequency penalties, as OpenAI defines
    them: logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty); allowed: the ids that may be
    taken, ascending (a constrained sequence's), None: all. The choice among allowed is the choice the whole
    vocabulary would give with every other logit at -inf (top_k, top_p and min_p count allowed tokens only), made on
    those logits alone: a mask often allows a few tokens of 50,000."""
    if params.logit_bias:
        logits = logits.astype(np.float64)  # a copy
        ids, biases = zip(*params.logit_bias)
        np.add.at(logits, np.asarray(ids), np.asarray(biases))
    if (params.presence_penalty or params.frequency_penalty) and generated:
        logits = logits.astype(np.float64)
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        logits[ids] -= counts * params.frequency_penalty + params.presence_penalty
    if params.repetition_penalty != 1.0 and seen is not None and len(seen):
        logits = logits.astype(np.float64)  # a copy, wide enough that the penalty never overflows
        ids = np.unique(seen)
        picked = logits[ids]
        logits[ids] = np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if allowed is not None:
        return int(allowed[_choose_among(logits[allowed], params, rng)])
    return _choose_among(logits, params, rng)


# top_p's first look at the likeliest tokens; 32 times as many each time the nucleus is not within them.
NUCLEUS_FIRST = 256


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids top_p keeps: the likeliest first (ties: lower id first), up to and with the one whose cumulative
    probability reaches top_p. As a stable sort of the whole vocabulary finds them, from a partial sort of its likeliest
    tokens: the whole sort of 151,936 probabilities (a Qwen vocabulary) took 19-21 ms a token on a 2-core AVX2 EPYC, this
    0.6 ms where the nucleus held 25-132 tokens and 2.3 ms at 1,540 (by hand); a nucleus of tens of thousands (logits
    almost flat) falls through to the whole sort, at 1.2x its time. Only the tokens strictly likelier than the m-th
    likeliest are sure to stand first in the whole order, in this order (ties at the m-th may fall either side of a
    partition), and their cumulative sums are the whole order's first ones, summed in the same order: the same cut."""
    size, m = probs.size, NUCLEUS_FIRST
    while m < size:
        likeliest = np.argpartition(-probs, m - 1)[:m]
        sure = likeliest[probs[likeliest] > probs[likeliest].min()]
        order = sure[np.lexsort((sure, -probs[sure]))]  # by probability, falling; ties by id
        cumulative = np.cumsum(probs[order])
        if cumulative.size and cumulative[-1] >= top_p:
            return order[: int(np.searchsorted(cumulative, top_p)) + 1]  # with the token that reaches top_p
        m *= 32
    order = np.argsort(-probs, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]


def _choose_among(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The index in logits (K,), penalties applied, that the temperature, top_k, min_p and top_p choose."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.min_p > 0.0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    if params.top_p < 1.0:
        nucleus = _nucleus(probs, params.top_p)
        kept = np.zeros_like(probs)
        kept[nucleus] = probs[nucleus]
        probs = kept / kept.sum()
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), probs.size - 1))
