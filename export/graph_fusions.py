"""Operator fusions: a step of the export pipeline that rewrites a float32 graph's small elementwise operators into
ONNX Runtime's fused contrib kernels, leaving its inputs, outputs and KV contract exactly as they were.

ONNX Runtime's CPU provider fuses none of these at session time. A decode step of a few rows is mostly the weight
matrices' reads; every other operator is a kernel launch on a (rows, d_model) tensor, and GPT-2 has six a layer
beside its matrices: the tanh GELU spelled out (Pow, Mul, Add, Tanh: eight nodes), the bias Adds and the residual
Add before each LayerNorm. The fusions are ONNX Runtime's own (onnxruntime.transformers), applied one by one:
  FastGelu                   the tanh GELU, its bias Add folded in (BiasGelu)
  SkipLayerNormalization     residual Add + LayerNormalization, the residual sum kept as an output where the next
                             block reads it, and the bias Add of the projection before it folded in
They match a MatMul with a weight, not a MatMulNBits: the quantizer runs them before it rewrites the weights.
Measured in bench/decode_floor.py (docs/benchmarks.md, "Operator fusions").
"""

from __future__ import annotations

import collections
import logging

import onnx

FUSED_OPERATORS = ("FastGelu", "SkipLayerNormalization")
MICROSOFT = "com.microsoft"  # the contrib operators' domain


def fuse_operators(model: onnx.ModelProto) -> dict[str, int]:
    """Fuse model's GELU and residual + LayerNorm patterns in place; returns {fused operator: count in the graph}."""
    from onnxruntime.transformers.fusion_biasgelu import FusionBiasGelu
    from onnxruntime.transformers.fusion_fastgelu import FusionFastGelu
    from onnxruntime.transformers.fusion_skiplayernorm import FusionBiasSkipLayerNormalization, FusionSkipLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    wrapped = OnnxModel(model)
    logging.disable(logging.INFO)  # the fusions log a line each at INFO, under loggers named for their modules
    try:
        # Without shape inference (it cannot see into the attention If's branches) SkipLayerNormalization fuses any
        # Add of two activations feeding a LayerNormalization: in these decoders both are (tokens, d_model).
        for fusion in (FusionFastGelu(wrapped), FusionBiasGelu(wrapped, True), FusionSkipLayerNormalization(wrapped, shape_infer=False),
                       FusionBiasSkipLayerNormalization(wrapped)):
            fusion.apply()
    finally:
        logging.disable(logging.NOTSET)
    sort_nodes(model.graph)
    counts = collections.Counter(node.op_type for node in model.graph.node)
    if any(counts[op] for op in FUSED_OPERATORS) and not any(o.domain == MICROSOFT for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MICROSOFT, 1))
    return {op: counts[op] for op in FUSED_OPERATORS}


def _reads(node: onnx.NodeProto) -> set[str]:
    """Every value node reads: its inputs and, for an If or a loop, what its branches take from the outer graph."""
    names = set(node.input)
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            made = {out for inner in attr.g.node for out in inner.output}
            names |= {name for inner in attr.g.node for name in _reads(inner) if name not in made}
    return names


def sort_nodes(graph: onnx.GraphProto) -> None:
    """Order graph's nodes so each comes after the producers of what it reads, its branches' outer reads included
    (onnxruntime.transformers' own sort looks at node inputs only, and the fusions append the nodes they make);
    nodes keep their order where it is already right."""
    producers = {out: index for index, node in enumerate(graph.node) for out in node.output if out}
    nodes = list(graph.node)
    waiting_on = [{producers[name] for name in _reads(node) if name in producers} for node in nodes]
    placed, order = set(), []
    while len(order) < len(nodes):
        progressed = False
        for index, node in enumerate(nodes):
            if index not in placed and waiting_on[index] <= placed:
                placed.add(index)
                order.append(node)
                progressed = True
        if not progressed:
            raise ValueError("the fused graph has a cycle")
    del graph.node[:]
    graph.node.extend(order)
