"""A fused float16 artifact's chunk graph (export/chunk_graph.py): the step graph without its If a layer, for steps
with a prompt chunk beside decoding rows. Every family's graph becomes one with both operators a layer and no
control flow, the step graph's inputs and outputs; the export writes it and verify holds it, with the decode graph,
to the eager model; a chunk graph computing wrongly fails verify and the load gate."""

from __future__ import annotations

import collections
import json
import shutil

import onnx
import pytest

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import CHUNK_GRAPH_FILE, open_artifact, sha256_file
from kvserve.export.chunk_graph import with_chunk, writes_chunk_graph
from kvserve.export.cuda_placement import CONTROL_FLOW, capture_blockers
from kvserve.export.graph_fusions import fuse_operators
from kvserve.export.onnx_export import trace_graph
from kvserve.export.parity import verify
from kvserve.model.decoders import build
from kvserve.runtime.step import DecoderRuntime
from kvserve.service.process.gate import run_gate

from ..conftest import PROVIDER
from .test_streamed_export import FAMILIES

SPLIT_CHECKS = ("split steps: decode 8 steps B=2", "split steps: cached vs full recompute",
                "split steps: decode beside a prompt chunk: B=2, T=13 in 3 steps")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_chunk_graph_runs_both_operators_a_layer_and_no_control_flow(family):
    step, _ = trace_graph(build(FAMILIES[family], seed=0), "float16", io.SLOTS, io.FUSED)
    fuse_operators(step, float16=True)
    chunk = with_chunk(step)
    ops = collections.Counter(node.op_type for node in chunk.graph.node)
    n_layer = FAMILIES[family].n_layer
    assert not any(op in CONTROL_FLOW for op in ops) and ops["GroupQueryAttention"] == 2 * n_layer  # the rows' and the chunk's
    assert not any(line.startswith("If ") for line in capture_blockers(chunk))
    assert [i.name for i in chunk.graph.input] == [i.name for i in step.graph.input]  # every input the runtime binds
    assert [o.name for o in chunk.graph.output] == [o.name for o in step.graph.output]
    ifs = [node for node in step.graph.node if node.op_type == "If"]
    assert len(ifs) == n_layer, "the step graph it came from is unchanged"
    for node in ifs:  # each If's outputs are now made by its then branch's operators, in the outer graph
        for out in node.output:
            assert sum(out in n.output for n in chunk.graph.node) == 1


def test_a_graph_without_the_attention_if_is_refused():
    standard, _ = trace_graph(build(FAMILIES["llama"], seed=0), "float16", io.SLOTS, io.STANDARD)
    with pytest.raises(ValueError, match="no attention If"):
        with_chunk(standard)


def test_fused_float16_exports_alone_write_a_chunk_graph():
    assert writes_chunk_graph("float16", io.SLOTS, io.FUSED)  # the dtype CUDA runs the fused kernel in
    assert not writes_chunk_graph("float32", io.SLOTS, io.FUSED)  # the CPU's: the If weighs less than a session there
    assert not writes_chunk_graph("float16", io.SLOTS, io.STANDARD)
    assert not writes_chunk_graph("float16", io.CONCAT, io.FUSED)


def test_a_float16_fused_export_writes_its_chunk_graph_and_verify_holds_both_split_graphs(tiny_llama_fused_artifacts, tiny_artifact):
    out = tiny_llama_fused_artifacts("float16")
    assert CHUNK_GRAPH_FILE in json.loads((out / "manifest.json").read_text())["files"]  # checksummed with the rest
    checks = {c["name"]: c for c in json.loads((out / "parity.json").read_text())["checks"]}
    for name in SPLIT_CHECKS + ("decode beside a prompt chunk: B=2, T=13 in 3 steps",):  # the step graph's chunk branch too
        assert checks[name]["passed"] and checks[name]["max_abs_eager_logit"] > 0, name
    assert checks[SPLIT_CHECKS[2]]["kv_max_abs"] is not None
    assert not (tiny_artifact / CHUNK_GRAPH_FILE).exists()  # float32: no chunk graph, and no split checks
    assert not any(c["name"].startswith("split steps") for c in json.loads((tiny_artifact / "parity.json").read_text())["checks"])


def scaled_wrongly(artifact_dir, model, tmp_path, operator: str):
    """A copy of artifact_dir whose chunk graph's GroupQueryAttention named by operator ("chunk_y": the chunk's,
    "rows_y": the rows') scores every token at twice the scale, its manifest's hash updated."""
    bad = tmp_path / f"bad-{operator}"
    shutil.copytree(artifact_dir, bad)
    graph = onnx.load(str(bad / CHUNK_GRAPH_FILE), load_external_data=False)
    d_head = model.config.d_head
    ops = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention" and operator in n.output[0]]
    assert len(ops) == model.config.n_layer
    for node in ops:
        kept = [a for a in node.attribute if a.name != "scale"]  # the model's own scale, where it sets one
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute("scale", 2.0 / d_head**0.5)])
    onnx.save(graph, str(bad / CHUNK_GRAPH_FILE))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][CHUNK_GRAPH_FILE] = sha256_file(bad / CHUNK_GRAPH_FILE)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


def test_a_chunk_graph_computing_wrongly_fails_verify_and_the_load_gate(tiny_llama_fused_artifacts, tiny_llama_model, tmp_path,
                                                                        monkeypatch):
    """Its chunk's operator scaled wrongly (the scores of every chunk token doubled): the step graph's checks pass, the
    split steps' beside-a-chunk check fails, and so does the gate of a runtime that splits its steps, which replays the
    golden prompt beside a decoding row."""
    bad = scaled_wrongly(tiny_llama_fused_artifacts("float16"), tiny_llama_model, tmp_path, "chunk_y")
    report = verify(bad, tiny_llama_model, provider=PROVIDER)
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == [SPLIT_CHECKS[2]], failed
    artifact = open_artifact(bad)
    split = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunk_graph=True)
    gate = run_gate(split, artifact)
    assert not gate.passed and "beside a decoding row, through the chunk graph" in gate.summary
    good = open_artifact(tiny_llama_fused_artifacts("float16"))
    gate = run_gate(DecoderRuntime(good.model_path, good.config.n_layer, good.dtype, PROVIDER, chunk_graph=True), good)
    assert gate.passed and "beside a decoding row, through the chunk graph" in gate.summary
    assert "prefilled in a group of two: golden replay" in gate.summary
    # a server that groups no prompts (its rows not kept dense: no CUDA runtime to copy them) is not held to that replay
    from kvserve.service.core import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "MAX_PROMPT_GROUP", 1)
    gate = run_gate(DecoderRuntime(good.model_path, good.config.n_layer, good.dtype, PROVIDER, chunk_graph=True), good)
    assert gate.passed and gate.summary.endswith("prefilled in a group of two: not run: this server prefills no prompts together "
                                                 "(its rows are not kept dense)")


def test_a_chunk_graph_whose_rows_prefill_wrongly_fails_the_gates_replay_in_a_group(tiny_llama_fused_artifacts, tiny_llama_model, tmp_path):
    """Its rows' operator scaled wrongly (the scores of every row token doubled): the replay beside a decoding row runs
    the golden prompt as the chunk graph's chunk and decodes it through the decode graph, so it never meets that
    operator; the replay in a group prefills it as the chunk graph's first row, and the gate of a runtime that splits
    its steps fails there."""
    artifact = open_artifact(scaled_wrongly(tiny_llama_fused_artifacts("float16"), tiny_llama_model, tmp_path, "rows_y"))
    gate = run_gate(DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER, chunk_graph=True), artifact)
    beside, grouped = gate.summary.split("prefilled in a group of two: ")
    assert not gate.passed and "DIFFER" not in beside and "greedy tokens DIFFER" in grouped, gate.summary
