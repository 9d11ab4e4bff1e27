"""The eager reference decoder: GPT-2, written to be read.

References: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019); the parameter
names follow the published GPT-2 checkpoints so loading is a key-by-key copy (see checkpoint.py).

One forward serves prefill and decode. It takes the tokens of this step, an attention mask over the cache
columns (0 marks padding), explicit position ids, and the per-layer cache of K and V. The cache comes in
one of two layouts, the same ones the export offers (export/io_contract.py):

  concat   past (B, H, P, d_k) -> present (B, H, P + T, d_k): the new K/V are appended; the mask is
           (B, P + T). P = 0 is a prefill.
  inplace  a fixed-capacity buffer (B, H, C, d_k) -> the same buffer with this step's K/V written at the
           columns `cache_position` (T,); the mask is (B, C). Exported, present can be the very memory past
           was, so a decode step writes one column instead of copying the whole cache (gpt-fast's idea).

The server's own layout, `slots`, has its own entry point (forward_slots): the cache is a pool of per-sequence
rows (S, H, C, d_k), each row left-aligned (a token at position p lives in column p), and one step runs one
new token for every row plus one chunk of one row's prompt, so decode and chunked prefill share one pass
over the weights. Logits are computed only where asked (logits_index).

This is also exactly the graph we export (export/onnx_export.py), so there is one definition.
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


def attention_allowed(attention_mask: torch.Tensor, query_columns: torch.Tensor) -> torch.Tensor:
    """Which keys each query may attend to: causal by cache column, and never padding.

    attention_mask: (B, S) over the cache columns, 1 for real tokens and 0 for padding. query_columns: (T,)
    the column each query's own K/V occupy. Returns a bool (B, 1, T, S).
    """
    key_columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # (S,)
    causal = key_columns[None, :] <= query_columns[:, None]  # (T, S)
    return causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # (B, 1, T, S)


def attention_bias(allowed: torch.Tensor) -> torch.Tensor:
    """The allowed keys as an additive float32 bias: 0 where allowed, the most negative float elsewhere.

    Built once per step and added to every layer's scores: a broadcast Where per layer and head cost ONNX
    Runtime 0.3 s of a 1.3 s 1,000-token prefill on the development VM; one Add costs a fraction of that.
    """
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def write_columns(buffer: torch.Tensor, columns: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """buffer (B, H, C, d_k) with new (B, H, T, d_k) written at the sequence columns (T,).

    Spelled as one index_put over (batch, head, column) so the export is a single ScatterND whose data
    input is the past itself (index_copy along dim 2 exports with a transpose of the whole buffer on
    each side, which would copy it twice). Eager torch copies the buffer; the exported graph need not.
    """
    batch = torch.arange(buffer.shape[0], device=buffer.device)[:, None, None]  # (B, 1, 1)
    head = torch.arange(buffer.shape[1], device=buffer.device)[None, :, None]  # (1, H, 1)
    return torch.ops.aten.index_put(buffer, [batch, head, columns[None, None, :]], new)  # (B, H, C, d_k)


class SlotStep:
    """Where one `slots` step's N = B + T tokens go: B decode tokens (one per cache row, rows 0..B-1) then
    a prompt chunk of T tokens of row `chunk_slot`. Built once per forward, shared by every layer.

    Both parts read their rows' columns with one gather from the pool seen as (S * H * C_cap, d_k): decode
    rows their first W columns, the chunk its own row's first W_c. (Slicing the pool's column axis cost ONNX
    Runtime a fifth of a 16-row decode step; the gather copies the same cells at memcpy speed.)"""

    def __init__(self, position_ids, attention_mask, chunk_position_ids, chunk_attention_mask, chunk_slot, n_head: int, capacity: int):
        B, T = position_ids.shape[0], chunk_position_ids.shape[1]
        device = position_ids.device
        rows = torch.cat([torch.arange(B, device=device), chunk_slot.expand(T)])  # (N,)
        self.write_rows = rows[:, None]  # (N, 1)
        self.write_columns = torch.cat([position_ids.reshape(B), chunk_position_ids.reshape(T)])[:, None]  # (N, 1)
        self.n_decode = B
        heads = torch.arange(n_head, device=device)  # (H,)
        decode_columns = torch.arange(attention_mask.shape[1], device=device)  # (W,): decode rows read these
        decode_planes = torch.arange(B, device=device)[:, None] * n_head + heads[None, :]  # (B, H)
        self.decode_cells = decode_planes[:, :, None] * capacity + decode_columns[None, None, :]  # (B, H, W)
        self.decode_bias = attention_bias((attention_mask > 0)[:, None, None, :])  # (B, 1, 1, W)
        chunk_columns = torch.arange(chunk_attention_mask.shape[1], device=device)  # (W_c,): the chunk reads these
        self.chunk_cells = (chunk_slot * n_head + heads)[:, None] * capacity + chunk_columns[None, :]  # (H, W_c)
        causal = chunk_columns[None, :] <= chunk_position_ids.reshape(T)[:, None]  # (T, W_c)
        self.chunk_bias = attention_bias((causal & (chunk_attention_mask > 0))[None, None])  # (1, 1, T, W_c)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.n_head = config.n_head
        self.d_head = config.d_head
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)  # fused Q, K, V projection
        self.c_proj = nn.Linear(config.d_model, config.d_model)  # W_O: mixes the concatenated heads

    def forward(self, x, bias, past: LayerKV, cache_position: torch.Tensor | None) -> tuple[torch.Tensor, LayerKV]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        k = k.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        v = v.view(B, T, self.n_head, self.d_head).transpose(1, 2)  # (B, H, T, d_k)
        past_k, past_v = past
        if cache_position is None:
            k = torch.cat([past_k, k], dim=2)  # (B, H, P + T, d_k)
            v = torch.cat([past_v, v], dim=2)  # (B, H, P + T, d_k)
        else:
            k = write_columns(past_k, cache_position, k)  # (B, H, C, d_k)
            v = write_columns(past_v, cache_position, v)  # (B, H, C, d_k)
        y = scaled_dot_product_attention(q, k, v, bias)  # (B, H, T, d_k)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads concatenated
        return self.c_proj(y), (k, v)

    def forward_slots(self, x, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        """x (1, N, C): the step's tokens, decode rows first. past: the row pool, each (S, H, C_cap, d_k)."""
        _, N, C = x.shape
        B, H, d_k = step.n_decode, self.n_head, self.d_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (1, N, C)
        heads = torch.arange(H, device=x.device)[None, :]  # (1, H)
        # One scatter writes every token's K/V at (its row, every head, its column): present is past, updated.
        index = [step.write_rows, heads, step.write_columns]  # broadcast to (N, H)
        past_k, past_v = past
        k = torch.ops.aten.index_put(past_k, index, k.view(N, H, d_k))  # (S, H, C_cap, d_k)
        v = torch.ops.aten.index_put(past_v, index, v.view(N, H, d_k))  # (S, H, C_cap, d_k)
        k_cells, v_cells = k.reshape(-1, d_k), v.reshape(-1, d_k)  # (S * H * C_cap, d_k): the same memory
        q_decode = q[0, :B].view(B, H, 1, d_k)  # (B, H, 1, d_k)
        k_decode, v_decode = k_cells[step.decode_cells], v_cells[step.decode_cells]  # (B, H, W, d_k)
        y_decode = scaled_dot_product_attention(q_decode, k_decode, v_decode, step.decode_bias)  # (B, H, 1, d_k)
        q_chunk = q[0, B:].view(N - B, H, d_k).transpose(0, 1)[None]  # (1, H, T, d_k)
        k_row, v_row = k_cells[step.chunk_cells][None], v_cells[step.chunk_cells][None]  # (1, H, W_c, d_k)
        y_chunk = scaled_dot_product_attention(q_chunk, k_row, v_row, step.chunk_bias)  # (1, H, T, d_k)
        y = torch.cat([y_decode.view(B, C), y_chunk[0].transpose(0, 1).reshape(N - B, C)])[None]  # (1, N, C)
        return self.c_proj(y), (k, v)


def scaled_dot_product_attention(q, k, v, bias):
    """softmax(q k^T / sqrt(d_k) + bias) v, bias from attention_bias; scores and softmax in float32 for fp16
    safety. A query whose keys are all masked (a padding position) gets uniform weights, not NaN: its output
    is never read, but NaN would poison nothing less than the whole batch's logits check.
    """
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1]) + bias  # (B, H, T, S)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, T, S)
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

    def forward(self, x, bias, past: LayerKV, cache_position: torch.Tensor | None) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.attn(self.ln_1(x), bias, past, cache_position)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present

    def forward_slots(self, x, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.attn.forward_slots(self.ln_1(x), step, past)
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
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        return self

    def empty_cache(self, batch_size: int, capacity: int = 0) -> list[LayerKV]:
        """Zeroed K/V for every layer: a zero-length past (concat), or an empty buffer of capacity columns
        (inplace): what a prefill starts from."""
        param = self.transformer.wte.weight
        shape = (batch_size, self.config.n_head, capacity, self.config.d_head)  # (B, H, C, d_k)
        return [(param.new_zeros(shape), param.new_zeros(shape)) for _ in range(self.config.n_layer)]

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        attention_mask: torch.Tensor,  # (B, S) int64 over the cache columns, 0 = padding
        position_ids: torch.Tensor,  # (B, T) int64
        past_key_values: list[LayerKV],  # per layer (K, V), each (B, H, P, d_k); inplace: (B, H, C, d_k)
        cache_position: torch.Tensor | None = None,  # (T,) int64: inplace layout's write columns
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        T = input_ids.shape[1]
        if cache_position is None:  # concat: this step's tokens take the last T columns
            query_columns = torch.arange(T, device=input_ids.device) + attention_mask.shape[1] - T  # (T,)
        else:
            query_columns = cache_position  # (T,)
        bias = attention_bias(attention_allowed(attention_mask, query_columns))  # (B, 1, T, S)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)  # (B, T, C)
        presents = []
        for block, past in zip(self.transformer.h, past_key_values):
            x, present = block(x, bias, past, cache_position)
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
        capacity = past_key_values[0][0].shape[2]
        step = SlotStep(position_ids, attention_mask, chunk_position_ids, chunk_attention_mask, chunk_slot, self.config.n_head, capacity)
        ids = torch.cat([input_ids.reshape(1, -1), chunk_ids], dim=1)  # (1, N)
        positions = torch.cat([position_ids.reshape(1, -1), chunk_position_ids], dim=1)  # (1, N)
        positions = positions.clamp(max=self.config.n_ctx - 1)
        x = self.transformer.wte(ids) + self.transformer.wpe(positions)  # (1, N, C)
        presents = []
        for block, past in zip(self.transformer.h, past_key_values):
            x, present = block.forward_slots(x, step, past)
            presents.append(present)
        x = self.transformer.ln_f(x[0].index_select(0, logits_index))  # (K, C): only the tokens sampled from
        return (x @ self.transformer.wte.weight.T).float(), presents  # (K, V)


def build(config: DecoderConfig, seed: int = 0) -> GPT2:
    """A model with seeded random GPT-2 weights, in eval mode."""
    return GPT2(config).init_weights(seed).eval()
