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


# A draw scans the vocabulary in blocks of this many: which block holds it, from the blocks' sums, then where in that one.
DRAW_BLOCK = 1024
# top_p first looks among the tokens at least this fraction as likely as the likeliest: when they hold top_p of the
# probability, the nucleus is among them (the whole sort reaches top_p before it reaches a less likely token).
NUCLEUS_FLOOR = 1e-3


def _choose_among(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The index in logits (K,), penalties applied, that the temperature, top_k, min_p and top_p choose: one uniform
    draw of rng, at the place in the kept tokens' cumulative probabilities (in id order) where it falls. Computed in the
    logits' own precision (float32 from the model, float64 once a penalty or bias made them so), on the candidates alone
    once top_k or min_p has cut them, and summed a block at a time (_draw): a draw at temperature 0.8 over a 151,936-token
    vocabulary took 0.32-0.37 ms where converting to float64 and summing it all took 2.3-2.6 (bench/sampling.py, 2-core
    Intel Xeon with AMX)."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits * logits.dtype.type(1.0 / params.temperature)
    ids = None  # the indices of scaled that are still candidates; None: all of them
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        ids = np.flatnonzero(scaled >= kth)  # ties with the k-th stay, as a threshold keeps them
        scaled = scaled[ids]
    probs = np.exp(scaled - scaled.max())
    if params.min_p > 0.0:
        kept = np.flatnonzero(probs >= params.min_p)  # of the likeliest's, which is exp(0) = 1
        ids, probs = (kept if ids is None else ids[kept]), probs[kept]
    if params.top_p < 1.0:
        kept = _nucleus_of(probs, params.top_p)
        ids, probs = (kept if ids is None else ids[kept]), probs[kept]
    index = _draw(probs, rng.random())
    return index if ids is None else int(ids[index])


def _nucleus_of(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids _nucleus keeps of probs (unnormalized, the likeliest 1; float32 or float64), ascending, without sorting
    them all: among the tokens at least NUCLEUS_FLOOR as likely as the likeliest when they are few and hold top_p of the
    whole, else by levels of probability (_nucleus_by_level)."""
    total = float(probs.sum(dtype=np.float64))
    likely = np.flatnonzero(probs >= NUCLEUS_FLOOR)
    if likely.size <= NUCLEUS_FIRST and float(probs[likely].sum(dtype=np.float64)) >= top_p * total:
        return np.sort(likely[_nucleus(probs[likely].astype(np.float64) / total, top_p)])
    return np.sort(_nucleus_by_level(probs, top_p * total))


def _nucleus_by_level(probs: np.ndarray, reach: float) -> np.ndarray:
    """The likeliest tokens of probs (float32 or float64, >= 0), ties by id, up to and with the one whose cumulative
    probability reaches `reach`, as a stable sort of the whole finds them, sorting only the tokens of one level: a
    float's bits rise with its value, so its exponent and first three fraction bits make 8 levels an octave, each token
    of a higher level likelier than any of a lower one. A draw with top_p 0.9 over a flat 151,936-token vocabulary (a
    nucleus of tens of thousands) took 3.8-4.3 ms so, against 28-34 sorting it whole (bench/sampling.py, 2-core Intel Xeon
    with AMX)."""
    shift = 20 if probs.dtype == np.float32 else 49  # float32: 23 fraction bits, float64: 52
    levels = (probs.view(np.uint32 if probs.dtype == np.float32 else np.uint64) >> shift).astype(np.intp)  # (K,)
    mass = np.bincount(levels, weights=probs)  # each level's probability
    reached = np.cumsum(mass[::-1])  # from the likeliest level down
    edge_level = mass.size - 1 - min(int(np.searchsorted(reached, reach)), mass.size - 1)  # where `reach` is reached
    edge = np.flatnonzero(levels == edge_level)
    edge = edge[np.lexsort((edge, -probs[edge]))]  # by probability, falling; ties by id
    before = float(reached[mass.size - 2 - edge_level]) if edge_level < mass.size - 1 else 0.0  # the likelier levels'
    cut = min(int(np.searchsorted(before + np.cumsum(probs[edge], dtype=np.float64), reach)) + 1, edge.size)
    return np.concatenate([np.flatnonzero(levels > edge_level), edge[:cut]])


def _draw(probs: np.ndarray, uniform: float) -> int:
    """The index i (of probs (K,), each >= 0, not all 0) whose share of the cumulative sum holds uniform in [0, 1): the
    first whose cumulative probability passes uniform times the whole. Summed in float64, a block at a time."""
    size = probs.size
    if size <= 4 * DRAW_BLOCK:
        cumulative = np.cumsum(probs, dtype=np.float64)
        return _first_past(probs, cumulative, uniform * cumulative[-1])
    whole = size - size % DRAW_BLOCK
    blocks = probs[:whole].reshape(-1, DRAW_BLOCK).sum(axis=1, dtype=np.float64)  # (K // DRAW_BLOCK,)
    if whole < size:
        blocks = np.append(blocks, probs[whole:].sum(dtype=np.float64))
    cumulative = np.cumsum(blocks)
    target = uniform * cumulative[-1]
    block = _first_past(blocks, cumulative, target)
    start = block * DRAW_BLOCK
    inside = probs[start : start + DRAW_BLOCK]
    return start + _first_past(inside, np.cumsum(inside, dtype=np.float64), target - (cumulative[block - 1] if block else 0.0))


def _first_past(weights: np.ndarray, cumulative: np.ndarray, target: float) -> int:
    """The first index whose cumulative weight passes target; past the end (target at the whole by rounding), the last
    index with weight."""
    index = int(np.searchsorted(cumulative, target, side="right"))
    if index < weights.size:
        return index
    return int(np.flatnonzero(weights)[-1])
