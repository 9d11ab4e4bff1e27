"""How the KV cache stores what attention computes: the eager definition of an artifact's K/V dtype
(io_contract.KV_DTYPES), so the exported graph and the eager reference round K and V the same way.

  float32 / float16   K and V rounded to that float type as they are written (the model's own dtype: no rounding)
  int8                K and V divided by a scale per (layer, K/V head, channel), rounded half to even and clipped to
                      [-128, 127] as they are written; read back as the integer times its scale. This is what ONNX
                      Runtime 1.31's GroupQueryAttention does with an int8 cache and per-channel k_scale / v_scale
                      (kv_cache_bit_width 8), and what the standard graph spells in plain operators.

A layer's new K/V is stored before its own query reads it, so a token attends to its own key as stored, as the
operator does. The concat path (the eager reference that parity compares against) keeps float K/V that hold exactly
the stored values; the slots paths keep the stored dtype itself, as the pool does.
"""

from __future__ import annotations

import contextlib

import torch

INT8_MIN, INT8_MAX = -128, 127
STORED_TYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


class LayerKvStore(torch.nn.Module):
    """One layer's K/V storage. Its scales are buffers left out of the state dict (not weights: the checksum of a
    model's weights does not change with its cache's dtype), so the exporter makes them graph initializers."""

    def __init__(self, dtype: str, key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None):
        """key_scale, value_scale: (H_kv, d_k) float32, int8 only."""
        super().__init__()
        self.dtype = dtype
        self.stored = STORED_TYPES[dtype]
        if dtype == "int8":
            self.register_buffer("key_scale", key_scale.float()[None, :, None, :].contiguous(), persistent=False)  # (1, H_kv, 1, d_k)
            self.register_buffer("value_scale", value_scale.float()[None, :, None, :].contiguous(), persistent=False)
        else:
            self.key_scale = self.value_scale = None

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New k and v (B, H_kv, T, d_k) as they read back once stored, in their own dtype."""
        return (read_back(store_as(k, self.stored, self.key_scale), self.key_scale, k.dtype),
                read_back(store_as(v, self.stored, self.value_scale), self.value_scale, v.dtype))


def kv_stores(model) -> list:
    """Every layer's attention module, in layer order: where a LayerKvStore is attached (attribute kv_store)."""
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return [block.attn if hasattr(block, "attn") else block.self_attn for block in layers]


def store_kv_as(model, dtype: str | None, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None):
    """Make model's cache store K/V as dtype (int8: with key_scales and value_scales, each (L, H_kv, d_k)); None stores
    them as computed (what an artifact whose K/V dtype is its model's own declares). Returns model."""
    for layer, attention in enumerate(kv_stores(model)):
        if dtype is None:
            attention.kv_store = None
        elif dtype == "int8":
            attention.kv_store = LayerKvStore(dtype, key_scales[layer], value_scales[layer])
        else:
            attention.kv_store = LayerKvStore(dtype)
    return model


@contextlib.contextmanager
def kv_stored_as(model, dtype: str | None, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None):
    """store_kv_as for the duration of a with block; the stores model had before come back after it."""
    before = [attention.kv_store for attention in kv_stores(model)]
    store_kv_as(model, dtype, key_scales, value_scales)
    try:
        yield model
    finally:
        for attention, store in zip(kv_stores(model), before):
            attention.kv_store = store


def stored_dtype(model) -> torch.dtype | None:
    """The torch dtype model's cache stores K/V in, None when K/V are kept as computed."""
    store = kv_stores(model)[0].kv_store
    return None if store is None else store.stored


def store_as(x: torch.Tensor, stored: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x as a cache of dtype stored keeps it: rounded to a float type, or int8 with scale (broadcast against x)."""
    if stored != torch.int8:
        return x.to(stored)
    return torch.round(x.float() / scale).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def read_back(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V as attention reads it, in dtype."""
    return stored.to(dtype) if scale is None else (stored.float() * scale).to(dtype)
