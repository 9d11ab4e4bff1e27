"""A fused slots graph's decode-only form, which CUDA graphs can capture (contract/io_contract.py, "The decode graph").

The fused step graph decides per layer, by an If on "the step has a chunk", whether a second GroupQueryAttention
runs; ONNX Runtime captures no graph holding control flow, so a fused artifact's decode steps could never be replayed.
decode_only rewrites the graph for steps that only decode, one token a row: each layer's If becomes its else branch
(the rows' operator alone), the chunk's inputs and outputs go (its ids and positions become empty constants, its
K/V inputs and outputs are dropped), and the operators' total_sequence_length, which their CUDA kernel reads from
host memory, is the pool's width read from the K/V input's shape, at most the operator's rotary table's rows (a
CPU pool's rows are padded to whole pages past them): host arithmetic that needs no copy and no graph input, and at least every
row's length (a row with nothing to decode writes its scratch token at the context's last column).
Everything else, weights included, is the step graph's own: the export writes it beside model.onnx (decode.onnx),
its weights pointing into the same model.onnx.data (a graph that holds its weights inline, a small one, gets a copy).

The same graph serves a small model's CPU steps of one row and no chunk (runtime/step.py, chunkless_steps), where the
step graph's If a layer is a fixed cost the step feels (bench/chunkless_steps.py: the 4-layer quoting model's batch-1
steps 0.92-0.98x the step graph's time; gpt2's 124M 0.99-1.01x, for its weights packed a second time).
Where a runtime splits its steps (on CUDA: runtime/step.py splits_steps), it serves every step without a prompt chunk
beside decoding rows, the chunk graph (export/chunk_graph.py) the rest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import CHUNKLESS_MAX_WEIGHT_BYTES, DECODE_GRAPH_FILE

from .fused_graph import inline_branch
from .graph_fusions import drop_unread

GQA = "GroupQueryAttention"
TOTAL_INPUT = 6  # GroupQueryAttention's total_sequence_length
COS_INPUT = 7  # and its cos_cache (its rotary tables' rows: positions 0 ..)
TOTAL = "kvserve_decode/total_sequence_length"  # the value decode_only feeds it


def decode_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """model (a fused slots graph, its weights in it or external) rewritten for decode-only steps (module docstring);
    model itself is left as it was."""
    graph = model.graph
    if not any(node.op_type == "If" for node in graph.node):
        raise ValueError("decode_only rewrites a fused slots graph: this one has no attention If")
    decode = onnx.ModelProto()
    decode.CopyFrom(model)  # an export's weights are external here: the copy holds their locations, not their bytes
    graph = decode.graph
    chunk_inputs = {io.CHUNK_IDS: np.zeros((1, 0), np.int64), io.CHUNK_POSITION_IDS: np.zeros((1, 0), np.int64),
                    io.CHUNK_LONG_ROPE: np.zeros(1, np.int64)}  # (1, 0), (1, 0), (1,)
    kept_inputs = [i for i in graph.input if i.name not in chunk_inputs and not i.name.startswith("chunk_key_values.")]
    for name, value in chunk_inputs.items():
        if any(i.name == name for i in graph.input):
            graph.initializer.append(numpy_helper.from_array(value, name))
    del graph.input[:]
    graph.input.extend(kept_inputs)
    kept_outputs = [o for o in graph.output if not o.name.startswith("chunk_present.")]
    del graph.output[:]
    graph.output.extend(kept_outputs)

    past_key = io.past_names(0)[0]
    width = f"{TOTAL}/shape"
    nodes = [helper.make_node("Shape", [past_key], [width], start=2, end=3)]  # (1,): the pool's columns, on the host
    totals: dict[str, str] = {}  # a rotary table ("" none) -> the total its operators read
    decode.metadata_props.add(key=io.DECODE_TOTAL_WITHIN_TABLES, value="1")
    for node in graph.node:
        if node.op_type != "If":
            nodes.append(node)
            continue
        for inner in inline_branch(node, "else_branch"):
            if inner.op_type == GQA:
                table = inner.input[COS_INPUT] if len(inner.input) > COS_INPUT else ""
                if table not in totals:  # made here, after the table (this If reads it): the order stays topological
                    totals[table] = total = TOTAL if not totals else f"{TOTAL}/{len(totals)}"
                    nodes += _bounded_total(width, table, total)
                inner.input[TOTAL_INPUT] = totals[table]
            nodes.append(inner)
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unread(graph)  # the chunk's pass-through, the If conditions, the device-side totals
    return decode


def _bounded_total(width: str, table: str, total: str) -> list[onnx.NodeProto]:
    """Nodes making total, int32 () as the operator wants it: the pool's width (width, (1,)), at most table's rows (a
    CPU pool may be wider than the rotary tables, runtime/pool.py, and the operator refuses a total past them)."""
    nodes, bound = [], width
    if table:
        nodes.append(helper.make_node("Shape", [table], [f"{total}/table"], start=0, end=1))  # (1,): its rows
        nodes.append(helper.make_node("Min", [width, f"{total}/table"], [f"{total}/bound"]))  # (1,)
        bound = f"{total}/bound"
    nodes.append(helper.make_node("Squeeze", [bound], [f"{total}/columns"]))  # ()
    nodes.append(helper.make_node("Cast", [f"{total}/columns"], [total], to=TensorProto.INT32))  # () int32
    return nodes


def writes_decode_graph(dtype: str, kv_cache: str, attention: str, weight_bytes: int) -> bool:
    """Whether an export of these, its graph and weights weight_bytes, writes a decode graph: every fused slots graph in
    float16, the dtype ONNX Runtime's CUDA provider runs GroupQueryAttention in, for its captured decode steps; and one of
    any dtype whose weights are small (CHUNKLESS_MAX_WEIGHT_BYTES), whose CPU steps without a chunk run it."""
    fused = kv_cache == io.SLOTS and attention == io.FUSED
    return fused and (dtype == "float16" or weight_bytes <= CHUNKLESS_MAX_WEIGHT_BYTES)


def save_decode_graph(step_graph: onnx.ModelProto, directory: Path) -> None:
    """directory/DECODE_GRAPH_FILE from step_graph as save_graph left it (external weights pointing into
    directory/MODEL_DATA_FILE, which the decode graph reads too), checked as the step graph is."""
    path = directory / DECODE_GRAPH_FILE
    onnx.save_model(decode_only(step_graph), str(path))
    onnx.checker.check_model(str(path), full_check=False)  # contrib operators: no strict pass, as save_graph
