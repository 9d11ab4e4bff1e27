"""The exported artifact: files, manifest, graph contract, ONNX checker, IR version, and export's errors."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import open_artifact
from kvserve.export.fused_graph import fused_write_problems
from kvserve.export.onnx_export import IR_VERSION, inplace_write_problems
from kvserve.export.parity import format_report, verify
from kvserve.export.pipeline import reference_for
from kvserve.runtime.providers import session_options

from ..conftest import PROVIDER, run_cli


def test_artifact_holds_every_file_and_a_consistent_manifest(tiny_concat_artifact):
    names = {p.name for p in tiny_concat_artifact.iterdir()}
    assert {"model.onnx", "config.json", "manifest.json", "golden.npz", "parity.json"} <= names
    artifact = open_artifact(tiny_concat_artifact)  # checks every recorded checksum
    manifest = artifact.manifest
    config = artifact.config
    assert manifest["ir_version"] == IR_VERSION and manifest["opset"] >= 17
    assert list(manifest["inputs"]) == io.input_names(config.n_layer)
    assert list(manifest["outputs"]) == io.output_names(config.n_layer)
    assert manifest["inputs"]["past_key_values.0.key"]["shape"] == [io.BATCH, config.n_head, io.PAST, config.d_head]
    assert manifest["outputs"]["present.1.value"]["shape"] == [io.BATCH, config.n_head, io.TOTAL, config.d_head]
    assert manifest["source"] == {"kind": "preset", "name": "tiny", "seed": 0}
    assert json.loads((tiny_concat_artifact / "parity.json").read_text())["passed"] is True


@pytest.mark.parametrize("layout", ["tiny_artifact", "tiny_concat_artifact"])
def test_graph_has_contract_names_symbolic_axes_and_passes_the_full_checker(layout, request):
    artifact_dir = request.getfixturevalue(layout)
    onnx.checker.check_model(str(artifact_dir / "model.onnx"), full_check=True)
    model = onnx.load(str(artifact_dir / "model.onnx"))
    assert model.ir_version == IR_VERSION
    manifest = open_artifact(artifact_dir).manifest
    for values, spec in ((model.graph.input, manifest["inputs"]), (model.graph.output, manifest["outputs"])):
        assert [v.name for v in values] == list(spec)
        for value in values:
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            assert dims == spec[value.name]["shape"]


def test_one_graph_runs_prefill_with_a_zero_length_past_and_then_decode(tiny_concat_artifact, tiny_model):
    config = tiny_model.config
    session = ort.InferenceSession(str(tiny_concat_artifact / "model.onnx"), session_options(), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, config.n_head, 0, config.d_head), np.float32)
    feed = {io.INPUT_IDS: np.array([[5, 6, 7]]), io.ATTENTION_MASK: np.ones((1, 3), np.int64), io.POSITION_IDS: np.array([[0, 1, 2]])}
    feed.update({n: empty for i in range(config.n_layer) for n in io.past_names(i)})
    logits, *present = session.run(None, feed)
    assert logits.shape == (1, 3, config.vocab_size)
    assert present[0].shape == (1, config.n_head, 3, config.d_head)
    feed = {io.INPUT_IDS: np.array([[int(logits[0, -1].argmax())]]), io.ATTENTION_MASK: np.ones((1, 4), np.int64), io.POSITION_IDS: np.array([[3]])}
    feed.update(dict(zip([n for i in range(config.n_layer) for n in io.past_names(i)], present)))
    logits, *present = session.run(None, feed)
    assert logits.shape == (1, 1, config.vocab_size) and present[0].shape == (1, config.n_head, 4, config.d_head)


def test_float16_export_passes_with_float16_tolerances(tmp_path, tiny_model):
    from kvserve.export.pipeline import export_artifact

    report = export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, tmp_path / "fp16", dtype="float16", provider="cpu")
    assert report.passed and report.dtype == "float16"
    assert report.tolerance.logits_relative and report.tolerance.kv_relative  # float16's tolerance, not float32's
    # fused float16: its decode graph, held to the eager model too (fixed-shape steps, and a small model's one-row steps)
    assert {"decode graph 8 steps B=2", "decode graph, one row: prefill T=13, 8 steps"} <= {check.name for check in report.checks}
    for check in report.checks:
        if not check.name.endswith("cached vs full recompute"):  # that one compares the artifact with itself (split steps too)
            assert 0 < check.max_abs_logits <= report.tolerance.logits_max_abs * check.max_abs_eager_logit
    manifest = open_artifact(tmp_path / "fp16").manifest
    assert manifest["inputs"]["past_key_values.0.key"]["dtype"] == "float16"
    assert manifest["outputs"]["logits"]["dtype"] == "float32"


def _small_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "in": 1, "the": 2, "beginning": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_export_cli_from_a_transformers_checkpoint_copies_the_tokenizer(tmp_path, make_hf_checkpoint):
    _, checkpoint = make_hf_checkpoint(vocab_size=200, n_positions=64, n_embd=32, n_head=2, n_layer=1)
    _small_tokenizer().save(str(checkpoint / "tokenizer.json"))
    result = run_cli("export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "a"), "--provider", "cpu")
    assert result.returncode == 0, result.stderr
    assert "result: PASS" in result.stdout
    assert (tmp_path / "a" / "tokenizer.json").exists()
    assert open_artifact(tmp_path / "a").manifest["source"]["kind"] == "checkpoint"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "{missing}"], "checkpoint directory not found"),
        (["--checkpoint", "{broken}"], "missing tensor(s)"),
        (["--preset", "gpt5"], "unknown preset 'gpt5'"),
        # both were copied into an artifact the server then refused with a traceback
        (["--checkpoint", "{untokenizable}"], "untokenizable/tokenizer.json: not a tokenizer.json the tokenizers library reads"),
        (["--checkpoint", "{untemplated}"], "untemplated/chat_template.jinja: its chat template does not compile (line 1:"),
    ],
    ids=["no such dir", "missing tensor", "unknown preset", "unreadable tokenizer", "template that does not compile"],
)
def test_export_errors_are_one_line_with_no_partial_artifact(tmp_path, tiny_model, args, message):
    from safetensors.torch import load_file, save_file

    from kvserve.model.checkpoint import save_checkpoint

    broken = tmp_path / "broken"
    save_checkpoint(tiny_model, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["transformer.wpe.weight"]
    save_file(tensors, broken / "model.safetensors")
    untokenizable, untemplated = tmp_path / "untokenizable", tmp_path / "untemplated"
    for directory in (untokenizable, untemplated):
        save_checkpoint(tiny_model, directory)
    (untokenizable / "tokenizer.json").write_text("{}")
    (untemplated / "chat_template.jinja").write_text("{% for message in %}{{ message }}")
    args = [a.format(missing=tmp_path / "nope", broken=broken, untokenizable=untokenizable, untemplated=untemplated) for a in args]
    out = tmp_path / "out" / "artifact"
    result = run_cli("export", *args, "--out", str(out))
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not out.exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_export_refuses_to_clobber_without_overwrite(tiny_artifact):
    before = (tiny_artifact / "manifest.json").read_bytes()
    result = run_cli("export", "--preset", "tiny", "--out", str(tiny_artifact))
    assert result.returncode == 2 and "already exists; pass --overwrite" in result.stderr
    assert (tiny_artifact / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("kind", ["directory", "file", "older artifact"])
def test_overwrite_replaces_artifacts_alone(kind, tmp_path, tiny_model):
    """--overwrite on a directory of other things (`--out ~`, say) or a file is refused before anything is touched, by
    the CLI and by export_artifact alike; an artifact of another kvserve format is replaced, as an empty directory is."""
    from kvserve.export.pipeline import ExportError, export_artifact

    out = tmp_path / "out"
    if kind == "file":
        out.write_text("someone's notes")
    else:
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"format": "kvserve-artifact/1"}) if kind == "older artifact" else "{}")
        (out / "notes.txt").write_text("someone's notes")
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else out.read_text()
    source = {"kind": "preset", "name": "tiny", "seed": 0}
    if kind == "older artifact":
        export_artifact(tiny_model, source, out, provider="cpu", overwrite=True)
        assert (out / "model.onnx").is_file() and not (out / "notes.txt").exists()
        return
    result = run_cli("export", "--preset", "tiny", "--out", str(out), "--overwrite")
    assert result.returncode == 2 and "is not a kvserve artifact" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(ExportError, match="--overwrite replaces artifacts only"):
        export_artifact(tiny_model, source, out, provider="cpu", overwrite=True)
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else out.read_text()) == before


def test_export_failure_midway_leaves_nothing(tmp_path, tiny_model, monkeypatch):
    from kvserve.export import pipeline

    def explode(*args, **kwargs):
        raise RuntimeError("simulated crash after the graph was written")

    monkeypatch.setattr(pipeline, "record_golden", explode)
    with pytest.raises(RuntimeError):
        pipeline.export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, tmp_path / "x", provider="cpu")
    assert list(tmp_path.iterdir()) == []


def test_inplace_write_check_refuses_a_graph_that_reads_the_past_elsewhere():
    from onnx import TensorProto, helper

    kv = [1, 2, 8, 4]
    graph = helper.make_graph(
        [
            helper.make_node("ScatterND", ["past_key_values.0.key", "idx", "new"], ["present.0.key"]),
            helper.make_node("ReduceSum", ["past_key_values.0.key"], ["total"]),  # a reader of the old values
            helper.make_node("Concat", ["past_key_values.0.value", "new"], ["present.0.value"], axis=2),
        ],
        "bad",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv) for n in ("past_key_values.0.key", "past_key_values.0.value")]
        + [helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 2, 1, 3]), helper.make_tensor_value_info("new", TensorProto.FLOAT, [1, 2, 1, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("present.0.key", "present.0.value", "total")],
    )
    problems = inplace_write_problems(graph, 1)
    assert problems == ["past_key_values.0.key is also read by ReduceSum, not before the write",
                        "present.0.value is not a ScatterND into past_key_values.0.value"]


def test_inplace_write_check_lets_a_read_that_the_write_depends_on_pass_and_follows_reshapes():
    """A ring layer's chunk reads its row before the write (model/attention.py ring_attention): allowed when the write's
    inputs are computed from what was read; a reshape of past read later is still past read later."""
    from onnx import TensorProto, helper

    kv = [1, 2, 8, 4]

    def graph(ordered: bool):
        zero = [helper.make_node("ReduceSum", ["flat"], ["total"], keepdims=0), helper.make_node("Cast", ["total"], ["zero"], to=TensorProto.INT64),
                helper.make_node("Mul", ["zero", "none"], ["nil"]), helper.make_node("Add", ["idx", "nil"], ["after"])]
        return helper.make_graph(
            [helper.make_node("Reshape", ["past_key_values.0.key", "flat_shape"], ["flat"])] + (zero if ordered else [])
            + [helper.make_node("ScatterND", ["past_key_values.0.key", "after" if ordered else "idx", "new"], ["present.0.key"]),
               helper.make_node("ScatterND", ["past_key_values.0.value", "idx", "new"], ["present.0.value"])]
            + ([] if ordered else [helper.make_node("ReduceMax", ["flat"], ["late"])]),
            "ring",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv) for n in ("past_key_values.0.key", "past_key_values.0.value")]
            + [helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 2, 1, 3]), helper.make_tensor_value_info("new", TensorProto.FLOAT, [1, 2, 1, 4]),
               helper.make_tensor_value_info("flat_shape", TensorProto.INT64, [1]), helper.make_tensor_value_info("none", TensorProto.INT64, [])],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("present.0.key", "present.0.value")],
        )

    assert inplace_write_problems(graph(ordered=True), 1) == []
    assert inplace_write_problems(graph(ordered=False), 1) == ["past_key_values.0.key is also read by ReduceMax, not before the write"]


def test_export_cli_takes_the_kv_cache_layout_and_refuses_an_unknown_one(tmp_path):
    result = run_cli("export", "--preset", "tiny", "--out", str(tmp_path / "x"), "--kv-cache", "paged")
    assert result.returncode == 2 and "invalid choice: 'paged'" in result.stderr
    assert not (tmp_path / "x").exists()


def test_a_manifest_naming_an_unknown_kv_cache_layout_is_refused_in_one_line(tiny_concat_artifact, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_concat_artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["kv_cache"] = "paged"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("verify", str(copy), "--provider", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{copy / 'manifest.json'}: kv_cache 'paged' is not one of slots, concat" in result.stderr


def test_the_default_export_is_the_slots_layout_written_in_place(tiny_artifact, tiny_standard_artifact):
    artifact = open_artifact(tiny_artifact)
    config, manifest = artifact.config, artifact.manifest
    assert artifact.kv_cache == manifest["kv_cache"] == io.SLOTS == io.DEFAULT_KV_CACHE
    assert artifact.attention == io.FUSED  # GPT-2 with head_dim a multiple of 16: GroupQueryAttention
    assert list(manifest["inputs"]) == io.input_names(config.n_layer, io.SLOTS, io.FUSED)
    assert manifest["outputs"][io.LOGITS]["shape"] == [io.NUM_LOGITS, config.vocab_size]
    assert fused_write_problems(onnx.load(str(tiny_artifact / "model.onnx")).graph, config.n_layer) == []
    assert manifest["fused_operators"] == {"FastGelu": config.n_layer, "SkipLayerNormalization": 2 * config.n_layer - 1}
    report = json.loads((tiny_artifact / "parity.json").read_text())
    assert report["kv_cache"] == io.SLOTS and report["attention"] == io.FUSED and report["passed"] and report["greedy"]["identical"]
    # --attention standard: the ONNX-ops graph, its K/V written by one ScatterND a layer
    standard = open_artifact(tiny_standard_artifact).manifest
    assert list(standard["inputs"]) == io.input_names(config.n_layer, io.SLOTS)
    assert standard["inputs"][io.CHUNK_IDS]["shape"] == [1, io.CHUNK]
    kv_shape = [io.BATCH, config.n_head, io.CAPACITY, config.d_head]
    assert standard["inputs"]["past_key_values.0.key"]["shape"] == standard["outputs"]["present.0.key"]["shape"] == kv_shape
    assert inplace_write_problems(onnx.load(str(tiny_standard_artifact / "model.onnx")).graph, config.n_layer) == []


def test_a_slots_graph_outputs_each_sampled_rows_argmax_and_verify_holds_it_to_the_logits(tiny_artifact):
    artifact = open_artifact(tiny_artifact)
    assert list(artifact.manifest["outputs"])[:2] == [io.LOGITS, io.GREEDY_TOKENS]
    assert artifact.manifest["outputs"][io.GREEDY_TOKENS] == {"shape": [io.NUM_LOGITS], "dtype": "int64"}
    report = json.loads((tiny_artifact / "parity.json").read_text())
    argmax = report["greedy_tokens_argmax"]
    assert argmax["rows"] > 100 and argmax["mismatches"] == 0  # every row of every verify step, prefill chunks included
    again = verify(tiny_artifact, reference_for(tiny_artifact), provider=PROVIDER)  # verify is deterministic: the same rows
    assert f"greedy_tokens output vs its logits' argmax: {argmax['rows']} of {argmax['rows']} rows equal" in format_report(again)


def test_a_float16_export_the_cpu_cannot_verify_in_its_memory_is_refused_before_it_starts(tmp_path, tiny_model, monkeypatch):
    from kvserve.export import pipeline
    from kvserve.model.weights import ModelWeights, float32_bytes

    float16_bytes = float32_bytes(ModelWeights(tiny_model)) // 2
    # fused float16: the step graph's session and the decode graph's, each float32 copies beside the mapped file
    monkeypatch.setattr(pipeline, "memory_limit", lambda: 2 * pipeline.CPU_FLOAT16_SESSION_FACTOR * float16_bytes - 1)
    with pytest.raises(pipeline.ExportError, match=r"--dtype float16: verifying .* on the CPU takes about .*--quantize int8 or int4"):
        pipeline.export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, tmp_path / "fp16", dtype="float16", provider="cpu")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(pipeline, "memory_limit", lambda: 2 * pipeline.CPU_FLOAT16_SESSION_FACTOR * float16_bytes)
    assert pipeline.cpu_float16_refusal(tiny_model, "float16", "slots", "fused", "cpu") is None
    assert pipeline.cpu_float16_refusal(tiny_model, "float16", "slots", "standard", "cpu") is None  # one session: half
    assert pipeline.cpu_float16_refusal(tiny_model, "float32", "slots", "fused", "cpu") is None


def test_a_context_whose_rotary_tables_outgrow_the_memory_gets_the_standard_graph(tiny_llama_model, monkeypatch):
    """A config.json of 10^8 positions was killed for memory tracing the fused graph's tables of every position."""
    from kvserve.export import pipeline

    config = tiny_llama_model.config
    tables = 2 * (config.n_ctx + 1) * (config.rotary_dim // 2) * 4  # cos and sin, float32
    monkeypatch.setattr(pipeline, "memory_limit", lambda: pipeline.ROTARY_TABLES_SHARE * tables)
    assert pipeline.choose_attention(tiny_llama_model, "slots", "float32", "cpu") == "fused"
    monkeypatch.setattr(pipeline, "memory_limit", lambda: pipeline.ROTARY_TABLES_SHARE * tables - 1)
    assert pipeline.choose_attention(tiny_llama_model, "slots", "float32", "cpu") == "standard"
    with pytest.raises(pipeline.ExportError, match=rf"--attention fused: its context of {config.n_ctx:,} positions makes GroupQueryAttention's "
                                                   r"rotary tables .* --attention standard turns each step's positions alone"):
        pipeline.choose_attention(tiny_llama_model, "slots", "float32", "cpu", "fused")


def test_an_export_removes_the_staging_a_killed_export_left_and_keeps_a_live_ones(tmp_path, tiny_model):
    import subprocess
    import sys

    from kvserve.export import pipeline

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        abandoned = tmp_path / f".artifact.partial-{int(gone.stdout)}-x1y2"
        running = tmp_path / f".artifact.partial-{live.pid}-a1b2"
        unnamed = tmp_path / ".artifact.partial-q9w8e7"  # an older kvserve's: no process named
        other = tmp_path / f".other.partial-{int(gone.stdout)}-z9"
        for directory in (abandoned, running, unnamed, other):
            directory.mkdir()
            (directory / "model.onnx.data").write_bytes(b"\0" * 16)
        pipeline.export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, tmp_path / "artifact", provider="cpu")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["artifact", running.name, unnamed.name, other.name])
    finally:
        live.kill()
        live.wait()


def test_an_export_whose_graph_fails_a_step_in_its_verification_names_the_node_and_writes_nothing(tmp_path, tiny_model, monkeypatch):
    """ONNX Runtime failing a step of the new graph on the provider (as CUDA's ReduceSum refused a ring graph's empty sum)
    ends the export as a failed job in one line naming the node, under the artifact's name: no artifact, no staging."""
    from kvserve.export import pipeline
    from kvserve.export.parity import StepsFailed
    from kvserve.runtime import StepRunFailed, step

    def refused(session, binding, run_options):
        raise StepRunFailed("ONNX Runtime failed a step on CPUExecutionProvider: Non-zero status code returned while running "
                            "ReduceSum node. Name:'node_sum_2'")

    monkeypatch.setattr(step, "run_bound", refused)
    out = tmp_path / "artifact"
    with pytest.raises(StepsFailed) as failed:
        pipeline.export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, out, provider="cpu")
    assert str(failed.value) == (f"{out}: nothing written: its graph fails a step (ONNX Runtime failed a step on CPUExecutionProvider: "
                                 "Non-zero status code returned while running ReduceSum node. Name:'node_sum_2')")
    assert failed.value.exit_code == 1 and list(tmp_path.iterdir()) == []
