"""The eager reference decoder: GPT-2, written to be read.

References: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019); the parameter
names follow the published GPT-2 checkpoints so loading is a key-by-key copy (see checkpoint.py).

One forward serves prefill and decode. It takes the tokens of this step, an attention mask over the cache
columns (0 marks padding), explicit position ids, and the per-layer cache of K and V in the concat
layout; forward_slots runs the server's `slots` layout. The layouts, and the attention over them,
live in attention.py, shared with the Llama family (llama.py). Logits are computed only where asked
(logits_index) in a slots step.

This is also exactly the graph we export (export/onnx_export.py), so there is one definition.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.contract.config import DecoderConfig

from .attention import LayerKV, SlotStep, attention_allowed, attention_bias, cached_attention, query_columns, slots_attention
from .fused_attention import FusedSlotStep


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose statistics are always computed in float32, so a float16 model stays stable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.n_head = config.n_head
        self.d_head = config.d_head
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)  # fused Q, K, V projection
        self.c_proj = nn.Linear(config.d_model, config.d_model)  # W_O: mixes the concatenated heads
        self.kv_store = None  # how the cache stores K/V (kv_storage.store_kv_as); None: as computed

    def forward(self, x, bias, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        k = k.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        v = v.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        y, present = cached_attention(q, k, v, bias, past, store=self.kv_store)  # (B, H, T, d_k)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads concatenated
        return self.c_proj(y), present

    def forward_slots(self, x, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        """x (1, N, C): the step's tokens, decode rows first. past: the row pool, each (S, H, C_cap, d_k)."""
        _, N, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (1, N, C)
        shape = (N, self.n_head, self.d_head)
        y, present = slots_attention(q.view(shape), k.view(shape), v.view(shape), step, past, store=self.kv_store)  # (N, C)
        return self.c_proj(y[None]), present

    def forward_fused(self, x, step: FusedSlotStep, rows: LayerKV, chunk_row: LayerKV) -> tuple[torch.Tensor, LayerKV, LayerKV]:
        """x (B S + T, C): S new tokens for each of B rows, then T chunk tokens (see Llama's forward_fused); the cache
        write and the attention are one operator for the rows and one for the chunk, nothing rotated."""
        y, present, chunk_present = step.attend(self.c_attn(x), rows, chunk_row, self.n_head, self.n_head, store=self.kv_store)  # (B S + T, C)
        return self.c_proj(y), present, chunk_present  # (B S + T, C)


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

    def forward(self, x, bias, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.attn(self.ln_1(x), bias, past)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present

    def forward_slots(self, x, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.attn.forward_slots(self.ln_1(x), step, past)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present

    def forward_fused(self, x, step: FusedSlotStep, rows: LayerKV, chunk_row: LayerKV) -> tuple[torch.Tensor, LayerKV, LayerKV]:
        attn_out, present, chunk_present = self.attn.forward_fused(self.ln_1(x), step, rows, chunk_row)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present, chunk_present


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
        """GPT-2's initialisation (normal initializer_range, residual projections scaled by depth), from a seed."""
        generator = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif ".ln_" in name or name.startswith("transformer.ln_f"):
                    param.fill_(1.0)
                else:
                    scale = residual_std if name.endswith("c_proj.weight") else std
                    torch.randn(param.shape, generator=generator, out=param.detach()).mul_(scale)  # randn * scale, in place
        return self

    def empty_cache(self, batch_size: int, capacity: int = 0) -> list[LayerKV]:
        """Zeroed K/V for every layer: a zero-length past (concat: what a prefill starts from), or with capacity
        columns a pool of batch_size rows (slots)."""
        param = self.transformer.wte.weight
        shape = (batch_size, self.config.n_head, capacity, self.config.d_head)  # (B, H, C, d_k)
        return [(param.new_zeros(shape), param.new_zeros(shape)) for _ in range(self.config.n_layer)]

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        attention_mask: torch.Tensor,  # (B, S) int64 over the cache columns, 0 = padding
        position_ids: torch.Tensor,  # (B, T) int64
        past_key_values: list[LayerKV],  # per layer (K, V), each (B, H, P, d_k)
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        columns = query_columns(attention_mask, input_ids.shape[1])  # (T,)
        bias = attention_bias(attention_allowed(attention_mask, columns))  # (B, 1, T, S)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)  # (B, T, C)
        presents = []
        for block, past in zip(self.transformer.h, past_key_values):
            x, present = block(x, bias, past)
            presents.append(present)
        x = self.transformer.ln_f(x)
        # Tied LM head; logits leave in float32 whatever the model's dtype, so sampling is precise.
        logits = (x @ self.transformer.wte.weight.T).float()  # (B, T, V)
        return logits, presents

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
        past_key_values: list[LayerKV],  # per layer (K, V), each (B, H, C_cap, d_k): the row pool
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """One `slots` step: every row decodes one token and one row's prompt advances by a chunk, in one pass.

        A row that has nothing to decode (a free row, or the row whose chunk this is) still gets a token: the
        caller writes it at a column no real token will be read from before it is overwritten (the last one).
        Positions past the context are clamped for the position embedding only: they are those scratch tokens.
        """
        step = SlotStep(input_ids, position_ids, attention_mask, chunk_ids, chunk_position_ids, chunk_attention_mask, chunk_slot, past_key_values[0])
        positions = step.positions.clamp(max=self.config.n_ctx - 1)  # (N,)
        x = (self.transformer.wte(step.token_ids) + self.transformer.wpe(positions))[None]  # (1, N, C)
        presents = []
        for block, past in zip(self.transformer.h, past_key_values):
            x, present = block.forward_slots(x, step, past)
            presents.append(present)
        x = self.transformer.ln_f(x[0].index_select(0, logits_index))  # (K, C): only the tokens sampled from
        return (x @ self.transformer.wte.weight.T).float(), presents  # (K, V)

    def forward_slots_fused(self, input_ids, position_ids, chunk_ids, chunk_position_ids, logits_index, past_key_values: list[LayerKV],
                            chunk_key_values: list[LayerKV]) -> tuple[torch.Tensor, list[LayerKV], list[LayerKV]]:
        """The `slots` step with fused attention, with Llama.forward_slots_fused's inputs and meaning. Positions past the
        context are clamped for the position embedding only: they are the caller's scratch tokens."""
        step = FusedSlotStep(input_ids, position_ids, chunk_ids, chunk_position_ids, None, self.transformer.wte.weight.dtype)
        positions = step.positions.clamp(max=self.config.n_ctx - 1)  # (B S + T,)
        x = self.transformer.wte(step.token_ids) + self.transformer.wpe(positions)  # (B S + T, C): a slots step needs no batch axis
        x, presents, chunk_presents = step.run_layers(self.transformer.h, x, past_key_values, chunk_key_values)
        x = self.transformer.ln_f(x.index_select(0, logits_index))  # (K, C): only the tokens sampled from
        return (x @ self.transformer.wte.weight.T).float(), presents, chunk_presents  # (K, V)
