"""`kvserve export --kv-dtype`: a slots graph whose K/V pool holds float16 or int8 (model/kv_storage.py), for fused and
standard attention, verified against the eager model storing K/V the same way; int8's scales calibrated, kept in the
artifact, and held to by verify layer by layer."""

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import KV_SCALES_FILE, ArtifactError, open_artifact, sha256_file
from kvserve.contract.tolerances import KV_TOLERANCES
from kvserve.export.parity import verify
from kvserve.export.pipeline import ExportError, export_artifact, reference_for
from kvserve.runtime import DecoderRuntime

from ..conftest import PROVIDER, run_cli

CASES = [("tiny", "fused", "float16"), ("tiny", "fused", "int8"), ("tiny", "standard", "float16"), ("tiny-llama", "fused", "int8"),
         ("tiny-llama", "standard", "int8"), ("tiny-llama", "fused", "float16")]


@pytest.mark.parametrize("name, attention, kv_dtype", CASES)
def test_the_pool_holds_the_kv_dtype_and_verify_holds_the_graph_to_the_eager_model_storing_it_so(kv_dtype_artifacts, name, attention,
                                                                                                   kv_dtype):
    directory = kv_dtype_artifacts(name, attention, kv_dtype)
    artifact = open_artifact(directory)
    assert (artifact.kv_dtype, artifact.attention, artifact.dtype) == (kv_dtype, attention, "float32")
    assert artifact.tolerance == KV_TOLERANCES[kv_dtype]
    for side, names in (("inputs", io.past_names(0)), ("outputs", io.present_names(0))):
        assert all(artifact.manifest[side][n]["dtype"] == kv_dtype for n in names)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER)
    assert np.dtype(runtime.kv_dtype) == np.dtype(kv_dtype)
    report = json.loads((directory / "parity.json").read_text())
    assert report["failures"] == [] and report["kv_dtype"] == kv_dtype
    if kv_dtype == "int8":  # held to float K/V on real text too: what the rounding costs
        assert report["text"] is not None and report["text"]["passed"]
        key, value = artifact.kv_scales()
        config = artifact.config
        assert key.shape == value.shape == (config.n_layer, config.n_kv_head, config.head_dim) and (key > 0).all() and (value > 0).all()
        assert artifact.manifest["kv_quantization"]["calibration"].startswith("random ids")  # a preset's random weights learned no text
    else:
        assert artifact.kv_scales() is None and report["text"] is None


def test_float16_kv_moves_the_logits_where_float32_kv_does_not(kv_dtype_artifacts, tiny_artifact):
    """The K/V dtype is real: the same weights' logits differ from float32 K/V's by about float16's rounding."""
    with_float16 = json.loads((kv_dtype_artifacts("tiny", "fused", "float16") / "parity.json").read_text())
    with_float32 = json.loads((tiny_artifact / "parity.json").read_text())
    worst = lambda report: max(c["kv_max_abs"] for c in report["checks"] if c["kv_max_abs"] is not None)  # noqa: E731
    assert worst(with_float32) < 1e-4 < worst(with_float16)


def _with_graph_edited(directory, copy, edit) -> None:
    """copy: directory with its graph edited by edit(model proto) and its manifest's checksum of the graph renewed."""
    shutil.copytree(directory, copy)
    model = onnx.load(str(copy / "model.onnx"))
    edit(model)
    onnx.save(model, str(copy / "model.onnx"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = sha256_file(copy / "model.onnx")
    (copy / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("attention", ["fused", "standard"])
def test_a_graph_whose_kv_scale_differs_from_the_recorded_one_fails_verify_naming_its_layer(kv_dtype_artifacts, tmp_path, attention):
    directory = kv_dtype_artifacts("tiny-llama", attention, "int8")
    last = open_artifact(directory).config.n_layer - 1

    def scale_down(model):  # the layer's K scale wherever the graph holds it (the exporter folds reshaped copies of it)
        (scale,) = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith(f"layers.{last}.self_attn.kv_store.key_scale")]
        copies = [t for t in model.graph.initializer if numpy_helper.to_array(t).size == scale.size
                  and np.array_equal(numpy_helper.to_array(t).reshape(-1), scale.reshape(-1))]
        for copy in copies:
            copy.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(copy) * 0.25, copy.name))  # 3/4 of the range clipped

    _with_graph_edited(directory, tmp_path / "copy", scale_down)
    report = verify(tmp_path / "copy", reference_for(directory), provider=PROVIDER)
    assert not report.passed
    assert report.first_failing_layer_head is not None and report.first_failing_layer_head.layer == last
    assert report.first_failing_layer_head.max_abs > 3 * report.tolerance.kv_max_abs  # far outside, not a near miss
    assert f"present K/V first breaks tolerance at layer {last}" in "; ".join(report.failures)


def test_an_int8_artifact_without_its_scales_is_refused_naming_the_file(kv_dtype_artifacts, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(kv_dtype_artifacts("tiny", "fused", "int8"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"][KV_SCALES_FILE]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"an int8 K/V cache needs its scales, and 'files' lacks {KV_SCALES_FILE}"):
        open_artifact(copy)


@pytest.mark.parametrize("args, message", [
    (["--kv-dtype", "int8", "--kv-cache", "concat"], "--kv-dtype int8: a concat graph keeps K/V in the model's dtype"),
    (["--kv-dtype", "int8", "--dtype", "float16"], "--kv-dtype int8 rounds a float32 model's K/V; with --dtype float16 they are float16 already"),
    (["--kv-dtype", "int4"], "argument --kv-dtype: invalid choice: 'int4'"),
    (["--kv-dtype", "float32", "--dtype", "float16"], "--kv-dtype float32: a float16 graph computes its K/V in float16; drop --kv-dtype"),
])
def test_a_kv_dtype_that_cannot_be_is_refused_before_export_starts(tmp_path, args, message):
    result = run_cli("export", "--preset", "tiny", "--out", str(tmp_path / "out"), *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_export_leaves_the_callers_model_storing_kv_as_it_did(tmp_path, tiny_model):
    from kvserve.model.kv_storage import stored_dtype

    export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, tmp_path / "a", provider=PROVIDER, kv_dtype="float16")
    assert stored_dtype(tiny_model) is None
    with pytest.raises(ExportError, match="a concat graph keeps K/V"):
        export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, tmp_path / "b", provider=PROVIDER, kv_dtype="int8",
                        kv_cache="concat")


def test_the_trained_model_with_int8_kv_keeps_its_perplexity_on_held_out_text(tmp_path, trained_model):
    """Scales calibrated on held-out text (chapters verify's text check does not read); the text check holds the
    artifact to the float K/V model: perplexity within 1%, and here within a tenth of that."""
    from ..conftest import DEFAULT_CHECKPOINT

    report = export_artifact(trained_model, {"kind": "checkpoint", "path": str(DEFAULT_CHECKPOINT)}, tmp_path / "kjv", provider=PROVIDER,
                             tokenizer_dir=DEFAULT_CHECKPOINT, kv_dtype="int8")
    artifact = open_artifact(tmp_path / "kjv")
    assert artifact.manifest["kv_quantization"]["calibration"].startswith("held-out text")
    assert report.passed and report.text["learned"]
    assert report.text["perplexity_ratio"] <= 1.001 and report.text["top1_agreement"] >= 0.95


def test_scales_that_clip_fail_the_text_check_against_float_kv(tmp_path, trained_model, monkeypatch):
    """Graph and reference agree on scales a tenth of what calibration found (every check against the eager model storing
    K/V so passes), and the held-out text, read against float K/V, refuses them: nothing is written."""
    from kvserve.export import pipeline
    from kvserve.export.pipeline import ParityFailed

    from ..conftest import DEFAULT_CHECKPOINT

    calibrate = pipeline.calibrate_int8_scales
    monkeypatch.setattr(pipeline, "calibrate_int8_scales", lambda model, windows: tuple(s / 10 for s in calibrate(model, windows)))
    with pytest.raises(ParityFailed, match="held-out text: outside float32 weights, int8 K/V tolerance") as failed:
        export_artifact(trained_model, {"kind": "checkpoint", "path": str(DEFAULT_CHECKPOINT)}, tmp_path / "kjv", provider=PROVIDER,
                        tokenizer_dir=DEFAULT_CHECKPOINT, kv_dtype="int8")
    assert "prefill" not in str(failed.value).split("result: FAIL")[1]  # the graph matched its reference: only the text failed
    assert not (tmp_path / "kjv").exists()


def test_auto_attention_keeps_a_float16_cache_in_the_standard_graph(tiny_llama_model):
    """ONNX Runtime 1.31's CPU GroupQueryAttention reads a float16 cache at a fifth of the standard graph's speed
    (bench/results/cpu-2core.md): "auto" picks standard for it, fused for int8 K/V; asked for, fused is built."""
    from kvserve.export.pipeline import choose_attention

    assert choose_attention(tiny_llama_model, "slots", "float32", "cpu", "auto", "float16") == "standard"
    assert choose_attention(tiny_llama_model, "slots", "float32", "cpu", "auto", "int8") == "fused"
    assert choose_attention(tiny_llama_model, "slots", "float32", "cpu", "fused", "float16") == "fused"
    assert choose_attention(tiny_llama_model, "slots", "float16", "cpu", "auto", "float16") == "fused"
