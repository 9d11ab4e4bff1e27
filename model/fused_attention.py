"""Grouped-query attention over cache rows as one operator: the eager definition of what ONNX Runtime's
com.microsoft.GroupQueryAttention computes, so a `slots` step can be exported with fused attention
(export/fused_graph.py spells it in ONNX; tests hold the two to each other). The Llama family rotates Q and K
inside the operator; GPT-2 (learned position embeddings, added before the first layer) runs it unrotated.

row_attention: for each of B rows, S new tokens (packed Q, K and V, not yet rotated) sit at the
positions last - S + 1 .. last of that row, which are also their cache columns. With rotary tables they are
rotated by their positions (rotate_half arithmetic, the cos/sin tables indexed by position); then written
into the row's K/V buffer, and attend causally to the row's columns 0 .. their own. Columns past a row's last
token are never read, so a buffer row holds whatever it held there.

rows_and_chunk_attention: a whole step's attention, B rows of S tokens and a prompt chunk of T tokens in a
row of its own, T possibly 0: the torch custom op the exporter sees, one If a layer in ONNX (with a chunk,
two operators, the rows' and the chunk's; without, one, and the chunk's K/V pass through untouched).

ONNX Runtime writes the new K/V into the buffer it is given when present is bound to past's memory, and
reads no further than each row's last column: a decode step costs one node per layer instead of the
rotation, the scatter, the gathers and the attention (some 30 nodes). Its limits: head_dim a multiple of
16; at least one row and one new token per row; a row's S tokens are its last (no padding after them).
"""

from __future__ import annotations

import torch

from .attention import attention_bias, scaled_dot_product_attention, within_window
from .kv_storage import read_back, store_as

# ONNX Runtime 1.31's CPU kernel refuses other head widths, and rotary tables of other widths ("cos_cache dimension 1
# must be <= head_size / 2 and a multiple of 8": a partial rotation turns a multiple of 16 channels).
HEAD_DIM_MULTIPLE = 16


def supports_fused_attention(head_dim: int, rotary_dim: int | None = None) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0 and (rotary_dim is None or rotary_dim % HEAD_DIM_MULTIPLE == 0)


class FusedSlotStep:
    """What every layer of a fused `slots` step shares: B rows of S new tokens, a row's tokens ending at its last
    position, and a chunk of T >= 0 tokens of one more row; with rotary tables (cos, sin, each (P, d_k / 2),
    covering every column a row can have) Q and K are rotated, without them (GPT-2) they are not."""

    def __init__(self, input_ids, position_ids, chunk_ids, chunk_position_ids, tables: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype,
                 local_tables: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.row_tokens, self.chunk_tokens = input_ids, chunk_ids  # (B, S), (1, T): their shapes tell the operator
        B, S = input_ids.shape
        self.token_ids = torch.cat([input_ids.reshape(B * S), chunk_ids.reshape(-1)])  # (B S + T,): the rows' tokens, then the chunk's
        self.positions = torch.cat([position_ids.reshape(B * S), chunk_position_ids.reshape(-1)])  # (B S + T,)
        self.rows_last = position_ids[:, -1].to(torch.int32)  # (B,): the operator's seqlens_k, each row's length - 1
        self.rows_total = self.rows_last.max() + 1  # () int32: the longest row, as the operator wants it
        # The chunk's last position; with T = 0 (no chunk) a 0 the operator never reads, not an index past the end.
        self.chunk_last = torch.cat([chunk_position_ids, chunk_position_ids.new_zeros(1, 1)], dim=1).amax(dim=1).to(torch.int32)  # (1,)
        self.chunk_total = self.chunk_last.max() + 1  # ()
        self.rotary = tables is not None
        empty = torch.zeros(0, 1, dtype=dtype)  # the operator's cos/sin inputs stay unset when nothing rotates
        self.cos, self.sin = tables if tables is not None else (empty, empty)
        self.local_cos, self.local_sin = local_tables if local_tables is not None else (self.cos, self.sin)  # sliding layers' (Gemma 3)
        # Each token's (cos, signed sin), (B S + T, 1, d_r), where the layers turn Q and K before the operator (longrope's
        # per-row factors, model/llama.py); None: the operator turns them by the tables (or nothing turns).
        self.turned: tuple[torch.Tensor, torch.Tensor] | None = None

    def run_layers(self, blocks, x: torch.Tensor, past_key_values: list, chunk_key_values: list) -> tuple[torch.Tensor, list, list]:
        """x (B S + T, C) through every block's forward_fused: the last hidden states, the rows' (K, V) per layer and the
        chunk row's (K, V) per layer, written."""
        presents, chunk_presents = [], []
        for block, rows, chunk_row in zip(blocks, past_key_values, chunk_key_values):
            x, present, chunk_present = block.forward_fused(x, self, rows, chunk_row)
            presents.append(present)
            chunk_presents.append(chunk_present)
        return x, presents, chunk_presents

    def attend(self, qkv: torch.Tensor, rows: "tuple[torch.Tensor, torch.Tensor]", chunk_row: "tuple[torch.Tensor, torch.Tensor]", n_head: int,
               n_kv_head: int, window: int | None = None, scale: float | None = None, softcap: float | None = None, rotates: bool = True,
               store=None):
        """A layer's packed qkv (B S + T, (H + 2 H_kv) d_k) against its rows and the chunk's row (within the window
        when the layer slides, turned by the sliding layers' tables then), scores scaled by scale (d_k ** -0.5 when None)
        and soft-capped by softcap, unrotated where the layer does not rotate, K/V stored in the rows' dtype (int8 with the
        store's scales, kv_storage.py): the attention output (B S + T, H d_k), the rows' (K, V) and the chunk row's (K, V),
        written."""
        cos, sin = (self.cos, self.sin) if window is None else (self.local_cos, self.local_sin)
        scales = (None, None) if store is None or not store.quantized else (store.key_scale, store.value_scale)
        y, *present = rows_and_chunk_attention(qkv, *rows, *chunk_row, self.rows_last, self.rows_total, self.chunk_last, self.chunk_total,
                                               cos, sin, self.row_tokens, self.chunk_tokens, n_head, n_kv_head, self.rotary and rotates,
                                               -1 if window is None else window, 0.0 if scale is None else scale,
                                               0.0 if softcap is None else softcap, *scales)
        return y, tuple(present[:2]), tuple(present[2:])


def row_attention(
    qkv: torch.Tensor,  # (B, S, (H + 2 H_kv) d_k)
    past_key: torch.Tensor,  # (B, H_kv, C, d_k)
    past_value: torch.Tensor,  # (B, H_kv, C, d_k)
    last_position: torch.Tensor,  # (B,) int32: each row's last new token's position
    cos: torch.Tensor,  # (P, d_k / 2)
    sin: torch.Tensor,  # (P, d_k / 2)
    n_head: int,
    n_kv_head: int,
    rotary: bool,
    window: int,  # -1: the whole row; else how many positions up to its own a query sees
    scale: float,  # 0.0: d_k ** -0.5
    softcap: float,  # 0.0: none
    key_scale: torch.Tensor | None = None,  # (1, H_kv, 1, d_k): an int8 cache's
    value_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the attention output (B, S, H d_k) and the rows' K and V with the new tokens written, stored in the
    rows' dtype (kv_storage.py): a token attends to its own K/V as stored."""
    B, S, _ = qkv.shape
    C, d_k = past_key.shape[2], past_key.shape[3]
    positions = last_position.long()[:, None] - S + 1 + torch.arange(S, device=qkv.device)  # (B, S)
    q, k, v = qkv.view(B, S, n_head + 2 * n_kv_head, d_k).split([n_head, n_kv_head, n_kv_head], dim=2)  # (B, S, heads, d_k)
    if rotary:
        cos_p, sin_p = cos[positions][:, :, None], sin[positions][:, :, None]  # (B, S, 1, d_r / 2): the first d_r channels turn

    def rotate(x):  # (x1, x2, rest) -> (x1 cos - x2 sin, x2 cos + x1 sin, rest)
        if not rotary:
            return x
        half = cos_p.shape[-1]
        x1, x2, rest = x.split([half, half, x.shape[-1] - 2 * half], dim=-1)
        return torch.cat([x1 * cos_p - x2 * sin_p, x2 * cos_p + x1 * sin_p, rest], dim=-1)

    rows = torch.arange(B, device=qkv.device)[:, None].expand(B, S)  # (B, S)
    present_key, present_value = past_key.clone(), past_value.clone()
    token_scales = (None, None) if key_scale is None else (key_scale[0, :, 0], value_scale[0, :, 0])  # (H_kv, d_k)
    present_key[rows, :, positions] = store_as(rotate(k), past_key.dtype, token_scales[0])  # each (B, S, H_kv, d_k) at (row, column)
    present_value[rows, :, positions] = store_as(v, past_value.dtype, token_scales[1])
    allowed = within_window(torch.arange(C, device=qkv.device)[None, None, :], positions[:, :, None], None if window < 0 else window)  # (B, S, C)
    keys, values = read_back(present_key, key_scale, q.dtype), read_back(present_value, value_scale, q.dtype)  # (B, H_kv, C, d_k)
    y = scaled_dot_product_attention(rotate(q).transpose(1, 2), keys, values, attention_bias(allowed[:, None]),
                                     scale or None, softcap or None)  # (B, H, S, d_k)
    return y.transpose(1, 2).reshape(B, S, n_head * d_k), present_key, present_value


@torch.library.custom_op("kvserve::rows_and_chunk_attention", mutates_args=())
def rows_and_chunk_attention(
    qkv: torch.Tensor,  # (B S + T, (H + 2 H_kv) d_k): the rows' tokens, then the chunk's
    rows_key: torch.Tensor,  # (B, H_kv, C, d_k)
    rows_value: torch.Tensor,  # (B, H_kv, C, d_k)
    chunk_key: torch.Tensor,  # (1, H_kv, C, d_k)
    chunk_value: torch.Tensor,  # (1, H_kv, C, d_k)
    rows_last: torch.Tensor,  # (B,) int32
    rows_total: torch.Tensor,  # () int32: the longest row after the step (the operator's total_sequence_length)
    chunk_last: torch.Tensor,  # (1,) int32
    chunk_total: torch.Tensor,  # () int32
    cos: torch.Tensor,  # (P, d_k / 2); (0, 1) when not rotary
    sin: torch.Tensor,  # (P, d_k / 2); (0, 1) when not rotary
    row_tokens: torch.Tensor,  # (B, S): read for its shape only
    chunk_tokens: torch.Tensor,  # (1, T): read for its shape only
    n_head: int,
    n_kv_head: int,
    rotary: bool,
    window: int,  # -1: none; a sliding-window layer's window
    scale: float,  # 0.0: d_k ** -0.5
    softcap: float,  # 0.0: none
    key_scale: torch.Tensor | None = None,  # (1, H_kv, 1, d_k) float32: an int8 cache's; None for a float one
    value_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the attention output (B S + T, H d_k), the rows' K and V and the chunk row's K and V, written (in the
    rows' dtype)."""
    (B, S), T = row_tokens.shape, chunk_tokens.shape[1]
    tables = (cos, sin, n_head, n_kv_head, rotary, window, scale, softcap, key_scale, value_scale)
    y_rows, rows_key, rows_value = row_attention(qkv[: B * S].reshape(B, S, -1), rows_key, rows_value, rows_last, *tables)  # (B, S, H d_k)
    y_rows = y_rows.reshape(B * S, -1)  # (B S, H d_k)
    if T == 0:
        return y_rows, rows_key, rows_value, chunk_key.clone(), chunk_value.clone()
    y_chunk, chunk_key, chunk_value = row_attention(qkv[B * S :].reshape(1, T, -1), chunk_key, chunk_value, chunk_last, *tables)  # (1, T, H d_k)
    return torch.cat([y_rows, y_chunk.reshape(T, -1)]), rows_key, rows_value, chunk_key, chunk_value


@rows_and_chunk_attention.register_fake
def _(qkv, rows_key, rows_value, chunk_key, chunk_value, rows_last, rows_total, chunk_last, chunk_total, cos, sin, row_tokens, chunk_tokens,
      n_head, n_kv_head, rotary, window, scale, softcap, key_scale=None, value_scale=None):
    y = qkv.new_empty(qkv.shape[0], n_head * rows_key.shape[3])
    return y, torch.empty_like(rows_key), torch.empty_like(rows_value), torch.empty_like(chunk_key), torch.empty_like(chunk_value)
