"""How a fused `slots` step is spelled in ONNX (io_contract: fused attention; model/fused_attention.py).

The tracer meets one kvserve::rows_and_chunk_attention per layer and emits it as a placeholder node
(kvserve.RowsAndChunkAttention); expand_rows_and_chunk_attention then replaces each with an If on "the step
has a chunk": its then branch runs ONNX Runtime's com.microsoft.GroupQueryAttention on the rows and another
on the chunk's row, its else branch one on the rows and passes the chunk's row through. A decode step (the
common one) therefore runs one operator a layer, and a step with a chunk beside its decode rows still reads
the weights once. The branches hold no weights, only the operators and the reshapes around them, and the
If's K/V outputs are the buffers bound to them, so the operators still write in place.

fused_write_problems says whether such a graph may run with every present bound to its past's memory.
"""

from __future__ import annotations

import copy

import onnx
import onnxscript
from onnx import TensorProto, helper
from onnx.defs import OpSchema

from kvserve.contract import io_contract as io

MICROSOFT = "com.microsoft"
PLACEHOLDER_DOMAIN, PLACEHOLDER = "kvserve", "RowsAndChunkAttention"
_MICROSOFT = onnxscript.values.Opset(MICROSOFT, 1)
_KVSERVE = onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1)
_ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8}
_TABLE_INPUTS = (9, 10)  # the placeholder's cos and sin


def declare_operators() -> None:
    """onnx knows no schema for ONNX Runtime's contrib operators (nor for the placeholder), and the exporter emits a
    node only through one: this declares GroupQueryAttention's inputs, outputs and the attributes kvserve sets (ONNX
    Runtime's own definition has more optional ones, which keep their defaults), and the placeholder's."""
    if "GroupQueryAttention" in _MICROSOFT:
        return
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    heads = [OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "query heads"),
             OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, "K/V heads")]
    types = [("T", ["tensor(float)", "tensor(float16)"], "model dtype"), ("M", ["tensor(int32)"], "lengths"),
             ("T_CACHE", ["tensor(float)", "tensor(float16)", "tensor(int8)"], "K/V dtype"), ("S", ["tensor(float)"], "K/V scales")]
    inputs = [param("query", "T"), param("key", "T", param_option=optional), param("value", "T", param_option=optional),
              param("past_key", "T_CACHE", param_option=optional), param("past_value", "T_CACHE", param_option=optional),
              param("seqlens_k", "M"), param("total_sequence_length", "M"),
              param("cos_cache", "T", param_option=optional), param("sin_cache", "T", param_option=optional),
              param("position_ids", "I", param_option=optional), param("attention_bias", "T", param_option=optional),
              param("head_sink", "T", param_option=optional), param("k_scale", "S", param_option=optional),
              param("v_scale", "S", param_option=optional)]
    outputs = [param("output", "T"), param("present_key", "T_CACHE"), param("present_value", "T_CACHE")]
    rotary = [OpSchema.Attribute("do_rotary", OpSchema.AttrType.INT, "rotate Q and K by position", required=False),
              OpSchema.Attribute("local_window_size", OpSchema.AttrType.INT, "sliding window: positions a query sees, -1 all",
                                 required=False),
              OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "what Q.K is multiplied by; unset: head_size ** -0.5", required=False),
              OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, "scores soft-capped by tanh to this; 0: none", required=False)]
    quantized = [OpSchema.Attribute("k_quant_type", OpSchema.AttrType.STRING, "NONE, PER_TENSOR or PER_CHANNEL", required=False),
                 OpSchema.Attribute("v_quant_type", OpSchema.AttrType.STRING, "NONE, PER_TENSOR or PER_CHANNEL", required=False),
                 OpSchema.Attribute("kv_cache_bit_width", OpSchema.AttrType.INT, "8 or 4 for a quantized cache", required=False)]
    ids = [("I", ["tensor(int64)"], "token ids")]
    onnx.defs.register_schema(OpSchema("GroupQueryAttention", MICROSOFT, 1, inputs=inputs, outputs=outputs,
                                       type_constraints=types + ids, attributes=heads + rotary + quantized))
    inputs = [param(name, kind) for name, kind in (
        ("qkv", "T"), ("rows_key", "T_CACHE"), ("rows_value", "T_CACHE"), ("chunk_key", "T_CACHE"), ("chunk_value", "T_CACHE"),
        ("rows_last", "M"), ("rows_total", "M"), ("chunk_last", "M"), ("chunk_total", "M"), ("cos", "T"), ("sin", "T"),
        ("row_tokens", "I"), ("chunk_tokens", "I"))]
    inputs += [param("key_scale", "S", param_option=optional), param("value_scale", "S", param_option=optional)]
    outputs = [param("output", "T")] + [param(name, "T_CACHE") for name in ("rows_key_out", "rows_value_out", "chunk_key_out", "chunk_value_out")]
    onnx.defs.register_schema(OpSchema(PLACEHOLDER, PLACEHOLDER_DOMAIN, 1, inputs=inputs, outputs=outputs,
                                       type_constraints=types + ids, attributes=heads + rotary))


def rows_and_chunk_placeholder(qkv, rows_key, rows_value, chunk_key, chunk_value, rows_last, rows_total, chunk_last, chunk_total, cos,
                               sin, row_tokens, chunk_tokens, n_head: int, n_kv_head: int, rotary: bool, window: int, scale: float,
                               softcap: float, key_scale=None, value_scale=None):
    """kvserve::rows_and_chunk_attention as the placeholder node expand_rows_and_chunk_attention replaces. A window of w
    positions (the query's own included, as transformers counts) is the operator's local_window_size w: ONNX Runtime
    1.31's CPU kernel reads it so (the sliding-window parity tests fail at w - 1)."""
    scales = [] if key_scale is None else [key_scale, value_scale]  # an int8 cache's
    return _KVSERVE.RowsAndChunkAttention(qkv, rows_key, rows_value, chunk_key, chunk_value, rows_last, rows_total, chunk_last,
                                          chunk_total, cos, sin, row_tokens, chunk_tokens, *scales, num_heads=n_head, kv_num_heads=n_kv_head,
                                          do_rotary=int(rotary), local_window_size=-1 if window < 0 else window, scale=float(scale),
                                          softcap=float(softcap))


def _group_query_attention(query: str, past_key: str, past_value: str, last: str, total: str, cos: str, sin: str, outputs: list[str],
                           n_head: int, n_kv_head: int, rotary: int, local_window_size: int, scale: float, softcap: float,
                           kv_scales: list[str]) -> onnx.NodeProto:
    """The operator with packed unrotated QKV (B, S, (H + 2 H_kv) d_k), the rows as a shared past/present buffer,
    seqlens_k = each row's last position, rotary on (cos/sin tables given) or off (none), a sliding window or none (-1),
    a scale of its own or head_size ** -0.5 (0), soft-capped scores or not (0), and for an int8 cache its K and V scales
    per (K/V head, channel), each (1, H_kv, 1, d_k) (kvserve.model.kv_storage rounds as the operator does)."""
    tables = [cos, sin] if rotary else ["", ""]
    window = {"local_window_size": local_window_size} if local_window_size >= 0 else {}
    window |= {"scale": scale} if scale else {}
    window |= {"softcap": softcap} if softcap else {}
    quantized = []
    if kv_scales:
        quantized = ["", "", "", *kv_scales]  # position_ids, attention_bias and head_sink unset
        window |= {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
    return helper.make_node("GroupQueryAttention", [query, "", "", past_key, past_value, last, total, *tables, *quantized], outputs,
                            domain=MICROSOFT, name=outputs[0], num_heads=n_head, kv_num_heads=n_kv_head, do_rotary=rotary, **window)


def expand_rows_and_chunk_attention(model: onnx.ModelProto, dtype: str, kv_dtype: str | None = None) -> None:
    """Replace every placeholder node of model (in place) with the If described in the module docstring; its K/V are
    kv_dtype (the model's dtype when None)."""
    graph = model.graph
    elem, cache_elem = _ONNX_TYPES[dtype], _ONNX_TYPES[kv_dtype or dtype]
    shared: dict[tuple[str, str], tuple[list[onnx.NodeProto], dict[str, str]]] = {}
    initializers, passed = {i.name for i in graph.initializer}, {}
    nodes = []
    for node in graph.node:
        if (node.domain, node.op_type) != (PLACEHOLDER_DOMAIN, PLACEHOLDER):
            nodes.append(node)
            continue
        inputs = list(node.input)
        attrs = {a.name: a.i for a in node.attribute}
        n_head, n_kv_head = attrs["num_heads"], attrs["kv_num_heads"]
        floats = {a.name: a.f for a in node.attribute if a.type == onnx.AttributeProto.FLOAT}
        rotary = attrs.get("do_rotary", 1)
        local_window_size = attrs.get("local_window_size", -1)
        for i, name in enumerate(inputs):
            if name in initializers and (rotary or i not in _TABLE_INPUTS):  # referenced from the branches only, an initializer looks unused to graph tools
                if name not in passed:  # (onnxruntime.quantization drops such): a main-graph Identity keeps it in use
                    passed[name] = f"{name}/kvserve_fused"
                    nodes.append(helper.make_node("Identity", [name], [passed[name]]))
                inputs[i] = passed[name]
        qkv, rows_k, rows_v, chunk_k, chunk_v, rows_last, rows_total, chunk_last, chunk_total, cos, sin, row_tokens, chunk_tokens = inputs[:13]
        kv_scales = [name for name in inputs[13:15] if name]  # an int8 cache's K and V scales
        if (row_tokens, chunk_tokens) not in shared:  # the step's shapes, computed once for every layer
            shared[(row_tokens, chunk_tokens)] = _step_shapes(row_tokens, chunk_tokens, f"kvserve_fused_{len(shared)}")
            nodes += shared[(row_tokens, chunk_tokens)][0]
        shapes = shared[(row_tokens, chunk_tokens)][1]
        y, pk, pv, ck, cv = node.output
        p = f"{y}/"  # the If's own value names
        heads = (n_head, n_kv_head, rotary, local_window_size, floats.get("scale", 0.0), floats.get("softcap", 0.0), kv_scales)

        def flat(name: str, out: str) -> onnx.NodeProto:  # (B, S, H d_k) -> (B S, H d_k)
            return helper.make_node("Flatten", [name], [out], axis=2)

        then_nodes = [
            helper.make_node("Split", [qkv, shapes["split"]], [p + "rows_qkv", p + "chunk_qkv"], axis=0),  # (B S, .), (T, .)
            helper.make_node("Reshape", [p + "rows_qkv", shapes["rows"]], [p + "rows_qkv3"]),  # (B, S, (H + 2 H_kv) d_k)
            helper.make_node("Reshape", [p + "chunk_qkv", shapes["chunk"]], [p + "chunk_qkv3"]),  # (1, T, (H + 2 H_kv) d_k)
            _group_query_attention(p + "rows_qkv3", rows_k, rows_v, rows_last, rows_total, cos, sin, [p + "then_rows_y", p + "then_pk", p + "then_pv"], *heads),
            _group_query_attention(p + "chunk_qkv3", chunk_k, chunk_v, chunk_last, chunk_total, cos, sin, [p + "chunk_y", p + "then_ck", p + "then_cv"], *heads),
            flat(p + "then_rows_y", p + "then_rows_y2"),
            flat(p + "chunk_y", p + "chunk_y2"),
            helper.make_node("Concat", [p + "then_rows_y2", p + "chunk_y2"], [p + "then_y"], axis=0),  # (B S + T, H d_k)
        ]
        else_nodes = [
            helper.make_node("Reshape", [qkv, shapes["rows"]], [p + "else_qkv3"]),  # (B, S, (H + 2 H_kv) d_k)
            _group_query_attention(p + "else_qkv3", rows_k, rows_v, rows_last, rows_total, cos, sin, [p + "else_rows_y", p + "else_pk", p + "else_pv"], *heads),
            flat(p + "else_rows_y", p + "else_y"),
            helper.make_node("Identity", [chunk_k], [p + "else_ck"]),  # no chunk: its row passes through, bound to itself
            helper.make_node("Identity", [chunk_v], [p + "else_cv"]),
        ]

        def branch(tag: str, body: list[onnx.NodeProto]) -> onnx.GraphProto:
            outs = [helper.make_tensor_value_info(f"{p}{tag}_y", elem, None)]
            outs += [helper.make_tensor_value_info(f"{p}{tag}_{o}", cache_elem, None) for o in ("pk", "pv", "ck", "cv")]
            return helper.make_graph(body, f"{p}{tag}", [], outs)

        nodes.append(helper.make_node("If", [shapes["has_chunk"]], list(node.output), name=f"{y}/if",
                                      then_branch=branch("then", then_nodes), else_branch=branch("else", else_nodes)))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for n in _all_nodes(graph) for name in n.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)  # an unrotated step's empty cos/sin tables, read by nothing now
    imports = [o for o in model.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    if not any(o.domain == MICROSOFT for o in imports):
        imports.append(helper.make_opsetid(MICROSOFT, 1))
    del model.opset_import[:]
    model.opset_import.extend(imports)


def _step_shapes(row_tokens: str, chunk_tokens: str, prefix: str) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """Nodes computing, from the (B, S) row tokens and the (1, T) chunk: has_chunk (T > 0), split ([B S, T]), rows
    ([B, S, -1]) and chunk ([1, T, -1])."""
    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [f"{prefix}/{name}"], value=helper.make_tensor(f"{prefix}/{name}", TensorProto.INT64, [len(values)], values))

    n = lambda name: f"{prefix}/{name}"  # noqa: E731
    nodes = [
        const("minus_one", [-1]), const("one", [1]), const("zero", [0]),
        helper.make_node("Shape", [row_tokens], [n("rows_shape")]),  # (2,): B, S
        helper.make_node("Shape", [chunk_tokens], [n("chunk_length")], start=1, end=2),  # (1,): T
        helper.make_node("ReduceProd", [n("rows_shape")], [n("row_token_count")], keepdims=1),  # (1,): B S
        helper.make_node("Concat", [n("row_token_count"), n("chunk_length")], [n("split")], axis=0),
        helper.make_node("Concat", [n("rows_shape"), n("minus_one")], [n("rows")], axis=0),
        helper.make_node("Concat", [n("one"), n("chunk_length"), n("minus_one")], [n("chunk")], axis=0),
        helper.make_node("Greater", [n("chunk_length"), n("zero")], [n("has_chunk_1")]),
        helper.make_node("Squeeze", [n("has_chunk_1")], [n("has_chunk")]),  # (): the If's condition
    ]
    return nodes, {key: n(key) for key in ("split", "rows", "chunk", "has_chunk")}


def inline_branch(node: onnx.NodeProto, branch_name: str) -> list[onnx.NodeProto]:
    """Copies of the nodes of the attention If node's branch_name ("then_branch" or "else_branch"), the branch's outputs
    renamed to the If's: what runs in the If's place in a graph whose steps always take that branch."""
    branch = next(a.g for a in node.attribute if a.name == branch_name)
    renamed = {out.name: outer for out, outer in zip(branch.output, node.output)}  # the branch's outputs are the If's
    nodes = []
    for inner in branch.node:
        inner = copy.deepcopy(inner)
        for i, name in enumerate(inner.output):
            inner.output[i] = renamed.get(name, name)
        nodes.append(inner)
    return nodes


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)


def fused_write_problems(graph: onnx.GraphProto, n_layer: int) -> list[str]:
    """Why the fused graph is unsafe to run with each present (and chunk_present) bound to its past's memory; [] when
    it is safe: each is an output of an If whose branches produce it by the GroupQueryAttention whose past_key /
    past_value is that past (or, chunk rows in the else branch, an Identity of it), and nothing else reads the past's
    values (a reader scheduled after the write would see this step's K/V). Reading only its shape is harmless."""
    producers = {out: node for node in graph.node for out in node.output}
    pairs = [(io.past_names(layer), io.present_names(layer), False) for layer in range(n_layer)]
    pairs += [(io.chunk_past_names(layer), io.chunk_present_names(layer), True) for layer in range(n_layer)]
    problems = []
    for pasts, presents, is_chunk in pairs:
        for slot, (past, present) in enumerate(zip(pasts, presents)):  # slot 0: key, 1: value
            writer = producers.get(present)
            if writer is None or writer.op_type != "If":
                problems.append(f"{present} is not written by a layer's attention If")
                continue
            index = list(writer.output).index(present)
            allowed = []
            for attr in writer.attribute:
                out = attr.g.output[index].name
                node = next((n for n in attr.g.node if out in n.output), None)
                if is_chunk and attr.name == "else_branch":
                    ok = node is not None and node.op_type == "Identity" and node.input[0] == past
                else:
                    ok = (node is not None and node.op_type == "GroupQueryAttention" and node.input[3 + slot] == past
                          and node.output[1 + slot] == out)
                if not ok:
                    problems.append(f"{present} is not a GroupQueryAttention into {past} in the If's {attr.name}")
                allowed.append(node)
            readers = [n.op_type for n in _all_nodes(graph) if past in n.input and n.op_type != "Shape" and not any(n is a for a in allowed)]
            if readers:
                problems.append(f"{past} is also read by {', '.join(readers)}")
    return problems
