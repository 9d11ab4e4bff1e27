"""What the eager model loses computing in float16 itself: the floor under a float16 artifact's parity.

A float16 graph is held to the float32 eager model. Where a model's activations are large (random test weights drawn
wide, or a checkpoint with outlier features), float16 arithmetic alone moves its logits and K/V further than the
fixed float16 bounds allow, whichever program does the arithmetic: transformers' own float16 forward of the suite's
random configs is off by up to 3.2% of the largest logit where the bound is 1% (bench/float16_floor.py). So a check
outside the fixed bound is measured again against this floor: the same eager model run in float16 (the arithmetic
the graph was traced from: norms, softmax and logits in float32, everything else in float16), fed the prompts verify's
checks drew (as a batch, then each alone in chunks) and the float32 model's greedy tokens after them, against its
float32 self.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvserve.model.decoders import Decoder
from kvserve.model.generate import left_pad, position_ids_from_mask

from .parity_report import kv_divergence


@dataclass(frozen=True)
class OwnRounding:
    """The eager model's float16 error against its float32 self, as fractions of the float32 side's scale."""

    logits: float  # the largest |Δ logit| of a batch over that batch's largest |float32 logit|, worst batch
    kv: float  # the largest |Δ K/V| of a (layer, head) over its largest |float32 K/V|, worst (layer, head) and batch


def own_rounding(reference: Decoder, prompt_batches: list[list[list[int]]], steps: int,
                 dtype: torch.dtype = torch.float16, chunk: int = 5) -> OwnRounding | None:
    """Each batch of prompts prefilled and decoded steps tokens (each the float32 model's greedy token) by reference in
    float32 and by a copy of it in dtype, and each prompt again alone, the copy prefilling it chunk tokens at a time
    through its cache (as a slots graph runs it): every real position's logits and the K/V compared. Two orders of the
    same arithmetic on the same tokens: float16's error on random weights is a few positions where rounding tips an
    attention's near-tie, and which order tips it is chance (on one prompt the graph's largest came to 0.4-1.6x the
    batch's, bench/results/parity-errors.md). The copy holds its dtype's share of the reference's bytes while it runs.
    None where the reference streams its matrices from the checkpoint (model/weights.py, over 0.5 GB of float32
    weights): they are read in float32 whatever the copy's dtype, so no copy computes in dtype, and such a model is
    held to the fixed bounds."""
    if any(param.is_meta for param in reference.parameters()):
        return None
    half = copy.deepcopy(reference).to(dtype).eval()
    worst_logits = worst_kv = 0.0
    with torch.no_grad():
        for prompts in prompt_batches:
            ids, mask = left_pad(prompts)  # (B, T)
            pos = position_ids_from_mask(mask)
            logits, past = reference(ids, mask, pos, reference.empty_cache(len(prompts)))
            logits_16, past_16 = half(ids, mask, pos, half.empty_cache(len(prompts)))
            real = mask.bool()  # (B, T): padded positions' logits mean nothing on either side
            deltas, scales = [(logits_16.float() - logits).abs()[real]], [logits.abs()[real]]  # each (N, V)
            for _ in range(steps):
                token = logits[:, -1].argmax(-1)  # (B,)
                mask = torch.cat([mask, torch.ones(len(token), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
                pos = pos[:, -1:] + 1  # (B, 1)
                logits, past = reference(token[:, None], mask, pos, past)
                logits_16, past_16 = half(token[:, None], mask, pos, past_16)
                deltas.append((logits_16.float() - logits).abs()[:, -1])  # (B, V)
                scales.append(logits.abs()[:, -1])
            worst_logits = max(worst_logits, float(max(d.max() for d in deltas) / max(s.max() for s in scales)))
            worst_kv = max(worst_kv, _kv_error(past, past_16, mask.bool()))
            for prompt in prompts:
                logits_error, kv_error = _alone_in_chunks(reference, half, prompt, chunk)
                worst_logits, worst_kv = max(worst_logits, logits_error), max(worst_kv, kv_error)
    return OwnRounding(worst_logits, worst_kv)


def _alone_in_chunks(reference: Decoder, half: Decoder, prompt: list[int], chunk: int) -> tuple[float, float]:
    """prompt prefilled whole by reference and chunk tokens at a time through half's cache: the logits' and the K/V's
    error, as own_rounding measures them."""
    ids = torch.tensor([prompt])  # (1, T)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    logits, past = reference(ids, mask, pos, reference.empty_cache(1))  # (1, T, V)
    pieces, past_16 = [], half.empty_cache(1)
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        piece, past_16 = half(ids[:, start:end], mask[:, :end], pos[:, start:end], past_16)  # (1, end - start, V)
        pieces.append(piece)
    logits_16 = torch.cat(pieces, dim=1).float()  # (1, T, V)
    return float((logits_16 - logits).abs().max() / logits.abs().max()), _kv_error(past, past_16, mask.bool())


def _kv_error(past, past_16, real: torch.Tensor) -> float:
    """The worst (layer, head)'s K/V error in dtype, measured as verify measures a graph's (kv_divergence, relative): each
    past per layer (K, V), each (B, H, S, d_k), real (B, S) bool marking the positions that hold tokens."""
    rows = [[kv[row][:, real[row]].float().numpy() for pair in past_16 for kv in pair] for row in range(len(real))]  # per row: (H, L_r, d_k), K then V a layer
    return float(kv_divergence(rows, past, real.numpy(), relative=True).max())
