"""Llama-family artifacts: exported from transformers checkpoints, K/V shaped by the K/V heads, verified, and
generating exactly what transformers' generate does (a row per prompt in the slots layout, a left-padded batch
in the concat layout)."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from kvserve.contract.artifact import ArtifactError, open_artifact
from kvserve.export.parity import artifact_greedy
from tests.conftest import LLAMA_CONFIGS, PROVIDER
from tests.hf_reference import hf_greedy

PROMPTS = [[5, 17, 42], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [250], [11, 12, 13, 14, 15, 16]]
STEPS = 36


@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_exported_artifact_generates_what_transformers_generates(llama_artifact, name):
    hf, _, artifact_dir = llama_artifact(name)
    artifact = open_artifact(artifact_dir)
    config = hf.config
    assert artifact.architecture == "llama" and artifact.manifest["model_type"] == config.model_type
    assert artifact.manifest["kv_heads"] == config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert artifact.manifest["inputs"]["past_key_values.0.key"]["shape"] == ["batch_size", config.num_key_value_heads, "cache_capacity", head_dim]
    assert artifact.parity_report()["passed"]
    expected = hf_greedy(hf, PROMPTS, STEPS)
    assert len(set(expected[1].tolist())) > 4  # a continuation that depends on its context
    np.testing.assert_array_equal(artifact_greedy(artifact_dir, PROMPTS, STEPS, PROVIDER), expected)


NEW_FAMILIES = [name for name in LLAMA_CONFIGS if name.startswith(("qwen3", "gemma", "phi3", "smollm3", "mistral sliding", "qwen2 sliding"))]


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_standard_attention_generates_what_transformers_generates(llama_artifact, name):
    """The standard graph (ONNX operators, masks for the sliding layers) of each family the fused test above runs fused.
    A windowed layer's rows are rings of the window and 16 positions (the sequences here run past them); the whole
    context's layers keep their columns."""
    hf, _, artifact_dir = llama_artifact(name, attention="standard")
    artifact = open_artifact(artifact_dir)
    assert artifact.manifest["attention"] == "standard"
    window, inputs = artifact.config.sliding_window, artifact.manifest["inputs"]
    assert artifact.kv_ring == (None if window is None else window + 16)
    for layer in range(artifact.config.n_layer):
        ring = artifact.kv_ring is not None and layer in artifact.config.sliding_layers
        assert inputs[f"past_key_values.{layer}.key"]["shape"][2] == (artifact.kv_ring + 1 if ring else "cache_capacity")
    np.testing.assert_array_equal(artifact_greedy(artifact_dir, PROMPTS, STEPS, PROVIDER), hf_greedy(hf, PROMPTS, STEPS))


@pytest.mark.parametrize("name", ["llama gqa 4:1 head_dim 24 untied", "qwen2 gqa 3:1 qkv-bias tied", "gemma2 gqa 2:1 head_dim 16 softcaps sliding 5",
                                  "smollm3 gqa 2:1 head_dim 16 nope every 2nd sliding 5 tied"])
def test_concat_artifact_on_a_padded_batch_generates_what_transformers_generates(llama_artifact, name):
    hf, _, artifact_dir = llama_artifact(name, kv_cache="concat")
    assert open_artifact(artifact_dir).manifest["outputs"]["present.0.key"]["shape"][1] == hf.config.num_key_value_heads
    np.testing.assert_array_equal(artifact_greedy(artifact_dir, PROMPTS, STEPS, PROVIDER), hf_greedy(hf, PROMPTS, STEPS))


def test_a_float16_artifact_passes_parity_per_kv_head(llama_artifact):
    name = "llama gqa 2:1 llama3-rope tied"
    hf, _, half = llama_artifact(name, dtype="float16")
    report = open_artifact(half).parity_report()
    assert report["passed"] and report["dtype"] == "float16"
    assert len(report["kv_max_abs_per_layer_head"][0]) == hf.config.num_key_value_heads  # divergence per K/V head


def test_verify_names_the_kv_head_a_broken_key_projection_breaks(llama_artifact, tmp_path):
    """Zero the K rows of layer 1's second K/V head in the eager reference: verify fails naming layer 1, K/V head 1."""
    from kvserve.export.parity import verify
    from kvserve.model.checkpoint import load_checkpoint

    name = "llama gqa 4:1 head_dim 24 untied"
    _, checkpoint, artifact_dir = llama_artifact(name)
    reference = load_checkpoint(checkpoint)
    config = reference.config
    k_rows = slice(config.n_head * config.head_dim + config.head_dim, config.n_head * config.head_dim + 2 * config.head_dim)
    with torch.no_grad():
        reference.model.layers[1].self_attn.qkv_proj.weight[k_rows] = 0
    report = verify(artifact_dir, reference, provider=PROVIDER)
    assert not report.passed
    assert report.first_failing_layer_head.layer == 1 and report.first_failing_layer_head.head == 1


def test_an_artifact_whose_manifest_disagrees_with_its_config_is_refused(llama_artifact, tmp_path):
    import shutil

    _, _, artifact_dir = llama_artifact("qwen2 gqa 3:1 qkv-bias tied")
    copy = tmp_path / "copy"
    shutil.copytree(artifact_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["architecture"] = "gpt2"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="architecture 'gpt2'"):
        open_artifact(copy, check_files=False)


def graph_ops(artifact_dir, branch: str | None = None) -> Counter:
    """The graph's operators; with branch ("then_branch" / "else_branch"), those inside every If's branch of that name."""
    nodes = onnx.load(str(Path(artifact_dir) / "model.onnx"), load_external_data=False).graph.node
    if branch is None:
        return Counter(n.op_type for n in nodes)
    return Counter(inner.op_type for n in nodes for a in n.attribute if a.name == branch for inner in a.g.node)


def test_auto_attention_is_fused_where_group_query_attention_runs(llama_artifact):
    """head_dim 16: each layer's attention an If, a GroupQueryAttention on the rows and one on the chunk with a chunk,
    the rows' alone without; no masks, scatter or gather. head_dim 24 (ONNX Runtime's kernel wants multiples of 16):
    the standard ops."""
    name = "qwen2 gqa 3:1 qkv-bias tied"
    _, _, fused = llama_artifact(name)
    artifact = open_artifact(fused)
    assert artifact.attention == "fused" and artifact.parity_report()["passed"]
    ops, layers = graph_ops(fused), LLAMA_CONFIGS[name][1]["num_hidden_layers"]
    assert ops["If"] == layers and not ops["GroupQueryAttention"]
    assert graph_ops(fused, "then_branch")["GroupQueryAttention"] == 2 * layers
    assert graph_ops(fused, "else_branch")["GroupQueryAttention"] == layers
    assert not ops["ScatterND"] and not ops["GatherND"] and not ops["Softmax"]
    inputs = artifact.manifest["inputs"]
    assert inputs["input_ids"]["shape"] == ["batch_size", "sequence_length"] and "attention_mask" not in inputs
    assert inputs["chunk_key_values.0.key"]["shape"] == [1, 2, "cache_capacity", 16]
    _, _, standard = llama_artifact("llama gqa 4:1 head_dim 24 untied")
    assert open_artifact(standard).attention == "standard" and not graph_ops(standard)["GroupQueryAttention"]


def test_fused_and_standard_attention_generate_the_same_tokens(llama_artifact):
    name = "mistral gqa 2:1 head_dim 32 untied"
    hf, _, fused = llama_artifact(name)
    _, _, standard = llama_artifact(name, attention="standard")
    assert (open_artifact(fused).attention, open_artifact(standard).attention) == ("fused", "standard")
    expected = hf_greedy(hf, PROMPTS, STEPS)
    np.testing.assert_array_equal(artifact_greedy(standard, PROMPTS, STEPS, PROVIDER), expected)
    np.testing.assert_array_equal(artifact_greedy(fused, PROMPTS, STEPS, PROVIDER), expected)


def test_fused_attention_is_refused_by_name_where_it_cannot_run(llama_artifact, tiny_llama_model, tmp_path):
    from kvserve.export.pipeline import ExportError, export_artifact
    from kvserve.model.checkpoint import load_checkpoint

    _, checkpoint, _ = llama_artifact("llama gqa 4:1 head_dim 24 untied")
    cases = [
        (load_checkpoint(checkpoint), {}, "needs head_dim a multiple of 16 (ONNX Runtime's GroupQueryAttention); this model's is 24"),
        (tiny_llama_model, {"kv_cache": "concat"}, "a slots KV cache graph (got --kv-cache concat)"),
    ]
    for model, options, message in cases:
        with pytest.raises(ExportError, match=re.escape(message)):
            export_artifact(model, {"kind": "test"}, tmp_path / "out", provider=PROVIDER, attention="fused", **options)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_auto_attention_keeps_float32_standard_where_it_would_verify_on_cuda(tiny_llama_model, monkeypatch):
    """ONNX Runtime's CUDA GroupQueryAttention is float16 only: exported on a CUDA machine, a float32 graph stays standard."""
    from kvserve.export import pipeline

    assert pipeline.choose_attention(tiny_llama_model, "slots", "float32", "auto") == "fused"  # no GPU here
    monkeypatch.setattr(pipeline, "cuda_available", lambda: True)
    assert pipeline.choose_attention(tiny_llama_model, "slots", "float32", "auto") == "standard"
    assert pipeline.choose_attention(tiny_llama_model, "slots", "float32", "cpu") == "fused"
    assert pipeline.choose_attention(tiny_llama_model, "slots", "float16", "auto") == "fused"
    assert pipeline.choose_attention(tiny_llama_model, "concat", "float16", "auto") == "standard"


LONGROPE = [name for name in LLAMA_CONFIGS if "longrope" in name]


@pytest.mark.parametrize("name", LONGROPE)
@pytest.mark.parametrize("export", [{}, {"attention": "standard"}, {"kv_cache": "concat"}], ids=["fused", "standard", "concat"])
def test_a_longrope_artifact_generates_what_transformers_generates_past_its_original_context(llama_artifact, export, name):
    """LongRoPE's two sets of factors: a prompt that crosses the original context while it generates (Phi-3's row
    prefilled again, long; another model's turning long from there), one past it from the start, one within; verify
    checked the long factors at export."""
    hf, _, artifact_dir = llama_artifact(name, **export)
    artifact = open_artifact(artifact_dir)
    after = artifact.config.long_rope_after
    assert artifact.config.n_ctx == hf.config.max_position_embeddings > after  # the whole context, not the original one
    checks = {check["name"]: check for check in artifact.parity_report()["checks"]}
    long_checks = [check for name, check in checks.items() if name.startswith("long rope")]
    assert len(long_checks) == 1 and long_checks[0]["passed"]
    prompts = [[(7 * j) % 290 + 3 for j in range(after - 5)], [(3 * j) % 290 + 5 for j in range(after + 6)], [5, 17, 42]]
    np.testing.assert_array_equal(artifact_greedy(artifact_dir, prompts, 24, PROVIDER), hf_greedy(hf, prompts, 24))
