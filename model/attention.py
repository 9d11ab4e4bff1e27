"""Causal attention over the per-layer KV cache, shared by every architecture (gpt2.py, llama.py).

A model projects its own Q, K and V (and rotates them, for Llama); from there the cache and the attention
are the same. The cache comes in one of two layouts, the same ones the export offers (contract/io_contract.py):

  concat   the eager reference's, and an export format for tools that drive the graph Optimum-style: past
           (B, H_kv, P, d_k) -> present (B, H_kv, P + T, d_k), the new K/V appended; the mask is (B, P + T).
           P = 0 is a prefill.
  slots    the server's: a pool of per-sequence rows (S, H_kv, C, d_k), each row left-aligned (a token at
           position p lives in column p); one step runs one new token for every row plus one chunk of one
           row's prompt, so decode and chunked prefill share one pass over the weights (SlotStep). A sliding-window
           layer's rows are rings instead when the model has one (DecoderConfig.kv_ring: R = the window and a block):
           (S, H_kv, R + 1, d_k), position p in column p mod R, scratch tokens in column R, so a row holds the
           window, not the whole context.

The cache holds H_kv heads. With grouped-query attention (H_kv < H) each K/V head serves H / H_kv query
heads; they are grouped only inside the attention functions below, never repeated in the cache.
"""

from __future__ import annotations

import torch

from .kv_storage import LayerKvStore, read_back, store_as

# One layer's cache entry: (K, V), each (B, H_kv, S, d_k).
LayerKV = tuple[torch.Tensor, torch.Tensor]


def attention_allowed(attention_mask: torch.Tensor, query_columns: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to: causal by cache column, within the window when there is one, and never
    padding.

    attention_mask: (B, S) over the cache columns, 1 for real tokens and 0 for padding. query_columns: (T,)
    the column each query's own K/V occupy. window: how many columns up to its own a query sees, as transformers'
    sliding mask counts them (cache columns, padding included). Returns a bool (B, 1, T, S).
    """
    key_columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # (S,)
    causal = within_window(key_columns[None, :], query_columns[:, None], window)  # (T, S)
    return causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # (B, 1, T, S)


def within_window(key_columns: torch.Tensor, query_columns: torch.Tensor, window: int | None) -> torch.Tensor:
    """key <= query, and key > query - window when there is a window (broadcast; transformers' sliding overlay)."""
    causal = key_columns <= query_columns
    return causal if window is None else causal & (key_columns > query_columns - window)


def query_columns(attention_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """The cache column of each of this step's T queries: the last T of the mask's."""
    return torch.arange(steps, device=attention_mask.device) + attention_mask.shape[1] - steps  # (T,)


def attention_bias(allowed: torch.Tensor) -> torch.Tensor:
    """The allowed keys as an additive float32 bias: 0 where allowed, the most negative float elsewhere.

    Built once per step and added to every layer's scores: a broadcast Where per layer and head cost ONNX
    Runtime 0.3 s of a 1.3 s 1,000-token prefill on the development VM; one Add costs a fraction of that.
    """
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def attention_scores(qk: torch.Tensor, d_k: int, scale: float | None, softcap: float | None) -> torch.Tensor:
    """q k^T as the softmax reads it before the mask: in float32, scaled (by d_k ** -0.5 unless the model says other),
    and soft-capped to (-softcap, softcap) by tanh when the model asks (Gemma 2), in transformers' order."""
    scores = qk.float() * (d_k**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def scaled_dot_product_attention(q, k, v, bias, scale: float | None = None, softcap: float | None = None):
    """softmax(q k^T * scale + bias) v for q (B, H, T, d_k), k and v (B, H_kv, S, d_k), bias (B, 1, T, S)
    from attention_bias; scale d_k ** -0.5 unless given, scores soft-capped when softcap is given (attention_scores);
    scores and softmax in float32 for fp16 safety. A query whose keys are all masked (a
    padding position) gets uniform weights, not NaN: its output is never read, but NaN would poison nothing
    less than the whole batch's logits check.

    Grouped-query attention (H_kv < H): query head h reads K/V head h // (H / H_kv), as transformers'
    repeat_kv has it. The group's queries are stacked as extra rows of one matrix against their shared
    K/V head, so K/V are neither repeated nor copied.
    """
    B, H, T, d_k = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    if H_kv == H:
        scores = attention_scores(q @ k.transpose(-2, -1), d_k, scale, softcap) + bias  # (B, H, T, S)
        weights = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, T, S)
        return weights @ v  # (B, H, T, d_k)
    group = H // H_kv
    q = q.reshape(B, H_kv, group * T, d_k)  # (B, H_kv, g * T, d_k): row j * T + t is query head h_kv * g + j at t
    scores = attention_scores(q @ k.transpose(-2, -1), d_k, scale, softcap)  # (B, H_kv, g * T, S)
    scores = scores.view(B, H_kv, group, T, S) + bias[:, :, None]  # (B, H_kv, g, T, S): one bias for the group
    weights = torch.softmax(scores, dim=-1).to(v.dtype).view(B, H_kv, group * T, S)  # (B, H_kv, g * T, S)
    return (weights @ v).view(B, H, T, d_k)  # (B, H, T, d_k)


def one_token_attention(q, k, v, bias, scale: float | None = None, softcap: float | None = None):
    """scaled_dot_product_attention for one query a row, as a decode step has: q (B, H, d_k), k and v (B, H_kv,
    W, d_k), bias (B, 1, 1, W). A K/V head's group of query heads is a (g, d_k) matrix by a plain view, so this
    costs two reshapes where the general form needs six (a 30-layer model runs it 30 times a step).
    Returns (B, H * d_k), the heads concatenated."""
    B, H, d_k = q.shape
    H_kv = k.shape[1]
    q = q.view(B, H_kv, H // H_kv, d_k)  # (B, H_kv, g, d_k): query head h_kv * g + j is row j
    scores = attention_scores(q @ k.transpose(-2, -1), d_k, scale, softcap) + bias  # (B, H_kv, g, W)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H_kv, g, W)
    return (weights @ v).view(B, H * d_k)  # (B, H * d_k)


def chunk_attention(q, k, v, bias, scale: float | None = None, softcap: float | None = None):
    """scaled_dot_product_attention for one row's prompt chunk, without a batch axis: q (T, H, d_k), that row's k
    and v (H_kv, 1, W_c, d_k), bias (T, W_c). A decode step runs it on an empty chunk in every layer, so it is
    spelled in few ops. (The reshape to 4 axes also keeps ONNX Runtime from folding q's transpose into its
    FusedMatMul, whose batch-transposed form fails on an empty chunk with a floating point exception.)
    Returns (T, H * d_k), the heads concatenated."""
    T, H, d_k = q.shape
    H_kv = k.shape[0]
    q = q.transpose(0, 1).reshape(H_kv, H // H_kv, T, d_k)  # (H_kv, g, T, d_k): a K/V head's query heads
    scores = attention_scores(q @ k.transpose(-2, -1), d_k, scale, softcap) + bias  # (H_kv, g, T, W_c)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # (H_kv, g, T, W_c)
    return (weights @ v).view(H, T, d_k).transpose(0, 1).reshape(T, H * d_k)  # (T, H * d_k)


def cached_attention(q, k, v, bias, past: LayerKV, scale: float | None = None, softcap: float | None = None,
                     store: LayerKvStore | None = None) -> tuple[torch.Tensor, LayerKV]:
    """This step's q (B, H, T, d_k) and new k, v (B, H_kv, T, d_k) against the concat cache, the new k and v as the
    store keeps them (kv_storage.py; None: as computed). Returns the attention output (B, H, T, d_k) and the layer's
    present (K, V)."""
    if store is not None:
        k, v = store.round_trip(k, v)  # 2 x (B, H_kv, T, d_k): what a cache of the store's dtype would read back
    past_k, past_v = past
    k = torch.cat([past_k, k], dim=2)  # (B, H_kv, P + T, d_k)
    v = torch.cat([past_v, v], dim=2)  # (B, H_kv, P + T, d_k)
    return scaled_dot_product_attention(q, k, v, bias, scale, softcap), (k, v)


def counting(like: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., n - 1 for a 1-D like of n elements, counted from its values (a running sum of ones), not from its
    shape: an arange of a shape runs on the CPU under ONNX Runtime's CUDA provider and is copied to the device, which
    a CUDA graph cannot capture (export/cuda_placement.py)."""
    return (like * 0 + 1).cumsum(0) - 1  # (n,)


class SlotStep:
    """Where one `slots` step's N = B + T tokens go: B decode tokens (one per cache row, rows 0..B-1) then
    a prompt chunk of T tokens of row `chunk_slot`. Built once per forward, shared by every layer.

    Both parts read their rows' columns with one gather from the pool seen as (S * H_kv * C_cap, d_k): decode
    rows their first W columns, the chunk its own row's first W_c. (Slicing the pool's column axis cost ONNX
    Runtime a fifth of a 16-row decode step; the gather copies the same cells at memcpy speed.) Every index is
    computed from values on the device, none from a shape (counting): the CUDA provider then runs the whole step
    there, and a decode step can be captured as a CUDA graph (export/cuda_placement.py checks it)."""

    def __init__(self, input_ids, position_ids, attention_mask, chunk_ids, chunk_position_ids, chunk_attention_mask, chunk_slot, pool: LayerKV,
                 window: int | None = None, ring: int | None = None, scratch: int | None = None):
        """The slots inputs (see GPT2.forward_slots, contract/io_contract.py), a whole-context layer's row pool (any layer's
        when every layer is a ring), the sliding window of the layers that have one (their biases are built beside the
        others'), and, when those layers' rows are rings, the positions a ring holds (DecoderConfig.kv_ring) and the
        position scratch tokens run at (the model's context length: a whole-context row writes it in its last column)."""
        n_kv_head = pool[0].shape[1]
        decode_positions, chunk_positions = position_ids.reshape(-1), chunk_position_ids.reshape(-1)  # (B,), (T,)
        self.token_ids = torch.cat([input_ids.reshape(-1), chunk_ids.reshape(-1)])  # (N,): decode tokens, then the chunk
        decode_rows = counting(decode_positions)  # (B,)
        rows = torch.cat([decode_rows, chunk_slot + chunk_positions * 0])  # (N,): the chunk's tokens all in chunk_slot
        self.positions = torch.cat([decode_positions, chunk_positions])  # (N,): a token's column is its position
        heads = torch.arange(n_kv_head, device=position_ids.device)  # (H_kv,): a constant in the graph
        # Every token's K/V goes to (its row, each head, its column): indices built whole, once a step, so each
        # layer's scatter takes its K/V as they are.
        shape = (rows.shape[0], n_kv_head)  # an Expand's shape: read on the host, which no data depends on
        # The pool's row width as a device value (counted, as counting does): as a shape it would be a host value.
        capacity = torch.ones(pool[0].shape[2], dtype=torch.int64, device=position_ids.device).sum()  # ()
        columns = self.positions
        if ring is not None:  # scratch tokens run at the context length, past a shorter pool's last column: kept in it
            columns = torch.minimum(columns, capacity - 1)  # (N,)
        self.write_index = [rows[:, None].expand(shape), heads[None, :].expand(shape), columns[:, None].expand(shape)]  # 3 x (N, H_kv)
        self.n_decode = position_ids.shape[0]  # B: a size that sizes a Split (read from the host, no copy)
        decode_columns = counting(attention_mask[0])  # (W,): decode rows read these
        decode_planes = (decode_rows[:, None] * n_kv_head + heads)[:, :, None]  # (B, H_kv, 1)
        self.decode_cells = decode_planes * capacity + decode_columns  # (B, H_kv, W)
        self.decode_bias = attention_bias((attention_mask > 0)[:, None, None, :])  # (B, 1, 1, W)
        chunk_columns = counting(chunk_attention_mask[0])  # (W_c,): the chunk reads these
        chunk_planes = (chunk_slot * n_kv_head + heads)[:, None, None]  # (H_kv, 1, 1)
        self.chunk_cells = chunk_planes * capacity + chunk_columns  # (H_kv, 1, W_c)
        causal = chunk_columns[None, :] <= chunk_positions[:, None]  # (T, W_c)
        self.chunk_bias = attention_bias(causal & (chunk_attention_mask > 0))  # (T, W_c)
        if window is not None:  # a row's columns are its positions: the window counts back from each query's own
            recent = within_window(decode_columns[None, :], decode_positions[:, None], window)  # (B, W)
            self.decode_bias_local = attention_bias((recent & (attention_mask > 0))[:, None, None, :])  # (B, 1, 1, W)
            recent = within_window(chunk_columns[None, :], chunk_positions[:, None], window)  # (T, W_c)
            self.chunk_bias_local = attention_bias(recent & (chunk_attention_mask > 0))  # (T, W_c)
        self.ring = ring
        if ring is not None:
            self._ring_indices(rows, heads, shape, decode_positions, decode_columns, decode_planes, chunk_positions, chunk_columns,
                               chunk_planes, window, ring, scratch)

    def _ring_indices(self, rows, heads, shape, decode_positions, decode_columns, decode_planes, chunk_positions, chunk_columns,
                      chunk_planes, window: int, ring: int, scratch: int) -> None:
        """A ring layer's indices and biases (every ring the same width, R + 1 columns: `ring` positions, then the scratch
        one). A token at position p is written in column p mod R; a scratch token in column R; a chunk token that a later
        one of the same chunk overwrites (a chunk longer than R) in column R too, as one scatter must not write a cell
        twice. Decode rows read their ring after this step's write, as the whole-context layers do: the position a
        column holds is the latest one up to the row's own that falls in it. The chunk reads its row's ring as it was
        before this step (its later tokens overwrite what its earlier ones see) and its own new K/V beside it."""
        chunk_index = counting(chunk_positions)  # (T,)
        # (): T, counted over one element more: ONNX Runtime's CUDA ReduceSum refuses an empty input (a step without
        # a chunk) where its CPU kernel answers 0
        chunk_length = torch.cat([chunk_positions * 0 + 1, chunk_positions.new_zeros(1)]).sum()
        overwritten = torch.cat([decode_positions < 0, chunk_index + ring < chunk_length])  # (N,): the chunk's first T - R
        columns = torch.where((self.positions >= scratch) | overwritten, ring, self.positions % ring)  # (N,)
        self.ring_write_index = [rows[:, None].expand(shape), heads[None, :].expand(shape), columns[:, None].expand(shape)]  # 3 x (N, H_kv)
        read = decode_columns[:ring]  # (W_r,): min(W, R) columns; a row shorter than R has not wrapped
        self.ring_decode_cells = decode_planes * (ring + 1) + read  # (B, H_kv, W_r)
        last = decode_positions[:, None]  # (B, 1): each row's own position, just written
        held = last - (last - read[None, :] + ring) % ring  # (B, W_r): the position each column holds (< 0: none yet)
        self.ring_decode_bias = attention_bias(((held >= 0) & (held > last - window))[:, None, None, :])  # (B, 1, 1, W_r)
        read = chunk_columns[:ring]  # (W_cr,)
        self.ring_chunk_cells = chunk_planes * (ring + 1) + read  # (H_kv, 1, W_cr)
        before = (chunk_positions - chunk_index - 1)[:, None]  # (T, 1): the position before the chunk's first
        held = before - (before - read[None, :] + ring) % ring  # (T, W_cr)
        seen = (held >= 0) & (held > chunk_positions[:, None] - window)  # (T, W_cr)
        own = within_window(chunk_index[None, :], chunk_index[:, None], window)  # (T, T): the chunk's own tokens
        self.ring_chunk_bias = attention_bias(torch.cat([seen, own], dim=1))  # (T, W_cr + T)


def slots_attention(q, k, v, step: SlotStep, past: LayerKV, local: bool = False, scale: float | None = None,
                    softcap: float | None = None, store: LayerKvStore | None = None) -> tuple[torch.Tensor, LayerKV]:
    """A `slots` step's q (N, H, d_k) and new k, v (N, H_kv, d_k), decode rows first, against the row pool
    past (each (S, H_kv, C_cap, d_k), of the store's dtype: kv_storage.py); local: a sliding-window layer's. Returns the
    attention output (N, H * d_k) and the pool, written."""
    d_k = q.shape[2]
    B = step.n_decode
    if store is not None:
        scales = (None, None) if not store.quantized else (store.key_scale[0, :, 0], store.value_scale[0, :, 0])  # (H_kv, d_k)
        k, v = store_as(k, store.stored, scales[0]), store_as(v, store.stored, scales[1])  # (N, H_kv, d_k), stored
    if local and step.ring is not None:
        return ring_attention(q, k, v, step, past, scale, softcap, store)
    # One scatter writes every token's K/V at (its row, every head, its column): present is past, updated.
    past_k, past_v = past
    k = torch.ops.aten.index_put(past_k, step.write_index, k)  # (S, H_kv, C_cap, d_k)
    v = torch.ops.aten.index_put(past_v, step.write_index, v)  # (S, H_kv, C_cap, d_k)
    k_cells, v_cells = k.reshape(-1, d_k), v.reshape(-1, d_k)  # (S * H_kv * C_cap, d_k): the same memory
    k_decode, v_decode = k_cells[step.decode_cells], v_cells[step.decode_cells]  # (B, H_kv, W, d_k)
    k_row, v_row = k_cells[step.chunk_cells], v_cells[step.chunk_cells]  # (H_kv, 1, W_c, d_k)
    biases = (step.decode_bias_local, step.chunk_bias_local) if local else (step.decode_bias, step.chunk_bias)
    return _decode_and_chunk(q, B, (k_decode, v_decode), (k_row, v_row), biases, scale, softcap, store), (k, v)


def _decode_and_chunk(q, B: int, decode_kv, chunk_kv, biases, scale: float | None, softcap: float | None,
                      store: LayerKvStore | None) -> torch.Tensor:
    """The decode rows' and the chunk's attention over the K/V each reads (decode_kv: 2 x (B, H_kv, W, d_k); chunk_kv:
    2 x (H_kv, 1, W_c, d_k); as the store holds them, read back here in the compute dtype), biases (decode's, chunk's).
    Returns (N, H * d_k), the decode rows first."""
    (k_decode, v_decode), (k_row, v_row) = decode_kv, chunk_kv
    if store is not None:  # read back in the compute dtype
        k_decode = read_back(k_decode, store.key_scale, q.dtype)  # scales (1, H_kv, 1, d_k)
        v_decode = read_back(v_decode, store.value_scale, q.dtype)
        row_scales = (None, None) if not store.quantized else (store.key_scale.transpose(0, 1), store.value_scale.transpose(0, 1))  # (H_kv, 1, 1, d_k)
        k_row, v_row = read_back(k_row, row_scales[0], q.dtype), read_back(v_row, row_scales[1], q.dtype)
    q_decode, q_chunk = q.split([B, q.shape[0] - B])  # (B, H, d_k), (T, H, d_k)
    y_decode = one_token_attention(q_decode, k_decode, v_decode, biases[0], scale, softcap)  # (B, H * d_k)
    y_chunk = chunk_attention(q_chunk, k_row, v_row, biases[1], scale, softcap)  # (T, H * d_k)
    return torch.cat([y_decode, y_chunk])  # (N, H * d_k)


def ring_attention(q, k, v, step: SlotStep, past: LayerKV, scale: float | None, softcap: float | None,
                   store: LayerKvStore | None) -> tuple[torch.Tensor, LayerKV]:
    """slots_attention for a ring layer (SlotStep._ring_indices): q (N, H, d_k), k and v (N, H_kv, d_k) as stored, past
    each (S, H_kv, R + 1, d_k). Returns the attention output (N, H * d_k) and the rings, written."""
    d_k = q.shape[2]
    B = step.n_decode
    past_k, past_v = past
    old_k, old_v = past_k.reshape(-1, d_k)[step.ring_chunk_cells], past_v.reshape(-1, d_k)[step.ring_chunk_cells]  # (H_kv, 1, W_cr, d_k)
    # The step binds present to past's memory, so the chunk's read must come before the write: the write's index is
    # made to depend on what was read (a zero from it), which orders the two in the graph (export checks the order).
    after_read = (old_k.reshape(-1)[:1].float().sum() * 0 + old_v.reshape(-1)[:1].float().sum() * 0).to(torch.int64)  # (): 0
    rows, heads, columns = step.ring_write_index
    index = [rows + after_read, heads, columns]  # 3 x (N, H_kv)
    ring_k = torch.ops.aten.index_put(past_k, index, k)  # (S, H_kv, R + 1, d_k)
    ring_v = torch.ops.aten.index_put(past_v, index, v)
    k_decode, v_decode = ring_k.reshape(-1, d_k)[step.ring_decode_cells], ring_v.reshape(-1, d_k)[step.ring_decode_cells]  # (B, H_kv, W_r, d_k)
    own_k, own_v = k[B:].transpose(0, 1)[:, None], v[B:].transpose(0, 1)[:, None]  # (H_kv, 1, T, d_k): the chunk's new K/V
    k_row, v_row = torch.cat([old_k, own_k], dim=2), torch.cat([old_v, own_v], dim=2)  # (H_kv, 1, W_cr + T, d_k)
    biases = (step.ring_decode_bias, step.ring_chunk_bias)
    return _decode_and_chunk(q, B, (k_decode, v_decode), (k_row, v_row), biases, scale, softcap, store), (ring_k, ring_v)
