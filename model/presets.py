"""Named configs the eager reference builds with seeded random weights (`kvserve export --preset`): the tests', the
demo's and the benchmarks' models when no checkpoint is given."""

from __future__ import annotations

from kvserve.contract.config import DecoderConfig

PRESETS: dict[str, DecoderConfig] = {
    # Byte-level vocabulary (256 bytes + end-of-sequence): exports in seconds, drives the demo and tests. Its
    # weights are drawn wider than GPT-2's 0.02 so that what it generates depends on the context: at 0.02 a
    # model this small repeats its prompt's last token, and tests of stops, seeds and batching pass trivially.
    "tiny": DecoderConfig(vocab_size=257, n_ctx=256, d_model=64, n_head=4, n_layer=2, d_mlp=256, eos_token_ids=(256,), initializer_range=0.3),
    # GPT-2 small, 124M parameters.
    "gpt2": DecoderConfig(),
    # The tiny preset's Llama-family twin (RMSNorm, RoPE, SwiGLU, 2 K/V heads for 4 query heads), for tests and the demo.
    "tiny-llama": DecoderConfig(
        model_type="llama", vocab_size=257, n_ctx=256, d_model=64, n_head=4, n_kv_head=2, n_layer=2, d_mlp=176,
        eos_token_ids=(256,), initializer_range=0.3, layer_norm_eps=1e-5,
    ),
    # SmolLM2-135M's shape (30 layers of 576, 9 query and 3 K/V heads, tied head, 49,152-token vocabulary) at a
    # 2,048-token context: a ~135M Llama-shaped model for benchmarks, with random weights.
    "llama-135m": DecoderConfig(
        model_type="llama", vocab_size=49152, n_ctx=2048, d_model=576, n_head=9, n_kv_head=3, n_layer=30, d_mlp=1536,
        eos_token_ids=(0,), rope_theta=100000.0, layer_norm_eps=1e-5, initializer_range=0.02,
    ),
}


def preset(name: str) -> DecoderConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}") from None
