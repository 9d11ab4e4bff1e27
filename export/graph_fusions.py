"""Operator fusions: a step of the export pipeline that rewrites a float32 graph's small elementwise operators into
ONNX Runtime's fused contrib kernels, leaving its inputs, outputs and KV contract exactly as they were.

ONNX Runtime's CPU provider fuses none of these at session time. A decode step of a few rows is mostly the weight
matrices' reads; every other operator is a kernel launch on a (rows, d_model) tensor, and GPT-2 has six a layer
beside its matrices: the tanh GELU spelled out (Pow, Mul, Add, Tanh: eight nodes), the bias Adds and the residual
Add before each LayerNorm. The fusions are ONNX Runtime's own (onnxruntime.transformers), applied one by one:
  FastGelu                   the tanh GELU, its bias Add folded in (BiasGelu)
  SkipLayerNormalization     residual Add + LayerNormalization, the residual sum kept as an output where the next
                             block reads it, and the bias Add of the projection before it folded in
They match a MatMul with a weight, not a MatMulNBits: the quantizer runs them before it rewrites the weights. A
Gemm's bias (a linear layer on the slots step's 2-D rows) moves into the fused kernel that reads it (fold_gemm_biases).
Measured in bench/decode_floor.py (docs/benchmarks.md, "Operator fusions").

A float16 graph first loses the float32 round trip its norms take (the eager model normalises in float32 for
stability: Cast up, normalise, Cast down, and the weights cast up beside it): float16_norms makes each one
LayerNormalization or SimplifiedLayerNormalization (RMSNorm) on the float16 values with a float32 stash, which is
what ONNX Runtime's kernels compute inside on both providers. Then the same fusions run, RMSNorm's residual Adds
included (SkipSimplifiedLayerNormalization). On a GPU every operator is a kernel launch a captured step replays: a
GPT-2 layer goes from 20 launches outside attention to 7.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.defs import OpSchema

from .weight_plan import WeightPlan, is_pending

FUSED_OPERATORS = ("FastGelu", "SkipLayerNormalization")
# What float16_norms makes, and the residual form of its RMSNorm: counted in a float16 graph's manifest beside the above.
FLOAT16_NORMS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
MICROSOFT = "com.microsoft"  # the contrib operators' domain


def fuse_operators(model: onnx.ModelProto, float16: bool = False, plan: WeightPlan | None = None) -> dict[str, int]:
    """Fuse model's GELU and residual + LayerNorm patterns in place; returns {fused operator: count in the graph}.
    float16: a float16 graph, whose norms float16_norms rewrites first (and whose RMSNorm residuals fuse too); plan: the
    pending weights' producers, where the graph's weights are pending (weight_plan.py)."""
    from onnxruntime.transformers.fusion_biasgelu import FusionBiasGelu
    from onnxruntime.transformers.fusion_fastgelu import FusionFastGelu
    from onnxruntime.transformers.fusion_skiplayernorm import FusionBiasSkipLayerNormalization, FusionSkipLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    if float16:
        float16_norms(model, plan)
    wrapped = OnnxModel(model)
    logging.disable(logging.INFO)  # the fusions log a line each at INFO, under loggers named for their modules
    try:
        # Without shape inference (it cannot see into the attention If's branches) SkipLayerNormalization fuses any
        # Add of two activations feeding a LayerNormalization: in these decoders both are (tokens, d_model).
        for fusion in (FusionFastGelu(wrapped), FusionBiasGelu(wrapped, True), FusionSkipLayerNormalization(wrapped, shape_infer=False),
                       FusionBiasSkipLayerNormalization(wrapped),
                       FusionSkipLayerNormalization(wrapped, "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", shape_infer=False)):
            fusion.apply()
    finally:
        logging.disable(logging.NOTSET)
    fold_gemm_biases(model.graph)
    sort_nodes(model.graph)
    counts = collections.Counter(node.op_type for node in model.graph.node)
    if any(node.domain == MICROSOFT for node in model.graph.node) and not any(o.domain == MICROSOFT for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MICROSOFT, 1))
    return {op: counts[op] for op in FUSED_OPERATORS + (FLOAT16_NORMS if float16 else ())}


def fold_gemm_biases(graph: onnx.GraphProto) -> int:
    """Move the bias of each Gemm(x, W, b) whose one reader is a FastGelu or a SkipLayerNormalization with no bias of
    its own into that reader's bias input, in place; returns how many moved. A linear layer on the slots step's 2-D rows
    exports as a Gemm with its bias, which the fusions (they match MatMul + Add) leave there, and ONNX Runtime's CUDA
    Gemm broadcasts a bias into its output with a cuBLAS GEMM of its own before the product (gemm.cc): GPT-2 launches
    one more GEMM for each of its four projections a layer. Moved, three of them are added inside kernels that run
    anyway (the attention and MLP outputs' SkipLayerNormalization, the MLP's FastGelu); Q/K/V's bias (read by a Reshape
    for the attention operator) and the last layer's (its residual sum is gathered before the final norm) stay."""
    initializers = {init.name: init for init in graph.initializer}
    outputs = {o.name for o in graph.output}
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name in _reads(node):
            readers[name].append(node)
    moved = 0
    for gemm in graph.node:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
        plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0 and not attributes.get("transA", 0)
        if gemm.op_type != "Gemm" or len(gemm.input) < 3 or not gemm.input[2] or not plain:
            continue
        bias, product, weight = gemm.input[2], gemm.output[0], initializers.get(gemm.input[1])
        if bias not in initializers or weight is None or product in outputs or len(readers[product]) != 1:
            continue
        if list(initializers[bias].dims) != [weight.dims[0 if attributes.get("transB", 0) else 1]]:
            continue  # the fused kernels take a bias of the product's width only, not one broadcast from a scalar
        (reader,) = readers[product]
        inputs = list(reader.input)
        if reader.domain != MICROSOFT:
            continue
        if reader.op_type == "FastGelu" and inputs[1:2] in ([], [""]) and inputs[0] == product:
            inputs[1:] = [bias]  # (X, bias)
        elif reader.op_type == "SkipLayerNormalization" and inputs[4:5] in ([], [""]) and product in inputs[:2]:
            inputs = (inputs + [""] * 4)[:4] + [bias]  # (input, skip, gamma, beta or none, bias)
        else:
            continue
        del reader.input[:]
        reader.input.extend(inputs)
        del gemm.input[2]
        moved += 1
    return moved


def float16_norms(model: onnx.ModelProto, plan: WeightPlan | None = None) -> int:
    """Rewrite a float16 graph's norms computed in float32 into one float16 operator each, in place (module docstring):
      Cast(x, float) -> LayerNormalization(., w, b) -> Cast(float16)                   => LayerNormalization(x, w, b)
      Cast(x, float) = h; Pow(h, 2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Div(h, .) -> Cast(float16) -> Mul(w, .)
                                                                                  => SimplifiedLayerNormalization(x, w)
    A float32 weight (the exporter folds the Casts of float16 weights into float32 initializers) is replaced by its
    float16 values, which it holds exactly; plan: the pending initializers' producers, when the weights are not in
    the graph. Gemma's norm (the weight offset by 1 and applied in float32) keeps its plain operators. Returns how many
    norms were rewritten; nodes and initializers left unread are removed."""
    declare_simplified_layer_norm()
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output if out}
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name in _reads(node):
            readers[name].append(node)
    weights = {t.name: t for t in graph.initializer}
    constants = {name: numpy_helper.to_array(t) for name, t in weights.items() if t.data_location != onnx.TensorProto.EXTERNAL}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def made_by(name: str, op_type: str) -> onnx.NodeProto | None:
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def cast_to(node: onnx.NodeProto | None, to: int) -> bool:
        return node is not None and node.op_type == "Cast" and any(a.name == "to" and a.i == to for a in node.attribute)

    def only_reader(name: str) -> onnx.NodeProto | None:
        return readers[name][0] if len(readers[name]) == 1 else None

    def in_float16(name: str) -> str | None:
        """A float32 value's float16 original: what a Cast took up, or a float32 weight's values as a float16 initializer."""
        cast = producer.get(name)
        if cast_to(cast, onnx.TensorProto.FLOAT):
            return cast.input[0]
        weight = weights.get(name)
        if weight is None or weight.data_type != onnx.TensorProto.FLOAT:
            return None
        half = f"{name}.float16"
        if half not in weights:
            if plan is not None and is_pending(weight):
                down = plan.add(half, np.float16, tuple(weight.dims), lambda: (np.asarray(c, np.float32).astype(np.float16) for c in plan.chunks(name)))
            else:
                down = numpy_helper.from_array(numpy_helper.to_array(weight).astype(np.float16), half)
            graph.initializer.append(down)
            weights[half] = down
        return half

    replaced: dict[int, onnx.NodeProto] = {}  # index of the node a rewrite replaces -> the new node
    casts_down: set[int] = set()  # the Casts whose outputs a rewritten LayerNormalization writes instead
    for index, node in enumerate(graph.node):
        if node.op_type == "LayerNormalization":
            down = only_reader(node.output[0])
            if not cast_to(down, onnx.TensorProto.FLOAT16) or len(node.output) != 1 or float16_source(producer, node.input[0]) is None:
                continue
            sources = [in_float16(name) for name in node.input]
            if all(sources):
                attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                replaced[index] = onnx.helper.make_node("LayerNormalization", sources, [down.output[0]], name=node.name or None,
                                                        **{**attributes, "stash_type": 1})
                casts_down.add(id(down))
        elif node.op_type == "Mul":
            for weight_at in (0, 1):
                down = made_by(node.input[1 - weight_at], "Cast")
                if not cast_to(down, onnx.TensorProto.FLOAT16):
                    continue
                div = made_by(down.input[0], "Div")
                sqrt = made_by(div.input[1], "Sqrt") if div is not None else None
                add = made_by(sqrt.input[0], "Add") if sqrt is not None else None
                mean = made_by(add.input[0], "ReduceMean") if add is not None else None
                power = made_by(mean.input[0], "Pow") if mean is not None else None
                if power is None or power.input[0] != div.input[0] or constants.get(power.input[1]) is None:
                    continue
                source = float16_source(producer, div.input[0])
                eps, axes = constants.get(add.input[1]), constants.get(mean.input[1]) if len(mean.input) > 1 else None
                keepdims = {a.name: onnx.helper.get_attribute_value(a) for a in mean.attribute}.get("keepdims", 1)
                if source is None or eps is None or axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) != -1 or not keepdims \
                        or float(constants[power.input[1]]) != 2.0:
                    continue
                replaced[index] = onnx.helper.make_node("SimplifiedLayerNormalization", [source, node.input[weight_at]], [node.output[0]],
                                                        name=node.name or None, epsilon=float(eps.reshape(-1)[0]), axis=-1, stash_type=1)
                break
    for index, new in replaced.items():
        graph.node[index].CopyFrom(new)
    kept = [node for node in graph.node if id(node) not in casts_down]
    del graph.node[:]
    graph.node.extend(kept)
    drop_unread(graph)
    return len(replaced)


def float16_source(producer: dict[str, onnx.NodeProto], name: str) -> str | None:
    """The float16 value a float32 activation was cast up from, or None."""
    cast = producer.get(name)
    if cast is None or cast.op_type != "Cast" or not any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in cast.attribute):
        return None
    return cast.input[0]


def declare_simplified_layer_norm() -> None:
    """ONNX Runtime's RMSNorm lives in the ONNX domain, where onnx's checker knows no schema for it: this declares the
    inputs and attributes kvserve writes (its own definition has optional outputs more), as fused_graph.py declares
    GroupQueryAttention's."""
    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    param, attr = OpSchema.FormalParameter, OpSchema.Attribute
    onnx.defs.register_schema(OpSchema(
        "SimplifiedLayerNormalization", "", 1,
        inputs=[param("X", "T"), param("scale", "V")], outputs=[param("Y", "V")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "input"), ("V", ["tensor(float)", "tensor(float16)"], "scale, output")],
        attributes=[attr("axis", OpSchema.AttrType.INT, "the first normalized axis", required=False),
                    attr("epsilon", OpSchema.AttrType.FLOAT, "added to the mean square", required=False),
                    attr("stash_type", OpSchema.AttrType.INT, "the statistics' type: 1 float32", required=False)]))


def drop_unread(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs is read by another node or is a graph output, until none is left, then the
    initializers nothing reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in _reads(node)} | outputs
        kept = [node for node in graph.node if any(out in read for out in node.output)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    weights = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(weights)


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
