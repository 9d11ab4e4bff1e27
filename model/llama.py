"""The eager reference decoder for the Llama family (model_type llama, qwen2, mistral, qwen3, gemma2, gemma3_text, phi3,
smollm3), written to be read as gpt2.py is.

References: Touvron et al., "LLaMA" (2023) and "Llama 2" (2023); Su et al., "RoFormer: rotary position
embedding" (2021); Shazeer, "GLU variants improve transformer" (2020); Ainslie et al., "GQA" (2023). The
arithmetic follows transformers' LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM,
Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM and SmolLM3ForCausalLM, which the tests hold it to.

What differs from GPT-2: RMSNorm instead of LayerNorm; no position table, but Q and K rotated by their
position (RoPE, from position_ids); a gated MLP; n_kv_head K/V heads shared by groups of query heads (the
cache holds the K/V heads only); an LM head that may be its own matrix. The forward signatures, the cache
layouts and the attention over them are GPT-2's (attention.py), so export and serving treat both alike.

The other families are deltas of Llama's, each a DecoderConfig field read here: Qwen3's RMSNorm of each Q and K head
before the rotation (qk_norm); Gemma's (1 + weight) norms, scaled embeddings, GeGLU, norms after each branch, own
attention scale and soft caps; Gemma 3's sliding layers' own RoPE base (local_rotary); Phi-3's partial rotation;
SmolLM3's layers without rotation; sliding windows (attention.py's masks). The rotary frequencies and their
rescalings are in rope.py.

Projections are fused as GPT-2's c_attn is: Q, K and V in one matrix, the MLP's gate and up in another, so
a step runs one matrix product where a checkpoint stores three or two (checkpoint.py splits and joins them).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.contract.config import DecoderConfig

from .attention import LayerKV, SlotStep, attention_allowed, attention_bias, cached_attention, query_columns, slots_attention
from .fused_attention import FusedSlotStep
from .rope import RotaryEmbedding, rotary_tables, rotate


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in float32 so a float16 model stays stable. Gemma's (offset 1) scales
    by 1 + weight, in float32 before the cast back (transformers' Gemma order; Llama's casts first)."""

    def __init__(self, width: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        if torch.onnx.is_in_onnx_export():
            # The same arithmetic spelled as ONNX Runtime's fusion expects (x / sqrt, not x * rsqrt): it becomes one
            # SimplifiedLayerNormalization instead of 7 ops, for each of a 30-layer model's 61 norms a step. The
            # eager model keeps transformers' rsqrt, whose rounding the tests hold it to; verify holds the graph to it.
            normed = h / torch.sqrt(variance + self.eps)
        else:
            normed = h * torch.rsqrt(variance + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.d_head = config.n_head, config.n_kv_head, config.head_dim
        self.window = config.window(layer)  # None: the whole context
        self.rotates = layer not in config.nope_layers  # SmolLM3's every fourth layer turns nothing
        self.scale, self.softcap = config.attention_scale, config.attn_logit_softcapping
        q_width, kv_width = self.n_head * self.d_head, self.n_kv_head * self.d_head
        self.qkv_proj = nn.Linear(config.d_model, q_width + 2 * kv_width, bias=config.qkv_bias)  # fused Q, K, V
        self.o_proj = nn.Linear(q_width, config.d_model, bias=config.o_bias)  # W_O: mixes the concatenated heads
        # Qwen3's per-head norms: each head's d_k channels of Q (and of K) RMS-normalised, one weight shared by the heads.
        self.q_norm = RMSNorm(self.d_head, config.layer_norm_eps, config.norm_weight_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(self.d_head, config.layer_norm_eps, config.norm_weight_offset) if config.qk_norm else None
        self.kv_store = None  # how the cache stores K/V (kv_storage.store_kv_as); None: as computed

    def normed(self, qk: torch.Tensor) -> torch.Tensor:
        """qk (..., H + H_kv, d_k) with the per-head norms applied (as it is without them)."""
        if self.q_norm is None:
            return qk
        q, k = qk.split([self.n_head, self.n_kv_head], dim=-2)  # (..., H, d_k), (..., H_kv, d_k)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=-2)  # (..., H + H_kv, d_k)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (..., C) -> q (..., H, d_k), k and v (..., H_kv, d_k), q and k rotated (together: one rotation a layer)."""
        qkv = self.qkv_proj(x).unflatten(-1, (self.n_head + 2 * self.n_kv_head, self.d_head))  # (..., H + 2 H_kv, d_k)
        qk, v = qkv.split([self.n_head + self.n_kv_head, self.n_kv_head], dim=-2)  # (..., H + H_kv, d_k), (..., H_kv, d_k)
        qk = self.normed(qk)
        q, k = (rotate(qk, cos, sin) if self.rotates else qk).split([self.n_head, self.n_kv_head], dim=-2)  # (..., H, d_k), (..., H_kv, d_k)
        return q, k, v

    def forward(self, x, cos, sin, bias, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        """x (B, T, C); cos, sin (B, T, 1, d_k)."""
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project(x, cos, sin))  # (B, H, T, d_k), 2 x (B, H_kv, T, d_k)
        y, present = cached_attention(q, k, v, bias, past, self.scale, self.softcap, self.kv_store)  # (B, H, T, d_k)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.d_head)  # (B, T, H * d_k): heads concatenated
        return self.o_proj(y), present

    def forward_slots(self, x, cos, sin, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        """x (N, C): the step's tokens, decode rows first; cos, sin (N, 1, d_k). past: the row pool."""
        q, k, v = self.project(x, cos, sin)  # (N, H, d_k), 2 x (N, H_kv, d_k)
        y, present = slots_attention(q, k, v, step, past, self.window is not None, self.scale, self.softcap, self.kv_store)  # (N, H * d_k)
        return self.o_proj(y), present

    def forward_fused(self, x, step: FusedSlotStep, rows: LayerKV, chunk_row: LayerKV) -> tuple[torch.Tensor, LayerKV, LayerKV]:
        """x (B S + T, C): S new tokens for each of B rows, then T chunk tokens; rows (B, H_kv, C_cap, d_k) and
        chunk_row (1, H_kv, C_cap, d_k) the cache rows they are written into. Rotation, cache write and attention are
        one operator for the rows and one for the chunk (none when T is 0)."""
        if step.turned is not None:  # turned here (longrope's per-row factors), the operator only writes and attends
            q, k, v = self.project(x, *step.turned)  # (N, H, d_k), 2 x (N, H_kv, d_k)
            y, present, chunk_present = step.attend(torch.cat([q, k, v], dim=-2).flatten(-2), rows, chunk_row, self.n_head, self.n_kv_head,
                                                    self.window, self.scale, self.softcap, False, self.kv_store)  # (N, H d_k)
            return self.o_proj(y), present, chunk_present
        qkv = self.qkv_proj(x)  # (B S + T, (H + 2 H_kv) d_k): unrotated
        if self.q_norm is not None:  # the operator rotates what it is given: the norms come first
            qk, v = qkv.unflatten(-1, (-1, self.d_head)).split([self.n_head + self.n_kv_head, self.n_kv_head], dim=-2)  # (N, H + H_kv, d_k), (N, H_kv, d_k)
            qkv = torch.cat([self.normed(qk), v], dim=-2).flatten(-2)  # (N, (H + 2 H_kv) d_k)
        y, present, chunk_present = step.attend(qkv, rows, chunk_row, self.n_head, self.n_kv_head, self.window, self.scale,
                                                self.softcap, self.rotates, self.kv_store)  # (B S + T, H d_k)
        return self.o_proj(y), present, chunk_present  # (B S + T, C)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Llama), GeGLU with tanh-approximated GELU (Gemma)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.d_mlp = config.d_mlp
        self.act = F.silu if config.hidden_act == "silu" else partial(F.gelu, approximate="tanh")
        self.gate_up_proj = nn.Linear(config.d_model, 2 * config.d_mlp, bias=config.mlp_bias)  # fused gate and up
        self.down_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.d_mlp, dim=-1)  # 2 x (..., d_mlp)
        return self.down_proj(self.act(gate) * up)


class LlamaBlock(nn.Module):
    """Pre-norm block: residual + attention, residual + MLP. With sandwich norms (Gemma) each branch's output is normed
    too before its residual add; Gemma's checkpoints name the norms input_layernorm, post_attention_layernorm (on the
    attention's output), pre_feedforward_layernorm and post_feedforward_layernorm, Llama's the first two (the second
    before the MLP)."""

    def __init__(self, config: DecoderConfig, layer: int):
        super().__init__()
        norm = partial(RMSNorm, config.d_model, config.layer_norm_eps, config.norm_weight_offset)
        self.input_layernorm = norm()
        self.self_attn = GroupedQueryAttention(config, layer)
        self.post_attention_layernorm = norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.sandwich = config.sandwich_norms
        self.mlp = GatedMLP(config)

    def residuals(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The block's output from its input x and its attention's output."""
        if not self.sandwich:
            x = x + attn_out
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward(self, x, cos, sin, bias, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, bias, past)
        return self.residuals(x, attn_out), present

    def forward_slots(self, x, cos, sin, step: SlotStep, past: LayerKV) -> tuple[torch.Tensor, LayerKV]:
        attn_out, present = self.self_attn.forward_slots(self.input_layernorm(x), cos, sin, step, past)
        return self.residuals(x, attn_out), present

    def forward_fused(self, x, step: FusedSlotStep, rows: LayerKV, chunk_row: LayerKV) -> tuple[torch.Tensor, LayerKV, LayerKV]:
        attn_out, present, chunk_present = self.self_attn.forward_fused(self.input_layernorm(x), step, rows, chunk_row)
        return self.residuals(x, attn_out), present, chunk_present


class Llama(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.d_model),
                layers=nn.ModuleList(LlamaBlock(config, layer) for layer in range(config.n_layer)),
                norm=RMSNorm(config.d_model, config.layer_norm_eps, config.norm_weight_offset),
            )
        )
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's sliding-window layers turn at a base of their own, unscaled; None: every layer turns alike.
        local = None if config.local_rope_theta is None else replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        self.local_rotary = None if local is None else RotaryEmbedding(local)
        self.local_layers = {layer for layer in range(config.n_layer) if config.window(layer) is not None} if local else set()

    def init_weights(self, seed: int) -> "Llama":
        """Normal(0, initializer_range) matrices, zero biases, unit norms (transformers' initialisation: a Gemma norm's
        stored weight 0), from a seed."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif "norm" in name:
                    param.fill_(1.0 - self.config.norm_weight_offset)
                else:
                    torch.randn(param.shape, generator=generator, out=param.detach()).mul_(self.config.initializer_range)  # randn * std, in place
        return self

    def empty_cache(self, batch_size: int, capacity: int = 0, rings: bool = False) -> list[LayerKV]:
        """Zeroed K/V of the K/V heads for every layer (see GPT2.empty_cache). rings: a standard slots pool, whose ring
        layers hold their ring and its scratch column (DecoderConfig.kv_ring) instead of capacity columns."""
        param = self.model.embed_tokens.weight
        config, rings = self.config, self.config.ring_columns() if rings else {}
        shapes = [(batch_size, config.n_kv_head, rings.get(layer, capacity), config.head_dim) for layer in range(config.n_layer)]  # each (B, H_kv, C, d_k)
        return [(param.new_zeros(shape), param.new_zeros(shape)) for shape in shapes]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; logits leave in float32 whatever the model's dtype, so sampling is precise."""
        logits = self.head(self.model.norm(x)).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., C) -> (..., V) by the LM head: the embedding when tied (weights.streamed_reference reads it in blocks)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # (V, C)
        # F.linear, not x @ weight.T: on a slots step's (K, C) rows it exports as one Gemm reading the (V, C) matrix
        # as stored, row by row, the faster layout for a few rows on the CPU (and no transposed copy of the table).
        return F.linear(x, weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, (..., C); Gemma's scaled by sqrt(d_model) rounded to the model's dtype, as transformers has it."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.d_model**0.5, dtype=torch.float32).to(x.dtype)
        return x

    def angles(self, positions: torch.Tensor, dtype: torch.dtype, long: torch.Tensor | None = None) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, signed sin), each (..., T, d_k), of the global layers (key False) and, with a local base, the sliding ones
        (key True); long: which positions turn by longrope's long factors (rope.RotaryEmbedding.turns)."""
        global_ = self.rotary(positions, dtype, long)
        return {False: global_, True: global_ if self.local_rotary is None else self.local_rotary(positions, dtype)}

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        attention_mask: torch.Tensor,  # (B, S) int64 over the cache columns, 0 = padding
        position_ids: torch.Tensor,  # (B, T) int64
        past_key_values: list[LayerKV],  # per layer (K, V), each (B, H_kv, P, d_k)
        long_rope: torch.Tensor | None = None,  # (B, 1) bool: longrope rows turned long whatever their length (verify's check)
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        columns = query_columns(attention_mask, input_ids.shape[1])  # (T,)
        window = self.config.sliding_window
        biases = {w: attention_bias(attention_allowed(attention_mask, columns, w)) for w in {None, window}}  # each (B, 1, T, S)
        x = self.embed(input_ids)  # (B, T, C)
        long = long_rope  # longrope: a row turns long when its last position is past the original context, as transformers has it
        if long is None and self.config.long_rope_after is not None:
            long = position_ids.amax(dim=1, keepdim=True) + 1 > self.config.long_rope_after  # (B, 1)
        angles = {local: (cos[:, :, None], sin[:, :, None]) for local, (cos, sin) in self.angles(position_ids, x.dtype, long).items()}  # (B, T, 1, d_k)
        presents = []
        for layer, (block, past) in enumerate(zip(self.model.layers, past_key_values)):
            x, present = block(x, *angles[layer in self.local_layers], biases[block.self_attn.window], past)
            presents.append(present)
        return self.logits(x), presents  # (B, T, V)

    def long_tokens(self, long_rope: torch.Tensor | None, chunk_long_rope: torch.Tensor | None, per_row: int, chunk_tokens: int) -> torch.Tensor | None:
        """A slots step's longrope choice per token (N,) bool, the rows' per_row tokens each then the chunk's, from the
        rows' (B,) and the chunk's (1,) choices (io_contract.LONG_ROPE); None (every token short) for a model without two
        sets, or when no choice is given."""
        if self.config.long_rope_after is None or long_rope is None:
            return None
        rows = long_rope[:, None].expand(-1, per_row).reshape(-1)  # (B S,)
        return torch.cat([rows, chunk_long_rope.expand(chunk_tokens)]) > 0  # (B S + T,)

    def forward_slots(self, input_ids, position_ids, attention_mask, chunk_ids, chunk_position_ids, chunk_attention_mask, chunk_slot,
                      logits_index, past_key_values: list[LayerKV], long_rope=None, chunk_long_rope=None) -> tuple[torch.Tensor, list[LayerKV]]:
        """One `slots` step, with GPT2.forward_slots's inputs and meaning: every row decodes one token and one row's
        prompt advances by a chunk, in one pass; logits only at logits_index. The pool rows are (S, H_kv, C_cap, d_k), a
        sliding-window layer's (S, H_kv, R + 1, d_k) when the model's windowed rows are rings (DecoderConfig.kv_ring).
        A longrope model's rows and chunk say which factors they turn by (long_rope (B,), chunk_long_rope (1,))."""
        config = self.config
        rings = set(config.ring_layers())
        whole = next((layer for layer in range(config.n_layer) if layer not in rings), 0)  # a whole-context layer, if any
        step = SlotStep(input_ids, position_ids, attention_mask, chunk_ids, chunk_position_ids, chunk_attention_mask, chunk_slot,
                        past_key_values[whole], config.sliding_window, config.kv_ring, config.n_ctx)
        x = self.embed(step.token_ids)  # (N, C): a slots step needs no batch axis
        long = self.long_tokens(long_rope, chunk_long_rope, 1, chunk_ids.shape[1])  # (N,) or None
        angles = {local: (cos[:, None], sin[:, None]) for local, (cos, sin) in self.angles(step.positions, x.dtype, long).items()}  # (N, 1, d_k)
        presents = []
        for layer, (block, past) in enumerate(zip(self.model.layers, past_key_values)):
            x, present = block.forward_slots(x, *angles[layer in self.local_layers], step, past)
            presents.append(present)
        return self.logits(x.index_select(0, logits_index)), presents  # (K, V): only the tokens sampled from

    def forward_slots_fused(self, input_ids, position_ids, chunk_ids, chunk_position_ids, logits_index, past_key_values: list[LayerKV],
                            chunk_key_values: list[LayerKV], long_rope=None, chunk_long_rope=None) -> tuple[torch.Tensor, list[LayerKV], list[LayerKV]]:
        """The `slots` step with fused attention (fused_attention.py): B rows of past_key_values (each (B, H_kv, C_cap,
        d_k)) take S new tokens each, input_ids and position_ids (B, S), at consecutive positions ending at the row's
        last; a chunk of T >= 0 tokens (chunk_ids, chunk_position_ids (1, T)) goes into the row chunk_key_values (each
        (1, H_kv, C_cap, d_k)). The server's rows are decode rows (S = 1) beside a chunk, or a lone chunk as the one
        row; chunk_key_values may be a row of the same pool, written only where the chunk is (or nowhere, T = 0). A row
        that is also the chunk's must write elsewhere than the chunk does (the caller's scratch column): the exported
        graph fixes no order between the two operators. Logits at logits_index of the B S row tokens (row by row), then
        the T chunk tokens. A longrope model's rows and chunk say which factors they turn by (long_rope (B,),
        chunk_long_rope (1,)): the operator's one table cannot, so such a model turns Q and K before it."""
        dtype = self.model.embed_tokens.weight.dtype
        long = self.long_tokens(long_rope, chunk_long_rope, input_ids.shape[1], chunk_ids.shape[1])  # (B S + T,) or None
        tables = None if long is not None else rotary_tables(self.rotary, self.config.n_ctx + 1, dtype)  # (n_ctx + 1, d_k / 2) each
        local_tables = None if self.local_rotary is None else rotary_tables(self.local_rotary, self.config.n_ctx + 1, dtype)
        step = FusedSlotStep(input_ids, position_ids, chunk_ids, chunk_position_ids, tables, dtype, local_tables)
        if long is not None:
            cos, sin = self.rotary(step.positions, dtype, long)  # (B S + T, d_r) each
            step.turned = (cos[:, None], sin[:, None])  # (B S + T, 1, d_r): GroupedQueryAttention.forward_fused turns with them
        x = self.embed(step.token_ids)  # (B S + T, C): a slots step needs no batch axis
        x, presents, chunk_presents = step.run_layers(self.model.layers, x, past_key_values, chunk_key_values)
        return self.logits(x.index_select(0, logits_index)), presents, chunk_presents  # (K, V)
