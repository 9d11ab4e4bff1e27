"""The parity harness itself: it passes a good artifact and names the (layer, head) of a bad one."""

import copy
import json

import numpy as np
import pytest
import torch

from kvserve.export.parity import format_report, verify

from ..conftest import PROVIDER, PROVIDER_NAMES, run_cli, unrunnable_copy


def test_verify_passes_the_exported_artifact_with_float32_tolerances(tiny_artifact, tiny_model):
    report = verify(tiny_artifact, tiny_model, provider=PROVIDER)
    assert report.passed, report.failures
    assert report.provider == PROVIDER_NAMES[PROVIDER]
    assert report.greedy.identical and report.greedy.onnx == report.greedy.eager
    for check in report.checks:
        assert check.max_abs_logits <= 1e-4 * check.max_abs_eager_logit and check.top1_agreement == 1.0
    assert {c.name.split()[0] for c in report.checks} == {"prefill", "decode", "cached"}
    kv = report.kv_max_abs_per_layer_head
    assert len(kv) == tiny_model.config.n_layer and len(kv[0]) == tiny_model.config.n_head
    assert report.first_failing_layer_head is None
    text = format_report(report)  # the provider is in its first line; a note only where CUDA is here but did not start
    assert f"on {report.provider}" in text.splitlines()[0] and "not CUDA" not in text


def test_verify_names_the_first_layer_and_head_that_diverges(tiny_artifact, tiny_model):
    # A reference whose layer 1, head 2 key projection differs: exactly that (layer, head) must be named.
    config = tiny_model.config
    altered = copy.deepcopy(tiny_model)
    d, dk = config.d_model, config.d_head
    with torch.no_grad():
        key_rows = slice(d + 2 * dk, d + 3 * dk)  # c_attn output rows: [Q | K | V], head 2 of K
        altered.transformer.h[1].attn.c_attn.bias[key_rows] += 0.5
    report = verify(tiny_artifact, altered, provider="cpu")
    assert not report.passed
    assert report.first_failing_layer_head.layer == 1
    assert report.first_failing_layer_head.head == 2
    assert "layer 1, head 2" in format_report(report)


@pytest.mark.parametrize("weight", ["h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight"])
def test_one_weight_entry_off_by_a_hundredth_of_its_tensors_scale_fails_float32_parity(tiny_artifact, tiny_model, weight):
    """The float32 bounds are relative and have a margin over every CPU's rounding (bench/results/parity-errors.md); a
    real error as small as one weight entry moved by 1% of its tensor's largest |value| must still be caught."""
    altered = copy.deepcopy(tiny_model)
    with torch.no_grad():
        tensor = altered.transformer.get_parameter(weight)
        tensor.view(-1)[7] += 0.01 * float(tensor.abs().max())
    report = verify(tiny_artifact, altered, provider="cpu")
    assert not report.passed
    assert any("outside float32 tolerance" in failure for failure in report.failures), report.failures


def test_a_decode_mask_reading_one_column_past_each_row_fails_float32_parity(tiny_standard_artifact, tiny_model, monkeypatch):
    """Every row of every decode step also attends to the first column it has not written (zeros): a mask off by one.
    (A standard graph: a fused one takes no mask, its operator reads each row up to its last position.)"""
    from kvserve.runtime.step import DecoderRuntime

    run_slots = DecoderRuntime.run_slots

    def off_by_one(self, pool, input_ids, position_ids, attention_mask, *args, **kwargs):
        widened = np.concatenate([attention_mask, np.ones((attention_mask.shape[0], 1), np.int64)], axis=1)  # (B, W + 1)
        return run_slots(self, pool, input_ids, position_ids, widened, *args, **kwargs)

    monkeypatch.setattr(DecoderRuntime, "run_slots", off_by_one)
    report = verify(tiny_standard_artifact, tiny_model, provider="cpu")
    assert not report.passed
    assert any(failure.startswith("decode") for failure in report.failures), report.failures


def test_verify_cli_writes_json_and_sets_the_exit_code(tiny_artifact, tmp_path):
    report_path = tmp_path / "report.json"
    result = run_cli("verify", str(tiny_artifact), "--provider", "cpu", "--report", str(report_path))
    assert result.returncode == 0, result.stderr
    assert "| prefill B=4" in result.stdout and "result: PASS" in result.stdout
    assert json.loads(report_path.read_text())["passed"] is True


def test_verify_cli_fails_against_other_weights(tiny_artifact, tmp_path):
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.decoders import build
    from kvserve.model.presets import preset

    save_checkpoint(build(preset("tiny"), seed=99), tmp_path / "other")
    result = run_cli("verify", str(tiny_artifact), "--provider", "cpu", "--checkpoint", str(tmp_path / "other"), "--report", str(tmp_path / "r.json"))
    assert result.returncode == 1
    assert "result: FAIL" in result.stdout and "first (layer, head) over tolerance: layer 0" in result.stdout


def test_verify_of_a_graph_whose_steps_fail_ends_in_one_line_naming_the_node(tiny_artifact, tmp_path):
    """A graph ONNX Runtime fails to run on the provider (here: it reads the rows to sample past the step's tokens) is a
    failed verification (exit 1) in one line, not a traceback; no report is written."""
    bad = unrunnable_copy(tiny_artifact, tmp_path / "bad")
    result = run_cli("verify", str(bad), "--provider", "cpu", "--report", str(tmp_path / "r.json"))
    assert result.returncode == 1, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"kvserve verify: error: {bad}: its graph fails a step (ONNX Runtime failed a step on CPUExecutionProvider: ")
    assert "Gather node" in error and "Traceback" not in result.stderr and not (tmp_path / "r.json").exists()


def test_verify_cli_rejects_a_missing_artifact_and_cuda_without_a_gpu(tmp_path, tiny_artifact):
    result = run_cli("verify", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "artifact directory not found" in result.stderr
    from kvserve.runtime.providers import _cuda_missing_reason

    if _cuda_missing_reason() is not None:  # on a GPU host this request is valid and tested by bench/gpu_check
        result = run_cli("verify", str(tiny_artifact), "--provider", "cuda", "--report", str(tmp_path / "r.json"))
        assert result.returncode == 2 and "CUDA requested but unavailable" in result.stderr


def test_verify_drives_a_concat_artifact_optimum_style_and_passes_it(tiny_concat_artifact, tiny_model):
    report = verify(tiny_concat_artifact, tiny_model, provider=PROVIDER)
    assert report.passed, report.failures
    assert report.kv_cache == "concat" and report.greedy.identical and report.greedy_tokens_argmax is None
    assert all(c.max_abs_logits <= 1e-4 * c.max_abs_eager_logit for c in report.checks)
    assert "concat KV cache" in format_report(report)


def test_verify_refuses_a_graph_that_is_not_its_manifests_contract_in_one_line(tiny_llama_fused_artifact, tiny_llama_model, tmp_path):
    """A fused artifact whose model.onnx is another graph (as one exported by a kvserve whose fused graph differed):
    named before anything runs, not a traceback from midway through the checks."""
    import shutil

    from kvserve.contract.artifact import sha256_file
    from kvserve.export.pipeline import export_artifact

    standard = tmp_path / "standard"
    export_artifact(tiny_llama_model, {"kind": "preset", "name": "tiny-llama", "seed": 0}, standard, provider=PROVIDER, attention="standard")
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_llama_fused_artifact, mixed)
    shutil.copy(standard / "model.onnx", mixed / "model.onnx")
    manifest = json.loads((mixed / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = sha256_file(mixed / "model.onnx")
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("verify", str(mixed), "--provider", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert f"{mixed}: the graph is not the contract its manifest declares (graph inputs are" in result.stderr


@pytest.mark.parametrize("graph_file", ["model.onnx", "decode.onnx"], ids=["step graph", "decode graph"])
def test_a_graph_whose_greedy_tokens_are_not_its_logits_argmax_fails_verify_and_the_load_gate(tiny_artifact, tiny_model, tmp_path, graph_file):
    """greedy_tokens are what greedy requests get, so a graph that computes them wrongly (here: the top-1 made the
    bottom-1) fails verify, and the server's load-time gate, which replays the golden prompt through them and holds
    each to its own logits' argmax: the step graph (steps of several rows), and the decode graph a small artifact's steps
    of one row run, each held apart."""
    import shutil

    import onnx

    from kvserve.contract.artifact import open_artifact, sha256_file
    from kvserve.runtime.step import DecoderRuntime
    from kvserve.service.process.gate import run_gate

    bad = tmp_path / "bottom-1"
    shutil.copytree(tiny_artifact, bad)
    graph = onnx.load(str(bad / graph_file), load_external_data=False)
    top1 = [node for node in graph.graph.node if node.op_type == "TopK"]
    assert len(top1) == 1
    next(a for a in top1[0].attribute if a.name == "largest").i = 0
    onnx.save(graph, str(bad / graph_file))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][graph_file] = sha256_file(bad / graph_file)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    report = verify(bad, tiny_model, provider=PROVIDER)
    argmax = report.greedy_tokens_argmax
    assert not report.passed and 0 < argmax.mismatches < argmax.rows  # the other graph's rows took their argmax
    assert report.failures == [f"the graph's greedy_tokens differ from its logits' argmax at {argmax.mismatches} of {argmax.rows} rows"]
    artifact = open_artifact(bad)
    gate = run_gate(DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER), artifact)
    assert not gate.passed and "greedy tokens DIFFER (greedy_tokens NOT its logits argmax)" in gate.summary


def test_float32_bounds_scale_with_the_logits_and_the_kv_they_judge():
    """The same rounding, relative to the numbers' size, passes whatever their scale: logits of 100 off by 5e-3 (a
    relative 5e-5) pass where an absolute 1e-4 refused them; the same 5e-3 on logits of 1 fails. K/V alike."""
    from kvserve.contract.tolerances import TOLERANCES
    from kvserve.export.parity_report import CheckStats

    rng = np.random.default_rng(0)
    for scale, passes in ((100.0, True), (1.0, False)):
        eager = rng.standard_normal((4, 50)) * scale / 3
        eager[0, 0] = scale  # the largest |logit| is scale
        check = CheckStats("scaled")
        check.add_logits(eager + 5e-3, eager)
        check.kv_max_abs = 5e-5  # the K/V divergence is already relative to each (layer, head)'s largest |K/V|
        assert check.result(TOLERANCES["float32"]).passed is passes, scale
    assert TOLERANCES["float32"].kv_relative  # so verify hands it relative K/V divergences (_kv_divergence)


def test_kv_divergence_measures_the_largest_entry_or_the_noise_of_each_layer_and_head():
    """One entry off by half the head's largest |K/V| is the whole story for the max measure and a trace of it for the
    root-mean-square one, which reads noise on every entry as its power against the K/V's; a head whose K/V the graph
    lost is 1 either way."""
    from kvserve.export.parity_report import kv_divergence

    rng = np.random.default_rng(0)
    eager = torch.from_numpy(rng.standard_normal((1, 2, 64, 8)))  # (B, H, S, d_k): one layer's K (and V), two heads
    real = np.ones((1, 64), bool)
    spike = eager.numpy()[0].copy()
    spike[0, 3, 1] += 0.5 * np.abs(spike[0]).max()
    noisy = eager.numpy()[0] + 0.1 * rng.standard_normal((2, 64, 8))
    lost = eager.numpy()[0].copy()
    lost[1] = 0.0

    def measure(onnx, rms):
        return kv_divergence([[onnx, onnx]], [(eager, eager)], real, relative=True, rms=rms)[0]  # (H,)

    assert measure(spike, rms=False)[0] == pytest.approx(0.5) and measure(spike, rms=True)[0] < 0.1
    assert measure(noisy, rms=True) == pytest.approx([0.1, 0.1], rel=0.2)
    assert measure(lost, rms=True)[1] == pytest.approx(1.0) and measure(lost, rms=False)[1] == pytest.approx(1.0)
    assert measure(lost, rms=True)[0] == 0.0
