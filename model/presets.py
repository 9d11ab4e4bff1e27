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
    # Qwen3-0.6B's published config (28 layers of 1,024, 16 query and 8 K/V heads of 128, per-head Q/K norms, tied
    # 151,936-token head, 40,960-token context) with random weights: the shape most deployed on CPUs in 2026.
    "qwen3-0.6b": DecoderConfig(
        model_type="qwen3", vocab_size=151936, n_ctx=40960, d_model=1024, n_head=16, n_kv_head=8, head_dim=128, n_layer=28, d_mlp=3072,
        eos_token_ids=(151645, 151643), bos_token_id=151643, rope_theta=1000000.0, layer_norm_eps=1e-6, qk_norm=True,
    ),
    # Qwen2.5-0.5B-Instruct's published config (24 layers of 896, 14 query and 2 K/V heads of 64, Q/K/V biases, tied
    # 151,936-token head, 32,768-token context) with random weights.
    "qwen2.5-0.5b": DecoderConfig(
        model_type="qwen2", vocab_size=151936, n_ctx=32768, d_model=896, n_head=14, n_kv_head=2, n_layer=24, d_mlp=4864,
        eos_token_ids=(151645, 151643), bos_token_id=151643, rope_theta=1000000.0, layer_norm_eps=1e-6, qkv_bias=True,
    ),
    # Gemma-3-1B's published config (26 layers of 1,152, 4 query heads and 1 K/V head of 256, five sliding layers of 512
    # positions to a global one, two RoPE bases, tied 262,144-token head, 32,768-token context) with random weights.
    "gemma3-1b": DecoderConfig(
        model_type="gemma3_text", vocab_size=262144, n_ctx=32768, d_model=1152, n_head=4, n_kv_head=1, head_dim=256, n_layer=26, d_mlp=6912,
        eos_token_ids=(1, 106), bos_token_id=2, rope_theta=1000000.0, layer_norm_eps=1e-6, qk_norm=True, sliding_window=512,
        sliding_layers=tuple(i for i in range(26) if (i + 1) % 6), hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0, embed_scale=True,
        sandwich_norms=True, query_pre_attn_scalar=256.0, local_rope_theta=10000.0,
    ),
    # Phi-4-mini's layer shape (3,072 wide, 24 query and 8 K/V heads of 128, 96 of each head's channels turned, tied
    # 200,064-token head) with 6 of its 32 layers, so that float32 export fits 24 GiB; plain RoPE at its original
    # 4,096-token context (its longrope stretches that to 131,072: not in the preset), random weights.
    "phi4-mini-6l": DecoderConfig(
        model_type="phi3", vocab_size=200064, n_ctx=4096, d_model=3072, n_head=24, n_kv_head=8, n_layer=6, d_mlp=8192,
        eos_token_ids=(200020, 199999), bos_token_id=199999, layer_norm_eps=1e-5, partial_rotary_factor=0.75,
    ),
}


def preset(name: str) -> DecoderConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}") from None
