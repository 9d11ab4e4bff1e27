"""What keeps a step from being captured as a CUDA graph (export/cuda_placement.py), read from the graph without a GPU:
every family's standard slots graph computes nothing from shapes that a CUDA kernel reads as data, and the check names
the patterns ONNX Runtime's CUDA provider would copy to the device (an arange of a shape used as indices, shape
arithmetic mixed with a graph input) or cannot hold (a Range kernel, control flow)."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from kvserve.contract import io_contract as io
from kvserve.export.cuda_placement import capture_blockers
from kvserve.export.onnx_export import trace_graph
from kvserve.model.decoders import build

from .test_streamed_export import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_familys_standard_slots_step_runs_whole_on_the_device(family, dtype):
    graph, _ = trace_graph(build(FAMILIES[family], seed=0), dtype, io.SLOTS, io.STANDARD)
    assert capture_blockers(graph) == []


def test_the_fused_graph_is_named_for_its_control_flow(tiny_llama_fused_artifact):
    blockers = capture_blockers(onnx.load(tiny_llama_fused_artifact / "model.onnx", load_external_data=False))
    assert blockers and all(line.startswith("If ") and line.endswith("control flow, which CUDA graphs cannot hold") for line in blockers), blockers


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
IDS = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)


def test_shape_arithmetic_that_ends_in_a_reshape_is_allowed():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Concat", ["s", "minus_one"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = _model(nodes, [X], [Y], [helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])])
    assert capture_blockers(model) == []


def test_an_arange_of_a_shape_used_as_indices_is_named():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=0, end=1), helper.make_node("Squeeze", ["s"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["rows"]), helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Gather", ["r", "rows"], ["y"])]
    model = _model(nodes, [X], [Y], [helper.make_tensor("zero", TensorProto.INT64, [], [0]), helper.make_tensor("one", TensorProto.INT64, [], [1])])
    assert capture_blockers(model) == ["Range : its CUDA kernel copies its inputs to the host",
                                       "Gather : reads host tensor rows as data (a Memcpy to the device)"]


def test_shape_arithmetic_mixed_with_a_graph_input_is_named():
    ids_out = helper.make_tensor_value_info("z", TensorProto.INT64, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2, name="width"), helper.make_node("Mul", ["ids", "s"], ["z"], name="cells")]
    assert capture_blockers(_model(nodes, [X, IDS], [ids_out])) == ["Mul cells: moved to the CPU with graph input ids (a copy to the host)"]


def test_a_device_only_type_keeps_the_node_on_the_device_and_its_host_input_is_copied():
    half = helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["n", 4])
    nodes = [helper.make_node("Shape", ["h"], ["s"], start=0, end=1), helper.make_node("Cast", ["s"], ["c"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["h", "c"], ["y"], name="scale")]
    assert capture_blockers(_model(nodes, [half], [Y])) == ["Mul scale: reads host tensor c as data (a Memcpy to the device)"]


def test_a_device_value_a_kernel_reads_from_host_memory_is_named():
    """GroupQueryAttention's total length, computed on the device as the fused step graph does (the longest row's),
    would be copied to the host mid-step; a graph input or host arithmetic from a shape is not."""
    lengths = helper.make_tensor_value_info("lengths", TensorProto.INT32, ["b"])
    nodes = [helper.make_node("ReduceMax", ["lengths"], ["longest"], keepdims=0), helper.make_node("Add", ["longest", "one"], ["total"]),
             helper.make_node("Reshape", ["x", "total"], ["y"], name="host_input")]
    model = _model(nodes, [X, lengths], [Y], [helper.make_tensor("one", TensorProto.INT32, [], [1])])
    assert capture_blockers(model) == ["Reshape host_input: reads device tensor total from host memory (a Memcpy to the host)"]
