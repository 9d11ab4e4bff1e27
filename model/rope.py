"""Rotary position embeddings (Su et al., "RoFormer", 2021) and the rescalings a config.json may ask for, computed
float32-exact as transformers computes them (tests hold them to it): the inverse frequencies, one per pair of
channels, and the factor cos and sin are multiplied by (YaRN's attention factor; 1 for the others).

The frequencies are plain float32 constants, not buffers: a buffer would follow the model to float16, and a float16
frequency is off by radians a thousand positions in. With a partial_rotary_factor (Phi-4-mini) only a head's first
rotary_dim channels turn.

LongRoPE (Phi-3) has two sets of factors: transformers turns a sequence by the short set while it fits
original_max_position_embeddings, and once it grows past that turns by the long set: its Phi-3 recomputes the whole
cache at the crossing (its generate drops the cache there), its other models turn only what follows
(DecoderConfig.long_rope_recompute_at). The choice is per sequence, so RotaryEmbedding takes, beside the positions, which
rows turn long; who decides is the caller: the eager forward by each row's last position, as transformers does, the
server and its graphs by the sequence's length (contract/io_contract.py; service/core/scheduler.py recomputes a row's
cache where it crosses).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.contract.config import DecoderConfig, RopeScaling


def rope_frequencies(config: DecoderConfig, long: bool = False) -> list[float]:
    """The rotary embedding's inverse frequencies, rotary_dim / 2 of them, rescaled as config.rope_scaling says (longrope:
    by its short factors, or with long by its long ones)."""
    d_k, scaling = config.rotary_dim, config.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_frequencies(config.rope_theta, d_k, scaling).tolist()
    if scaling is not None and scaling.rope_type == "longrope":
        shape = torch.arange(0, d_k, 2, dtype=torch.int64).float() / d_k  # (d_k / 2,)
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return (1.0 / (factors * config.rope_theta**shape)).tolist()
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d_k, 2, dtype=torch.int64).float() / d_k))  # (d_k / 2,)
    if scaling is None:
        return inv_freq.tolist()
    if scaling.rope_type == "linear":  # position interpolation: every position read as position / factor
        return (inv_freq / scaling.factor).tolist()
    if scaling.rope_type == "dynamic":  # NTK stretches only past max_position_embeddings, which kvserve never serves
        return inv_freq.tolist()
    return _llama3_frequencies(inv_freq, scaling).tolist()


def attention_factor(config: DecoderConfig) -> float:
    """What cos and sin are multiplied by (so Q.K by its square): YaRN's attention factor, 1.0 for other types."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if scaling.factor <= 1.0 else math.sqrt(1 + math.log(scaling.factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths slow down by factor, short ones stay, the band between blends the two.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(base: float, d_k: int, scaling: RopeScaling) -> torch.Tensor:
    """Channels that turn fewer than beta_slow times over the original context are interpolated (divided by factor),
    those turning more than beta_fast times kept, a linear ramp between."""

    def channel(rotations: float) -> float:  # the channel that turns `rotations` times over the original context
        return d_k * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel(scaling.beta_fast), channel(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_k - 1)
    if low == high:
        high += 0.001  # a band of width 0 would divide by zero
    kept = 1 - torch.clamp((torch.arange(d_k // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (d_k / 2,): 1 = kept
    wavelengths = base ** (torch.arange(0, d_k, 2).float() / d_k)  # (d_k / 2,)
    return (1.0 / (scaling.factor * wavelengths)) * (1 - kept) + (1.0 / wavelengths) * kept


class RotaryEmbedding(nn.Module):
    """The angles of each position, as (cos, signed sin) for rotate()."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.inv_freq = rope_frequencies(config)
        # longrope's second set, for sequences past the original context; None for every other model
        self.long_inv_freq = rope_frequencies(config, long=True) if config.long_rope_after is not None else None
        self.scale = attention_factor(config)

    def turns(self, positions: torch.Tensor, long: torch.Tensor | None = None) -> torch.Tensor:
        """positions (...) -> each position's angles (..., rotary_dim / 2), float32; long (bool, broadcastable to
        positions): which turn by longrope's long factors (None: none)."""
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32, device=positions.device)  # (d_r / 2,)
        angles = positions[..., None].float() * inv_freq  # (..., d_r / 2)
        if long is None or self.long_inv_freq is None:
            return angles
        long_inv_freq = torch.tensor(self.long_inv_freq, dtype=torch.float32, device=positions.device)  # (d_r / 2,)
        return torch.where(long[..., None], positions[..., None].float() * long_inv_freq, angles)  # (..., d_r / 2)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype, long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (..., T) -> cos, signed sin (..., T, d_r) in dtype, d_r the rotated channels (long: see turns).
        Channel i and i + d_r / 2 share an angle; the first half's sine is negated here, once a step, instead of the
        rotated half in every layer."""
        angles = self.turns(position_ids, long)  # (..., T, d_r / 2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, d_r)
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        half = sin.shape[-1] // 2
        return cos.to(dtype), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(dtype)  # (..., T, d_k)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (..., d_k) rotated pairwise by the angles (cos, signed_sin (..., d_r), d_r <= d_k: the first d_r channels turn,
    the rest pass): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), transformers' rotate_half arithmetic exactly
    (negating a product's factor is exact). The halves swap with one gather."""
    d_r = cos.shape[-1]
    if d_r < x.shape[-1]:
        turned, passed = x.split([d_r, x.shape[-1] - d_r], dim=-1)  # (..., d_r), (..., d_k - d_r)
        return torch.cat([rotate(turned, cos, signed_sin), passed], dim=-1)  # (..., d_k)
    half = d_r // 2
    swap = torch.cat([torch.arange(half, 2 * half), torch.arange(half)]).to(x.device)  # (d_r,): (x2, x1)
    return x * cos + x.index_select(-1, swap) * signed_sin


def rotary_tables(rotary: RotaryEmbedding, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, each (positions, d_r / 2), scaled by the attention factor: the tables
    GroupQueryAttention indexes by position. Computed in float32, then cast."""
    angles = rotary.turns(torch.arange(positions))  # (P, d_r / 2)
    cos, sin = angles.cos(), angles.sin()
    if rotary.scale != 1.0:
        cos, sin = cos * rotary.scale, sin * rotary.scale
    return cos.to(dtype), sin.to(dtype)
