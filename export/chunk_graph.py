"""A fused slots graph's form for steps that run a prompt chunk beside decoding rows, without the If a layer
(contract/io_contract.py, "The chunk graph").

The fused step graph decides per layer, by an If on "the step has a chunk", whether the chunk's GroupQueryAttention
runs. On CUDA that If costs a step twice (bench/results/h200.md, third loan): ~0.2 ms a layer warmed, ~2.5 ms of a gpt2
chunk step's 4-5 ms, and ~50 ms of subgraph set-up the first time each (rows, chunk tokens) shape runs, the stalls
that held the fused server at 1,676 tokens/s at 16 streams. with_chunk rewrites the graph for steps that have both:
each layer's If becomes its then branch (the rows' operator and the chunk's, verbatim: their totals as the step graph
computes them), so the graph keeps every input and output of the step graph and runs no control flow. A step without
a chunk cannot run it (the chunk's operator needs a token): those are the decode graph's (export/decode_graph.py).
Everything else, weights included, is the step graph's own: the export writes it beside model.onnx (chunk.onnx), its
weights pointing into the same model.onnx.data.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import CHUNK_GRAPH_FILE

from .fused_graph import inline_branch
from .graph_fusions import drop_unread


def with_chunk(model: onnx.ModelProto) -> onnx.ModelProto:
    """model (a fused slots graph, its weights in it or external) rewritten for steps with a chunk beside decoding rows
    (module docstring); model itself is left as it was."""
    if not any(node.op_type == "If" for node in model.graph.node):
        raise ValueError("with_chunk rewrites a fused slots graph: this one has no attention If")
    chunk = onnx.ModelProto()
    chunk.CopyFrom(model)  # an export's weights are external here: the copy holds their locations, not their bytes
    graph = chunk.graph
    nodes = []
    for node in graph.node:
        nodes += inline_branch(node, "then_branch") if node.op_type == "If" else [node]
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unread(graph)  # the If conditions
    return chunk


def writes_chunk_graph(dtype: str, kv_cache: str, attention: str) -> bool:
    """Whether an export of these writes a chunk graph: every fused slots graph in float16, the dtype ONNX Runtime's CUDA
    provider runs GroupQueryAttention in, whose chunk steps it serves. (On the CPU the If weighs less than a second
    session's packed weights: bench/chunk_steps.py.)"""
    return kv_cache == io.SLOTS and attention == io.FUSED and dtype == "float16"


def save_chunk_graph(step_graph: onnx.ModelProto, directory: Path) -> None:
    """directory/CHUNK_GRAPH_FILE from step_graph as save_graph left it (external weights pointing into
    directory/MODEL_DATA_FILE, which the chunk graph reads too), checked as the step graph is."""
    path = directory / CHUNK_GRAPH_FILE
    onnx.save_model(with_chunk(step_graph), str(path))
    onnx.checker.check_model(str(path), full_check=False)  # contrib operators: no strict pass, as save_graph
