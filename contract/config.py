"""Decoder hyper-parameters: one frozen dataclass, passed whole to every module. Plain Python (no torch): the eager
reference, export, the runtime and the server all read it; presets of it live with the reference (model/presets.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Families of decoder the eager reference implements. Each model_type a config.json may name maps to one.
GPT2_ARCH, LLAMA_ARCH = "gpt2", "llama"
MODEL_TYPES = {"gpt2": GPT2_ARCH, "llama": LLAMA_ARCH, "qwen2": LLAMA_ARCH, "mistral": LLAMA_ARCH, "qwen3": LLAMA_ARCH,
               "gemma2": LLAMA_ARCH, "gemma3_text": LLAMA_ARCH, "phi3": LLAMA_ARCH, "smollm3": LLAMA_ARCH}
# Those whose config.json can ask for sliding-window layers.
SLIDING_MODEL_TYPES = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3")
# The MLP's gate activations: SwiGLU's and GeGLU's (transformers' names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# A windowed layer's slots cache row is a ring of its window and this many positions more (DecoderConfig.kv_ring): a
# row whose later positions overwrote its earliest still serves a prompt that shares all but its last RING_SLACK
# tokens (service/core/kv_rows.py), which a prompt cache matching by blocks of 16 tokens needs.
RING_SLACK = 16


# How a config.json's rope_scaling may stretch the rotary frequencies (model/rope.py computes each as transformers does).
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")


# Every count and size a config.json gives is below this: a larger one is damage, and past it int() overflows what torch
# indexes with (10^30 layers); the largest real ones are near 10^7 (a context).
SIZE_LIMIT = 2**31


@dataclass(frozen=True)
class RopeScaling:
    """A rotary frequency rescaling, so a model trained at original_max_position_embeddings reads longer contexts.

    linear  every frequency divided by factor (position interpolation).
    dynamic NTK: transformers raises the base by factor once a sequence is longer than max_position_embeddings, and
            not before; kvserve's context is max_position_embeddings, so the plain frequencies are the only ones it
            ever turns by (the stretch past the context, which depends on the longest row of each forward call and on
            the calls before it in transformers, is not served).
    llama3  Llama 3.1's: long wavelengths slowed by factor, short ones kept, the band between (low_freq_factor ..
            high_freq_factor) blended.
    yarn    YaRN (Peng et al., 2023): frequencies blended between interpolated and kept over the band beta_slow ..
            beta_fast rotations, and cos/sin scaled by attention_factor (from factor, mscale and mscale_all_dim when
            the config gives none).
    longrope  LongRoPE (Phi-3, Phi-4-mini): each frequency divided by its short_factor while a sequence fits the
            original context, by its long_factor past it; cos/sin scaled by attention_factor (from factor when the
            config gives none). The set is chosen per sequence: the long one once a sequence is longer than the original
            context, its whole cache turned again then (model/rope.py, service/core/scheduler.py).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    original_max_position_embeddings: int | None = 8192  # linear and dynamic need none
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: None derives it from factor (and the mscales)
    truncate: bool = True  # yarn: round the blended band to whole channels
    short_factor: tuple[float, ...] = ()  # longrope: one per frequency
    long_factor: tuple[float, ...] = ()  # longrope: one per frequency

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (kvserve implements 'default', {', '.join(map(repr, ROPE_TYPES))})")
        if self.rope_type not in ("linear", "dynamic") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("rope_type 'longrope' needs short_factor and long_factor, one per frequency each")
        # Frequencies are divided by these: a zero, a NaN or an infinity would turn every rotation into NaN (or a
        # ZeroDivisionError while the tables are built), so each is refused by name.
        numbers = {"factor": self.factor, "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                   "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "mscale": self.mscale,
                   "mscale_all_dim": self.mscale_all_dim, "attention_factor": self.attention_factor}
        for name, value in numbers.items():
            if value is not None and not math.isfinite(value):
                raise ValueError(f"rope_scaling's {name} must be a finite number, got {value}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling's factor must be positive, got {self.factor}")
        original = self.original_max_position_embeddings
        if original is not None and not 2 <= original < SIZE_LIMIT:  # yarn and longrope take its log
            raise ValueError(f"rope_scaling's original_max_position_embeddings must be in [2, {SIZE_LIMIT}), got {original}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_type 'llama3' blends between low_freq_factor and high_freq_factor, which must be 0 < low < high, "
                             f"got {self.low_freq_factor} and {self.high_freq_factor}")
        if not all(math.isfinite(f) and f > 0 for f in self.short_factor + self.long_factor):
            raise ValueError("rope_type 'longrope' divides each frequency by its factor: every short_factor and long_factor must be "
                             "a positive finite number")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str = "gpt2"  # config.json's model_type: gpt2, or one of the Llama family (llama, qwen2, mistral, qwen3, gemma2, gemma3_text)
    vocab_size: int = 50257  # rows of the token embedding (and of the LM head)
    n_ctx: int = 1024  # context length: the most positions prompt + generated may span
    d_model: int = 768  # residual stream width
    n_head: int = 12  # query heads per layer
    n_layer: int = 12  # transformer blocks
    d_mlp: int = 3072  # hidden width of each block's MLP
    layer_norm_eps: float = 1e-5  # epsilon of every norm (LayerNorm for GPT-2, RMSNorm for Llama)
    dropout: float = 0.0  # kept for checkpoint round-trips; inference never drops out
    eos_token_ids: tuple[int, ...] = (50256,)  # generation stops on any of these; () when the model has none
    bos_token_id: int | None = None  # written back to config.json; tokenizers add it, the model does not
    initializer_range: float = 0.02  # std of random initial weights (config.json keeps it)
    # The Llama family; GPT-2 keeps the defaults (None means "as many as n_head" / "d_model // n_head").
    n_kv_head: int | None = None  # K/V heads, shared by groups of n_head // n_kv_head query heads; the cache holds these
    head_dim: int | None = None  # width of one head (Llama-family configs may set it apart from d_model // n_head)
    rope_theta: float = 10000.0  # base of the rotary embedding's frequencies
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    mlp_bias: bool = False  # biases on the MLP's three projections (Llama's mlp_bias)
    tie_word_embeddings: bool = True  # the LM head is the token embedding (GPT-2 always; Llama when config says)
    qk_norm: bool = False  # an RMSNorm over each head's d_k channels of Q and of K, before the rotation (Qwen3)
    # Sliding-window attention: in the layers listed, a query sees only the sliding_window most recent positions (itself
    # included), as transformers' sliding mask has it. None (and no layers) when every layer sees the whole context.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Gemma's deltas from Llama (each a Llama-family setting, kept at its default by every other type):
    hidden_act: str = "silu"  # the gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_weight_offset: float = 0.0  # RMSNorms scale by (offset + weight): Gemma stores weight - 1 (offset 1)
    embed_scale: bool = False  # embeddings multiplied by sqrt(d_model)
    sandwich_norms: bool = False  # norms after the attention and after the MLP too (before each residual add)
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5 instead of head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap), before the mask
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base (unscaled); None: theirs is everyone's
    partial_rotary_factor: float = 1.0  # the share of each head's channels rotated, from the first (Phi-4-mini: 0.75)
    nope_layers: tuple[int, ...] = ()  # layers whose Q and K are not rotated at all (SmolLM3's every fourth)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; kvserve implements {', '.join(MODEL_TYPES)}")
        # Resolve the derived defaults once, so every reader sees concrete numbers.
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.head_dim is None and self.n_head > 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "sliding_layers", tuple(sorted({int(i) for i in self.sliding_layers})))
        object.__setattr__(self, "nope_layers", tuple(sorted({int(i) for i in self.nope_layers})))
        if self.nope_layers and not 0 <= self.nope_layers[0] <= self.nope_layers[-1] < self.n_layer:
            raise ValueError(f"DecoderConfig.nope_layers {self.nope_layers} must be layers 0 .. {self.n_layer - 1}")
        if self.sliding_window is not None and (self.sliding_window <= 0 or not self.sliding_layers):
            raise ValueError(f"DecoderConfig.sliding_window {self.sliding_window} needs a positive window and the layers it applies to")
        if self.sliding_window is not None and self.model_type not in SLIDING_MODEL_TYPES:
            raise ValueError(f"DecoderConfig.sliding_window: model_type {self.model_type!r} has no sliding window ({', '.join(SLIDING_MODEL_TYPES)} do)")
        if self.sliding_layers and (self.sliding_window is None or not 0 <= self.sliding_layers[0] <= self.sliding_layers[-1] < self.n_layer):
            raise ValueError(f"DecoderConfig.sliding_layers {self.sliding_layers} needs a sliding_window and layers 0 .. {self.n_layer - 1}")
        for name in ("vocab_size", "n_ctx", "d_model", "n_head", "n_layer", "d_mlp", "n_kv_head", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DecoderConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("layer_norm_eps", "rope_theta", "initializer_range", "dropout", "norm_weight_offset", "partial_rotary_factor"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"DecoderConfig.{name} must be a finite number, got {getattr(self, name)}")
        if self.layer_norm_eps < 0:
            raise ValueError(f"DecoderConfig.layer_norm_eps must be at least 0, got {self.layer_norm_eps}")
        if not self.rope_theta > 1:  # yarn divides by the base's log
            raise ValueError(f"DecoderConfig.rope_theta, the rotary frequencies' base, must be above 1, got {self.rope_theta}")
        if self.architecture == GPT2_ARCH:
            if self.d_model % self.n_head:
                raise ValueError(f"d_model ({self.d_model}) is not divisible by n_head ({self.n_head})")
            llama_only = {"n_kv_head": self.n_kv_head != self.n_head, "head_dim": self.head_dim != self.d_model // self.n_head,
                          "rope_scaling": self.rope_scaling is not None, "qkv_bias": self.qkv_bias, "o_bias": self.o_bias,
                          "mlp_bias": self.mlp_bias, "tie_word_embeddings": not self.tie_word_embeddings,
                          "qk_norm": self.qk_norm, "sliding_window": self.sliding_window is not None, "hidden_act": self.hidden_act != "silu",
                          "norm_weight_offset": self.norm_weight_offset != 0.0, "embed_scale": self.embed_scale,
                          "sandwich_norms": self.sandwich_norms, "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
                          "attn_logit_softcapping": self.attn_logit_softcapping is not None,
                          "final_logit_softcapping": self.final_logit_softcapping is not None, "local_rope_theta": self.local_rope_theta is not None,
                          "partial_rotary_factor": self.partial_rotary_factor != 1.0, "nope_layers": bool(self.nope_layers)}
            for name, set_apart in llama_only.items():
                if set_apart:
                    raise ValueError(f"DecoderConfig.{name} is a Llama-family setting; GPT-2 keeps its default")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"DecoderConfig.hidden_act {self.hidden_act!r}: kvserve implements {', '.join(ACTIVATIONS)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"DecoderConfig.{name} must be positive and finite, or None, got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) is not a multiple of n_kv_head ({self.n_kv_head})")
        if self.architecture == LLAMA_ARCH and (self.rotary_dim % 2 or self.rotary_dim <= 0):
            raise ValueError(f"head_dim ({self.head_dim}) x partial_rotary_factor ({self.partial_rotary_factor}) = {self.rotary_dim} rotated "
                             "channels: must be even and positive (rotary embeddings rotate pairs of channels)")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope" and len(scaling.short_factor) != self.rotary_dim // 2:
            raise ValueError(f"longrope's factors: {len(scaling.short_factor)} given, one per frequency ({self.rotary_dim // 2}) wanted")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos_token_id {eos} is outside the vocabulary ({self.vocab_size})")

    @property
    def architecture(self) -> str:
        """The decoder family that implements this config: GPT2_ARCH or LLAMA_ARCH."""
        return MODEL_TYPES[self.model_type]

    @property
    def rotary_dim(self) -> int:
        """How many of each head's channels the rotary embedding turns (the first ones); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """What Q.K is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """How many recent positions layer's queries see (themselves included); None: the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def kv_ring(self) -> int | None:
        """Positions a windowed layer's row of a standard slots cache holds: position p in column p mod kv_ring, the
        scratch column after them (contract/io_contract.py); None when no layer has a window or a ring would not be
        shorter than a whole context."""
        if self.sliding_window is None or self.sliding_window + RING_SLACK >= self.n_ctx:
            return None
        return self.sliding_window + RING_SLACK

    def ring_layers(self) -> tuple[int, ...]:
        """The layers whose standard slots cache rows are rings (kv_ring); () when none are."""
        return self.sliding_layers if self.kv_ring is not None else ()

    def ring_columns(self) -> dict[int, int]:
        """{layer: columns} of a standard slots cache's ring rows: the ring and its scratch column; {} when none are."""
        return {layer: self.kv_ring + 1 for layer in self.ring_layers()}

    @property
    def long_rope_after(self) -> int | None:
        """longrope: the length past which a sequence turns by the long factors (original_max_position_embeddings);
        None for every other model."""
        scaling = self.rope_scaling
        return scaling.original_max_position_embeddings if scaling is not None and scaling.rope_type == "longrope" else None

    @property
    def long_rope_recompute_at(self) -> int | None:
        """The position whose step turns a longrope sequence's whole cache again by the long factors, the one past the
        original context: transformers' Phi-3 does (its generate drops the cache there). None for every other model:
        transformers' other longrope models keep the cached K as they were turned, and turn only what follows long."""
        return self.long_rope_after if self.model_type == "phi3" else None

    @property
    def d_head(self) -> int:
        return self.head_dim

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (what config.json's single-id field holds), None when there is none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None
