"""The eager reference decoder: GPT-2, written to be read.

References: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019); the parameter
names follow the published GPT-2 checkpoints so loading is a key-by-key copy (see checkpoint.py).

One forward serves prefill and decode. It takes the tokens of this step, an attention mask over past +
present positions (0 marks padding), explicit position ids, and the per-layer cache of K and V, each
(B, H, P, d_k); it returns logits and the cache grown by this step, each (B, H, P + T, d_k). P = 0 is a
prefill. This is also exactly the graph we export (export/onnx_export.py), so there is one definition.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderConfig

# One layer's cache entry: (K, V), each (B, H, S, d_k).
LayerKV = tuple[torch.Tensor, torch.Tensor]


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose statistics are always computed in float32, so a float16 model stays stable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def attention_allowed(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Which keys each query may attend to: causal, offset by the past length, and never padding.

    attention_mask: (B, P + T), 1 for real tokens and 0 for padding. Returns a bool (B, 1, T, P + T).
    """
    total_len = attention_mask.shape[1]
    past_len = total_len - query_len
    query_pos = torch.arange(query_len, device=attention_mask.device) + past_len  # (T,)
    key_pos = torch.arange(total_len, device=attention_mask.device)  # (P + T,)
    causal = key_pos[None, :] <= query_pos[:, None]  # (T, P + T)
    return causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # (B, 1, T, P + T)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.n_head = config.n_head
        self.d_head = config.d_head
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)  # fused Q, K, V projection
        self.c_proj = nn.Linear(config.d_model, config.d_model)  # W_O: mixes the concatenated heads

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        k = k.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        v = v.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        past_k, past_v = past
        k = torch.cat([past_k, k], dim=2)  # (B, H, P + T, d_k)
        v = torch.cat([past_v, v], dim=2)  # (B, H, P + T, d_k)
        y = scaled_dot_product_attention(q, k, v, allowed)  # (B, H, T, d_k)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads concatenated
        return self.c_proj(y), (k, v)


def scaled_dot_product_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d_k)) v over the allowed keys; scores and softmax in float32 for fp16 safety.

    A query whose keys are all masked (a padding position) gets uniform weights, not NaN: its output is
    never read, but NaN would poison nothing less than the whole batch's logits check.
    """
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])  # (B, H, T, P + T)
    scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, T, P + T)
    return weights @ v  # (B, H, T, d_k)


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.d_mlp)
        self.c_proj = nn.Linear(config.d_mlp, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU ("gelu_new").
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: residual + attention, residual + MLP."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.attn(self.ln_1(x), allowed, past)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present


class GPT2(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.d_model),
                wpe=nn.Embedding(config.n_ctx, config.d_model),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=LayerNorm(config.d_model, eps=config.layer_norm_eps),
            )
        )

    def init_weights(self, seed: int) -> "GPT2":
        """GPT-2's initialisation (normal 0.02, residual projections scaled by depth), from a seed."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif ".ln_" in name or name.startswith("transformer.ln_f"):
                    param.fill_(1.0)
                else:
                    std = residual_std if name.endswith("c_proj.weight") else 0.02
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
        return self

    def empty_cache(self, batch_size: int) -> list[LayerKV]:
        """A zero-length past for every layer: what a prefill starts from."""
        param = self.transformer.wte.weight
        shape = (batch_size, self.config.n_head, 0, self.config.d_head)  # (B, H, 0, d_k)
        return [(param.new_zeros(shape), param.new_zeros(shape)) for _ in range(self.config.n_layer)]

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        attention_mask: torch.Tensor,  # (B, P + T) int64, 0 = padding
        position_ids: torch.Tensor,  # (B, T) int64
        past_key_values: list[LayerKV],  # per layer (K, V), each (B, H, P, d_k)
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        allowed = attention_allowed(attention_mask, input_ids.shape[1])  # (B, 1, T, P + T)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)  # (B, T, C)
        presents = []
        for block, past in zip(self.transformer.h, past_key_values):
            x, present = block(x, allowed, past)
            presents.append(present)
        x = self.transformer.ln_f(x)
        # Tied LM head; logits leave in float32 whatever the model's dtype, so sampling is precise.
        logits = (x @ self.transformer.wte.weight.T).float()  # (B, T, V)
        return logits, presents


def build(config: DecoderConfig, seed: int = 0) -> GPT2:
    """A model with seeded random GPT-2 weights, in eval mode."""
    return GPT2(config).init_weights(seed).eval()
