"""The eager reference decoder for the Llama family (model_type llama, qwen2, mistral), written to be read
as gpt2.py is.

References: Touvron et al., "LLaMA" (2023) and "Llama 2" (2023); Su et al., "RoFormer: rotary position
embedding" (2021); Shazeer, "GLU variants improve transformer" (2020); Ainslie et al., "GQA" (2023). The
arithmetic follows transformers' LlamaForCausalLM / Qwen2ForCausalLM, which the tests hold it to.

What differs from GPT-2: RMSNorm instead of LayerNorm; no position table, but Q and K rotated by their
position (RoPE, from position_ids); a SwiGLU MLP; n_kv_head K/V heads shared by groups of query heads (the
cache holds the K/V heads only); an LM head that may be its own matrix. The forward signatures, the cache
layouts and the attention over them are GPT-2's (attention.py), so export and serving treat both alike.

Projections are fused as GPT-2's c_attn is: Q, K and V in one matrix, the MLP's gate and up in another, so
a step runs one matrix product where a checkpoint stores three or two (checkpoint.py splits and joins them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import LayerKV, SlotStep, attention_allowed, attention_bias, cached_attention, query_columns, slots_attention
from .config import DecoderConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in float32 so a float16 model stays stable."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(config: DecoderConfig) -> list[float]:
    """The rotary embedding's inverse frequencies, one per pair of channels (d_k / 2 of them), float32-exact as
    transformers computes them, with Llama 3.1's rescaling when the config asks for it."""
    d_k = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d_k, 2, dtype=torch.int64).float() / d_k))  # (d_k / 2,)
    scaling = config.rope_scaling
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths slow down by factor, short ones stay, the band between blends the two.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq.tolist()


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles. The frequencies stay float32 constants, not a buffer: a buffer
    would follow the model to float16, and a float16 frequency is off by radians a thousand positions in."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.inv_freq = rope_frequencies(config)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (..., T) -> cos, sin (..., T, d_k) in dtype."""
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32, device=position_ids.device)  # (d_k / 2,)
        angles = position_ids[..., None].float() * inv_freq  # (..., T, d_k / 2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, d_k): channel i and i + d_k / 2 share an angle
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., d_k) rotated pairwise by the angles: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (..., d_k / 2)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.d_head = config.n_head, config.n_kv_head, config.head_dim
        q_width, kv_width = self.n_head * self.d_head, self.n_kv_head * self.d_head
        self.widths = (q_width, kv_width, kv_width)
        self.qkv_proj = nn.Linear(config.d_model, q_width + 2 * kv_width, bias=config.qkv_bias)  # fused Q, K, V
        self.o_proj = nn.Linear(q_width, config.d_model, bias=config.o_bias)  # W_O: mixes the concatenated heads

    def forward(self, x, cos, sin, bias, past: LayerKV, cache_position: torch.Tensor | None) -> tuple[torch.Tensor, LayerKV]:
        """x (B, T, C); cos, sin (B, 1, T, d_k)."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.widths, dim=2)  # (B, T, H * d_k), 2 x (B, T, H_kv * d_k)
        q = q.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        k = k.view(B, T, self.n_kv_head, self.d_head).transpose(1, 2)  # (B, H_kv, T, d_k)
        v = v.view(B, T, self.n_kv_head, self.d_head).transpose(1, 2)  # (B, H_kv, T, d_k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y, present = cached_attention(q, k, v, bias, past, cache_position)  # (B, H, T, d_k)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.d_head)  # (B, T, H * d_k): heads concatenated
        return self.o_proj(y), present

    def forward_slots(self, x, cos, sin, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        """x (1, N, C): the step's tokens, decode rows first; cos, sin (N, 1, d_k). past: the row pool."""
        N = x.shape[1]
        q, k, v = self.qkv_proj(x[0]).split(self.widths, dim=1)  # (N, H * d_k), 2 x (N, H_kv * d_k)
        q = rotate(q.view(N, self.n_head, self.d_head), cos, sin)  # (N, H, d_k)
        k = rotate(k.view(N, self.n_kv_head, self.d_head), cos, sin)  # (N, H_kv, d_k)
        v = v.view(N, self.n_kv_head, self.d_head)  # (N, H_kv, d_k)
        y, present = slots_attention(q, k, v, step, past)  # (N, H * d_k)
        return self.o_proj(y[None]), present


class SwiGLU(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.d_mlp = config.d_mlp
        self.gate_up_proj = nn.Linear(config.d_model, 2 * config.d_mlp, bias=config.mlp_bias)  # fused gate and up
        self.down_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.d_mlp, dim=-1)  # 2 x (..., d_mlp)
        return self.down_proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    """Pre-norm block: residual + attention, residual + MLP."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.layer_norm_eps)
        self.self_attn = GroupedQueryAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.layer_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, bias, past: LayerKV, cache_position) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, bias, past, cache_position)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present

    def forward_slots(self, x, cos, sin, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.self_attn.forward_slots(self.input_layernorm(x), cos, sin, step, past)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class Llama(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.d_model),
                layers=nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer)),
                norm=RMSNorm(config.d_model, config.layer_norm_eps),
            )
        )
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    def init_weights(self, seed: int) -> "Llama":
        """Normal(0, initializer_range) matrices, zero biases, unit norms (transformers' initialisation), from a seed."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif "norm" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * self.config.initializer_range)
        return self

    def empty_cache(self, batch_size: int, capacity: int = 0) -> list[LayerKV]:
        """Zeroed K/V of the K/V heads for every layer (see GPT2.empty_cache)."""
        param = self.model.embed_tokens.weight
        shape = (batch_size, self.config.n_kv_head, capacity, self.config.head_dim)  # (B, H_kv, C, d_k)
        return [(param.new_zeros(shape), param.new_zeros(shape)) for _ in range(self.config.n_layer)]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; logits leave in float32 whatever the model's dtype, so sampling is precise."""
        x = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # (V, C)
        return (x @ weight.T).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        attention_mask: torch.Tensor,  # (B, S) int64 over the cache columns, 0 = padding
        position_ids: torch.Tensor,  # (B, T) int64
        past_key_values: list[LayerKV],  # per layer (K, V), each (B, H_kv, P, d_k); inplace: (B, H_kv, C, d_k)
        cache_position: torch.Tensor | None = None,  # (T,) int64: inplace layout's write columns
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        columns = query_columns(attention_mask, input_ids.shape[1], cache_position)  # (T,)
        bias = attention_bias(attention_allowed(attention_mask, columns))  # (B, 1, T, S)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = self.rotary(position_ids, x.dtype)  # (B, T, d_k)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, d_k): the same angles for every head
        presents = []
        for block, past in zip(self.model.layers, past_key_values):
            x, present = block(x, cos, sin, bias, past, cache_position)
            presents.append(present)
        return self.logits(x), presents  # (B, T, V)

    def forward_slots(
        self,
        input_ids: torch.Tensor,  # (B, 1) int64: one token for each of the pool's rows 0..B-1
        position_ids: torch.Tensor,  # (B, 1) int64: its position, which is also the column it is written at
        attention_mask: torch.Tensor,  # (B, W) int64: the columns each row attends to (W <= C_cap)
        chunk_ids: torch.Tensor,  # (1, T) int64: a chunk of one row's prompt; T may be 0
        chunk_position_ids: torch.Tensor,  # (1, T) int64: the chunk's positions (= columns)
        chunk_attention_mask: torch.Tensor,  # (1, W_c) int64: the columns of its row the chunk reads
        chunk_slot: torch.Tensor,  # (1,) int64: the row the chunk belongs to
        logits_index: torch.Tensor,  # (K,) int64: which of the N = B + T tokens get logits
        past_key_values: list[LayerKV],  # per layer (K, V), each (S, H_kv, C_cap, d_k): the row pool
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """One `slots` step, as GPT2.forward_slots: every row decodes one token, one row's prompt advances a chunk."""
        capacity = past_key_values[0][0].shape[2]
        step = SlotStep(position_ids, attention_mask, chunk_position_ids, chunk_attention_mask, chunk_slot, self.config.n_kv_head, capacity)
        ids = torch.cat([input_ids.reshape(1, -1), chunk_ids], dim=1)  # (1, N)
        x = self.model.embed_tokens(ids)  # (1, N, C)
        cos, sin = self.rotary(step.positions, x.dtype)  # (N, d_k)
        cos, sin = cos[:, None], sin[:, None]  # (N, 1, d_k): the same angles for every head
        presents = []
        for block, past in zip(self.model.layers, past_key_values):
            x, present = block.forward_slots(x, cos, sin, step, past)
            presents.append(present)
        return self.logits(x[0].index_select(0, logits_index)), presents  # (K, V): only the tokens sampled from


def build(config: DecoderConfig, seed: int = 0) -> Llama:
    """A model with seeded random weights, in eval mode."""
    return Llama(config).init_weights(seed).eval()
