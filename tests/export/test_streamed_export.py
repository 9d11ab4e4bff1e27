"""Export that streams the weights (onnx_export.trace_streamed, export/weight_plan.py): the graph traced from a skeleton and
every weight written from its source a block at a time, against the graph traced from the whole model in memory and
quantized by onnxruntime's own MatMulNBitsQuantizer (trace_graph, quantize_model without a plan): the same model.onnx
and model.onnx.data, byte for byte, for every family and precision, the external-data layout included."""

from __future__ import annotations

import filecmp
from dataclasses import replace

import pytest

from kvserve.contract import io_contract as io
from kvserve.contract.config import DecoderConfig
from kvserve.export import onnx_export
from kvserve.export.graph_fusions import fuse_operators
from kvserve.export.onnx_export import fused_attention_refusal, save_graph, trace_graph, trace_streamed
from kvserve.export.quantize import quantize_model
from kvserve.export.weight_plan import initializers, is_pending
from kvserve.model.decoders import build
from kvserve.model.presets import preset
from kvserve.model.weights import ModelWeights

TINY_LLAMA = preset("tiny-llama")
# One small config per family, each with what changes the graph or its weights: biases, per-head norms, an untied head
# (its embedding quantized on its own), Gemma's offset norms and sliding layers, Phi-3's partial rotation.
FAMILIES = {
    "gpt2": preset("tiny"),
    "llama": TINY_LLAMA,
    "qwen2 biases": replace(TINY_LLAMA, model_type="qwen2", qkv_bias=True),
    "qwen3 untied": replace(TINY_LLAMA, model_type="qwen3", qk_norm=True, head_dim=32, tie_word_embeddings=False),
    "gemma3 sliding": replace(TINY_LLAMA, model_type="gemma3_text", qk_norm=True, head_dim=32, hidden_act="gelu_pytorch_tanh",
                              norm_weight_offset=1.0, embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=32.0,
                              sliding_window=8, sliding_layers=(0,), local_rope_theta=10000.0),
    "phi3 partial rotary": replace(TINY_LLAMA, model_type="phi3", head_dim=32, partial_rotary_factor=0.5),
}
PRECISIONS = {"float32": ("float32", None), "int4": ("float32", "int4")}
MORE = [("llama", "float16", None), ("gpt2", "float32", "int8"), ("qwen3 untied", "float32", "int8")]
CASES = [(family, *PRECISIONS[p]) for family in FAMILIES for p in PRECISIONS] + MORE


def _export_both(tmp_path, config: DecoderConfig, dtype: str, scheme: str | None, attention: str):
    model = build(config, seed=3)
    whole, _ = trace_graph(model, dtype, io.SLOTS, attention)
    streamed, _, plan = trace_streamed(ModelWeights(model), dtype, io.SLOTS, attention)
    assert any(is_pending(t) for t in initializers(streamed.graph)), "the streamed graph holds its weights"
    if dtype == "float32":
        assert fuse_operators(whole) == fuse_operators(streamed)
    if scheme is not None:
        whole, whole_facts = quantize_model(whole, scheme)
        streamed, streamed_facts = quantize_model(streamed, scheme, plan=plan)
        assert whole_facts == streamed_facts
    (tmp_path / "whole").mkdir()
    (tmp_path / "streamed").mkdir()
    save_graph(whole, tmp_path / "whole")
    save_graph(streamed, tmp_path / "streamed", plan)
    return sorted(p.name for p in (tmp_path / "whole").iterdir())


@pytest.mark.parametrize("family,dtype,scheme", CASES, ids=[f"{f}-{d}-{s or 'float'}" for f, d, s in CASES])
def test_streamed_artifact_is_the_in_memory_one_byte_for_byte(tmp_path, monkeypatch, family, dtype, scheme):
    config = FAMILIES[family]
    attention = io.STANDARD if fused_attention_refusal(build(config), io.SLOTS) else io.FUSED
    # Every weight through the external-data writer, as a large model's are (a tiny one's would stay inline).
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)
    files = _export_both(tmp_path, config, dtype, scheme, attention)
    assert files == ["model.onnx", "model.onnx.data"]
    for name in files:
        assert filecmp.cmp(tmp_path / "whole" / name, tmp_path / "streamed" / name, shallow=False), f"{name} differs"


def test_standard_attention_and_inline_weights_match_too(tmp_path):
    """The other attention, and a small graph's weights kept inline (no external file)."""
    files = _export_both(tmp_path, FAMILIES["qwen2 biases"], "float32", "int4", io.STANDARD)
    assert files == ["model.onnx"]
    assert filecmp.cmp(tmp_path / "whole" / "model.onnx", tmp_path / "streamed" / "model.onnx", shallow=False)
