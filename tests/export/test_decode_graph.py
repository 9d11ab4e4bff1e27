"""A fused artifact's decode graph (export/decode_graph.py): the step graph without the If that no CUDA graph holds,
for steps that only decode. Every family's fused float16 graph becomes one ONNX Runtime would capture (the placement
check, no GPU needed); its steps give the step graph's tokens; the export writes it, held to the eager model."""

from __future__ import annotations

import collections
import json

import onnx
import pytest

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import CHUNKLESS_MAX_WEIGHT_BYTES, DECODE_GRAPH_FILE, graph_bytes
from kvserve.export.cuda_placement import capture_blockers
from kvserve.export.decode_graph import TOTAL, decode_only, writes_decode_graph
from kvserve.export.graph_fusions import fuse_operators
from kvserve.export.onnx_export import trace_graph
from kvserve.export.pipeline import export_artifact
from kvserve.model.decoders import build

from ..conftest import PROVIDER
from .test_streamed_export import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_fused_decode_graph_runs_whole_on_the_device(family):
    step, _ = trace_graph(build(FAMILIES[family], seed=0), "float16", io.SLOTS, io.FUSED)
    fuse_operators(step, float16=True)
    assert any(line.startswith("If ") for line in capture_blockers(step))
    decode = decode_only(step)
    assert capture_blockers(decode) == []
    ops = collections.Counter(node.op_type for node in decode.graph.node)
    n_layer = FAMILIES[family].n_layer
    assert ops["If"] == 0 and ops["GroupQueryAttention"] == n_layer  # one operator a layer: the rows'
    assert all(node.input[6].startswith(TOTAL) for node in decode.graph.node if node.op_type == "GroupQueryAttention")
    names = {i.name for i in decode.graph.input}
    assert not {n for n in names if n.startswith("chunk")}, "the chunk's inputs are gone"
    assert {io.INPUT_IDS, io.POSITION_IDS, io.LOGITS_INDEX} <= names
    assert [o.name for o in decode.graph.output] == [io.LOGITS, io.GREEDY_TOKENS] + io.output_names(n_layer, io.SLOTS)[2:]
    assert sum(1 for n in step.graph.node if n.op_type == "If") == n_layer, "the step graph it came from is unchanged"


def test_a_graph_without_the_attention_if_is_refused():
    standard, _ = trace_graph(build(FAMILIES["llama"], seed=0), "float16", io.SLOTS, io.STANDARD)
    with pytest.raises(ValueError, match="no attention If"):
        decode_only(standard)


def test_a_float16_fused_export_writes_its_decode_graph_and_holds_it_to_the_eager_model(tmp_path, tiny_llama_model):
    out = tmp_path / "fp16"
    export_artifact(tiny_llama_model, {"kind": "preset", "name": "tiny-llama", "seed": 0}, out, dtype="float16", provider=PROVIDER,
                    attention="fused")
    manifest = json.loads((out / "manifest.json").read_text())
    assert DECODE_GRAPH_FILE in manifest["files"]  # checksummed with the rest
    decode = onnx.load(out / DECODE_GRAPH_FILE, load_external_data=False)
    assert capture_blockers(decode) == []
    checks = {c["name"]: c for c in json.loads((out / "parity.json").read_text())["checks"]}
    assert checks["decode graph 8 steps B=2"]["passed"] and checks["decode graph 8 steps B=2"]["kv_max_abs"] is not None


def test_a_small_float32_fused_export_writes_its_decode_graph_a_standard_one_none(tiny_artifact, tiny_standard_artifact):
    assert graph_bytes(tiny_artifact) <= CHUNKLESS_MAX_WEIGHT_BYTES
    assert DECODE_GRAPH_FILE in json.loads((tiny_artifact / "manifest.json").read_text())["files"]
    checks = {c["name"]: c for c in json.loads((tiny_artifact / "parity.json").read_text())["checks"]}
    assert checks["decode graph 8 steps B=2"]["passed"]  # held to the eager model as a float16 one is
    assert checks["decode graph, one row: prefill T=13, 8 steps"]["passed"]  # and the one-row steps it serves on the CPU
    assert not (tiny_standard_artifact / DECODE_GRAPH_FILE).exists()


def test_a_large_fused_export_writes_a_decode_graph_in_float16_alone():
    large = CHUNKLESS_MAX_WEIGHT_BYTES + 1
    assert writes_decode_graph("float16", io.SLOTS, io.FUSED, large)  # CUDA captures its decode steps
    assert not writes_decode_graph("float32", io.SLOTS, io.FUSED, large)  # a quantized export's dtype too
    assert writes_decode_graph("float32", io.SLOTS, io.FUSED, CHUNKLESS_MAX_WEIGHT_BYTES)
    assert not writes_decode_graph("float16", io.SLOTS, io.STANDARD, 0)
