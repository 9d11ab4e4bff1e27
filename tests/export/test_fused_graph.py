"""The fused slots graph's ONNX spelling (export/fused_graph.py): an If a layer whose branches write every present in
place, and the check that refuses a graph that would not."""

import copy

import onnx
from onnx import helper

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import open_artifact
from kvserve.export.fused_graph import fused_write_problems


def branch(graph: onnx.GraphProto, layer: int, name: str) -> onnx.GraphProto:
    """The named branch of layer's attention If (the If writing present.{layer}.key)."""
    node = next(n for n in graph.node if io.present_names(layer)[0] in n.output)
    return next(a.g for a in node.attribute if a.name == name)


def test_each_layers_if_writes_its_rows_and_its_chunk_row_in_place(tiny_llama_fused_artifact):
    artifact = open_artifact(tiny_llama_fused_artifact)
    graph = onnx.load(str(artifact.model_path), load_external_data=False).graph
    n_layer = artifact.config.n_layer
    assert fused_write_problems(graph, n_layer) == []
    for layer in range(n_layer):
        then, otherwise = branch(graph, layer, "then_branch"), branch(graph, layer, "else_branch")
        writers = [n for n in then.node if n.op_type == "GroupQueryAttention"]
        assert [n.input[3:5] for n in writers] == [list(io.past_names(layer)), list(io.chunk_past_names(layer))]
        assert [n.op_type for n in otherwise.node].count("GroupQueryAttention") == 1
        assert [n.input[0] for n in otherwise.node if n.op_type == "Identity"] == list(io.chunk_past_names(layer))


def test_the_check_names_a_stale_reader_and_a_writer_that_does_not_write_in_place(tiny_llama_fused_artifact):
    artifact = open_artifact(tiny_llama_fused_artifact)
    graph = copy.deepcopy(onnx.load(str(artifact.model_path), load_external_data=False).graph)
    past_key, chunk_value = io.past_names(0)[0], io.chunk_past_names(0)[1]
    # a node in layer 0's else branch that reads the old keys, and its chunk value passed through a copy, not the past
    otherwise = branch(graph, 0, "else_branch")
    otherwise.node.append(helper.make_node("ReduceSum", [past_key], ["stale_sum"]))
    identity = next(n for n in otherwise.node if n.op_type == "Identity" and n.input[0] == chunk_value)
    identity.input[0] = "some_other_value"
    problems = fused_write_problems(graph, artifact.config.n_layer)
    assert problems == [
        f"{past_key} is also read by ReduceSum",
        f"{io.chunk_present_names(0)[1]} is not a GroupQueryAttention into {chunk_value} in the If's else_branch",
    ]
