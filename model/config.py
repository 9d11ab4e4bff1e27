"""Decoder hyper-parameters: one frozen dataclass, passed whole to every module."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 50257  # rows of the token embedding, tied to the LM head
    n_ctx: int = 1024  # context length: the most positions prompt + generated may span
    d_model: int = 768  # residual stream width
    n_head: int = 12  # attention heads per layer; d_model must divide evenly
    n_layer: int = 12  # transformer blocks
    d_mlp: int = 3072  # hidden width of each block's MLP
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0  # kept for checkpoint round-trips; inference never drops out
    eos_token_id: int | None = 50256  # end-of-sequence token, None when the model has none
    initializer_range: float = 0.02  # std of random initial weights (GPT-2's; config.json keeps it)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_ctx", "d_model", "n_head", "n_layer", "d_mlp"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DecoderConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) is not divisible by n_head ({self.n_head})")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside the vocabulary ({self.vocab_size})")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "DecoderConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    # --- GPT-2 checkpoint format (transformers' config.json) -----------------------------

    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_ctx,
            "n_embd": self.d_model,
            "n_head": self.n_head,
            "n_layer": self.n_layer,
            "n_inner": self.d_mlp,
            "layer_norm_epsilon": self.layer_norm_eps,
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "attn_pdrop": self.dropout,
            "bos_token_id": self.eos_token_id,
            "eos_token_id": self.eos_token_id,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "DecoderConfig":
        """Map a GPT-2 config.json onto ours; anything we do not implement is refused by name."""
        if hf.get("model_type") != "gpt2":
            raise ValueError(f"unsupported architecture: model_type {hf.get('model_type')!r} (only 'gpt2' is supported)")
        unsupported = {
            "activation_function": ("gelu_new", hf.get("activation_function", "gelu_new")),
            "scale_attn_weights": (True, hf.get("scale_attn_weights", True)),
            "scale_attn_by_inverse_layer_idx": (False, hf.get("scale_attn_by_inverse_layer_idx", False)),
            "reorder_and_upcast_attn": (False, hf.get("reorder_and_upcast_attn", False)),
            "add_cross_attention": (False, hf.get("add_cross_attention", False)),
            "tie_word_embeddings": (True, hf.get("tie_word_embeddings", True)),
        }
        for key, (expected, actual) in unsupported.items():
            if actual != expected:
                raise ValueError(f"unsupported GPT-2 variant: {key}={actual!r} (kvserve implements {key}={expected!r})")
        missing = [k for k in ("vocab_size", "n_embd", "n_head", "n_layer") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        d_model = int(hf["n_embd"])
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None and not 0 <= int(eos) < int(hf["vocab_size"]):
            eos = None  # an id the model can never emit: transformers tolerates it, and so do we
        return cls(
            vocab_size=int(hf["vocab_size"]),
            n_ctx=int(hf.get("n_positions", hf.get("n_ctx", 1024))),
            d_model=d_model,
            n_head=int(hf["n_head"]),
            n_layer=int(hf["n_layer"]),
            d_mlp=int(hf.get("n_inner") or 4 * d_model),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            eos_token_id=None if eos is None else int(eos),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )


PRESETS: dict[str, DecoderConfig] = {
    # Byte-level vocabulary (256 bytes + end-of-sequence): exports in seconds, drives the demo and tests. Its
    # weights are drawn wider than GPT-2's 0.02 so that what it generates depends on the context: at 0.02 a
    # model this small repeats its prompt's last token, and tests of stops, seeds and batching pass trivially.
    "tiny": DecoderConfig(vocab_size=257, n_ctx=256, d_model=64, n_head=4, n_layer=2, d_mlp=256, eos_token_id=256, initializer_range=0.3),
    # GPT-2 small, 124M parameters.
    "gpt2": DecoderConfig(),
}


def preset(name: str) -> DecoderConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}") from None
