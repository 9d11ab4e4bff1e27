"""Weight quantization: a step of the export pipeline that rewrites an exported float32 graph's weight matrices
to 8 or 4 bits, leaving its inputs, outputs and KV contract exactly as they were.

Schemes (chosen by measurement, bench/int8_decode.py and bench/decode_floor.py; docs/parity.md, "Int8" and "Int4"):
  int8          com.microsoft.MatMulNBits, 8-bit symmetric blocks of input rows per output column (BLOCKS),
                each with its own float scale; accuracy level 4 lets the CPU kernel multiply in int8 (VNNI/AMX),
                each row's activations quantized on their own (a row's numbers never depend on its neighbours).
  int4          the same operator with 4-bit weights, but for attention's projections (Q/K/V, W_O), which stay in
                int8's 8 bits (ATTENTION_IN_8_BITS): a decode step reads 55-73% of int8's bytes (qwen2.5-0.5b,
                qwen3-0.6b, whose attention is 9% and 30% of their weights); an untied model's LM head and token
                embedding stay in 8 bits too (VOCABULARY_IN_8_BITS).
  int8-dynamic  MatMulInteger with per-output-channel int8 weights and activations quantized per call
                (DynamicQuantizeLinear). Kept for the comparison; not offered by the CLI.
Every MatMul whose second input is a weight is quantized, the tied LM head included: the graph multiplies by
Transpose(wte), which is folded into a weight of its own here, and a Gemm with a weight (a linear layer on 2-D rows, as
the Llama family's slots step runs them) becomes a MatMul first. Where the head is tied, the embedding lookup then
reads the head's quantized blocks too (com.microsoft.GatherBlockQuantized: a row's blocks dequantized as it is
gathered), so the table is stored once, in 8 or 4 bits, instead of a float32 copy beside the quantized head (for
Qwen3-0.6B's 151,936 x 1,024 table, 622 MB of float32). An untied model's embedding is quantized on its own, in int8's
bits and blocks (for int4 too: VOCABULARY_IN_8_BITS), and read the same way (quantize_untied_tables).
"""

from __future__ import annotations

import collections
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from kvserve.contract.io_contract import LOGITS, QUANTIZATIONS

from .graph_fusions import MICROSOFT, fuse_operators
from kvserve.model.weights import row_blocks

from .weight_plan import WeightPlan, is_pending, materialize

SCHEMES = QUANTIZATIONS  # what `kvserve export --quantize` offers
# (bits, block size) per MatMulNBits scheme. A block is that many input rows of one output column sharing a scale;
# bigger blocks read fewer scales and the CPU kernel rescales less often, smaller ones follow the weights closer.
# Chosen by bench/quantize_blocks.py, bench/decode_floor.py and verify (docs/parity.md, "Block sizes" and "Int4"): int4
# in blocks of 256 failed parity on the Qwen3-0.6B shape and, its table shared, moved the trained model's perplexity by
# 2.7% of the 3% it is allowed; with attention's projections in 8 bits (below), blocks of 64 held the trained model to
# +1.45% (32: +1.35%) and stepped 5-6% faster than 32, and blocks of 128 step 11-19% faster again (qwen3-0.6b and
# qwen2.5-0.5b, batch 1 and 16) with every export still passing verify (qwen2.5-0.5b's text mean KL 4.4e-2 of 5e-2, the
# trained model's perplexity x1.0088 on verify's text): fewer bytes a weight than q4_0 (4 bits and a float32 scale per
# 128 against a float16 scale per 32).
BLOCKS = {"int8": (8, 256), "int4": (4, 128)}
# int4 keeps attention's projections (Q/K/V and W_O) in int8's bits and blocks. 4-bit error comes from every matrix and
# grows with depth, but per weight attention's carry the most (bench/int4_error_sources.py, docs/parity.md "Int4": on
# the Qwen2.5-0.5B shape they are 9% of the weights and half of int4's KL, which pushed its 24 layers past the bounds);
# the CPU kernel multiplies an 8-bit weight about as fast as a 4-bit one, so the step's time hardly moves.
ATTENTION_IN_8_BITS = {"int4"}
ATTENTION_WEIGHT = "attn."  # in the weight's name: the module path of every decoder here (self_attn., GPT-2's attn.)
# int4 keeps an untied model's vocabulary matrices in 8 bits too, whatever --attention-bits says. The LM head: every
# logit is a dot product with one of its rows and no later layer smooths its rounding (llama.cpp's Q4_0 keeps its output
# matrix in 6-bit Q6_K for that). The token embedding: a lookup reads one row a token, so its bits cost bytes held, not
# step time. On the Llama-3.1-8B shape's first 2 layers (random weights, the residual stream quieted) verify's mean KL
# was 0.060 with both in 4 bits and 0.025 with both in 8 (bench/large_export.py; bench/results/cpu-2core.md, "Untied
# vocabulary matrices"). A tied table stays in the scheme's bits: it is the head too, read whole every step, and at 8 bits
# it would be a large share of a small model's step.
VOCABULARY_IN_8_BITS = {"int4"}
HEAD_WEIGHT = "lm_head."  # in an untied head's weight name (transformers' module name, which the Llama family keeps)
ACCURACY_LEVEL = 4  # MatMulNBits: int8 arithmetic on the CPU provider (the 4-bit weights are widened to 8 in the kernel)


class QuantizeError(RuntimeError):
    """The graph could not be quantized as asked (an unknown scheme, nothing to quantize)."""


def fold_weight_transposes(model: onnx.ModelProto, plan: WeightPlan | None = None) -> int:
    """Replace MatMul(x, Transpose(W)) with MatMul(x, W^T) for a 2-D initializer W, so the weight is an
    initializer a quantizer can rewrite (a pending W's transpose is pending too). Returns how many were folded."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    folded = 0
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in initializers:
            continue
        weight = initializers[node.input[0]]
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        readers = consumers.get(node.output[0], [])
        if len(weight.dims) != 2 or perm != [1, 0] or not readers or any(r.op_type != "MatMul" or r.input[1] != node.output[0] for r in readers):
            continue
        if plan is not None and is_pending(weight):
            transposed = plan.transposed(f"{weight.name}.T", weight.name)  # (in, out)
        else:
            transposed = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), f"{weight.name}.T")  # (in, out)
        graph.initializer.append(transposed)
        for reader in readers:
            reader.input[1] = transposed.name
        graph.node.remove(node)
        folded += 1
    return folded


# Rows of a weight transposed at a time: a block's rows and columns stay in the caches (numpy's whole-array transpose of
# gemma3-1b's 262,144 x 1,152 table took 5.9 s, in blocks of 1,024 rows 0.8 s: timed by hand, 2-core Xeon VM).
TRANSPOSE_ROWS = 1024


def _transposed(weight: np.ndarray) -> np.ndarray:
    """weight (R, C) -> a contiguous (C, R) copy, a block of rows at a time."""
    out = np.empty(weight.shape[::-1], weight.dtype)  # (C, R)
    for start in range(0, weight.shape[0], TRANSPOSE_ROWS):
        out[:, start : start + TRANSPOSE_ROWS] = weight[start : start + TRANSPOSE_ROWS].T
    return out


def gemms_to_matmuls(model: onnx.ModelProto, plan: WeightPlan | None = None) -> int:
    """Replace Gemm(x, W, b) with a float weight W (what a linear layer on 2-D rows exports as: the Llama family's
    slots step) by MatMul(x, W as (in, out)) + b, the form the quantizers rewrite (a pending W's (in, out) form is
    pending too: the plan's transpose, never computed whole when it is quantized). Returns how many."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    readers = collections.Counter(name for node in graph.node for name in node.input)
    replaced = 0
    for index, node in reversed(list(enumerate(graph.node))):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0 and not attributes.get("transA", 0)
        if node.op_type != "Gemm" or node.input[1] not in initializers or not plain:
            continue
        name = f"{node.input[1]}.matmul"
        init = initializers[node.input[1]]
        if plan is not None and is_pending(init):
            as_matmul = (plan.transposed if attributes.get("transB", 0) else plan.alias)(name, init.name)  # (in, out)
            if readers[node.input[1]] == 1:
                init.name = name
                init.dims[:] = as_matmul.dims
            else:
                graph.initializer.append(as_matmul)
        else:
            weight = numpy_helper.to_array(init)
            if attributes.get("transB", 0):
                weight = _transposed(weight)  # (out, in) -> (in, out)
            if readers[node.input[1]] == 1:  # rewritten where it lies: appending a copy of a 1.2 GB table took seconds
                init.ClearField("float_data")
                init.name, init.raw_data = name, weight.tobytes()
                init.dims[:] = weight.shape
            else:  # also read elsewhere (a tied table's lookup): a copy beside it
                graph.initializer.append(numpy_helper.from_array(weight, name))
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}.product" if has_bias else node.output[0]
        replacement = [onnx.helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}.matmul")]
        if has_bias:
            replacement.append(onnx.helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}.bias"))
        del graph.node[index]
        for offset, new in enumerate(replacement):
            graph.node.insert(index + offset, new)
        replaced += 1
    used = {name for node in graph.node for name in node.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)  # the (out, in) originals, now read by nothing
    return replaced


def share_tied_table(model: onnx.ModelProto, plan: WeightPlan | None = None) -> int:
    """Replace each Gather on a float table whose transposed copy became a MatMulNBits weight (the tied LM head: named
    "<table>.<suffix>_Q<bits>" by the quantizer) with a GatherBlockQuantized reading that weight's blocks, and drop the
    float table. Returns how many tables are now shared."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    heads = {}  # table name -> the MatMulNBits that multiplies by it
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.input[1] in initializers:
            source = node.input[1].rsplit("_Q", 1)[0].rsplit(".", 1)[0]  # "<table>.matmul_Q4" -> "<table>"
            heads[source] = node
    shared = 0
    for node in list(graph.node):
        if node.op_type != "Gather" or node.input[0] not in initializers or node.input[0] not in heads:
            continue
        table, head = initializers[node.input[0]], heads[node.input[0]]
        if len(table.dims) != 2:
            continue
        attributes = {a.name: a.i for a in head.attribute}
        vocab, width = table.dims
        if (attributes["N"], attributes["K"]) != (vocab, width) or len(head.input) > 3 and head.input[3]:
            continue  # not this table's transpose, or an asymmetric head (zero points) the lookup would have to share too
        scales = _array(initializers[head.input[2]], plan)
        _gather_blocks(graph, node, head.input[1], scales.reshape(vocab, -1, 1), attributes["bits"], attributes["block_size"], width)
        graph.initializer.remove(initializers[node.input[0]])
        shared += 1
    return shared


def _array(tensor: onnx.TensorProto, plan: WeightPlan | None) -> np.ndarray:
    """An initializer's values, a pending one's produced by the plan."""
    return plan.array(tensor.name) if plan is not None and is_pending(tensor) else numpy_helper.to_array(tensor)


def _gather_blocks(graph: onnx.GraphProto, node: onnx.NodeProto, data: str, scales: np.ndarray | onnx.TensorProto, bits: int, block_size: int,
                   width: int) -> None:
    """Replace the Gather node (in place in graph) with a GatherBlockQuantized of the (V, blocks, block bytes) uint8
    blocks named data, with scales (V, blocks, 1) (an array, or the pending initializer named for the node), and the
    reshape (and cut, where the last block is padded) back to (N, width) rows."""
    if isinstance(scales, np.ndarray):
        scales = numpy_helper.from_array(scales.astype(np.float32), f"{node.name}.scales")  # (V, blocks, 1)
    blocks, scales_3d = scales.dims[1], scales
    graph.initializer.append(scales_3d)
    rows = f"{node.output[0]}.blocks"
    lookup = onnx.helper.make_node("GatherBlockQuantized", [data, node.input[1], scales_3d.name], [rows], name=f"{node.name}.quantized",
                                   domain="com.microsoft", bits=bits, block_size=block_size, gather_axis=0, quantize_axis=2)
    width_shape = numpy_helper.from_array(np.array([-1, blocks * block_size], np.int64), f"{node.name}.width")
    graph.initializer.append(width_shape)
    flat = onnx.helper.make_node("Reshape", [rows, width_shape.name], [f"{node.output[0]}.padded" if blocks * block_size != width else node.output[0]],
                                 name=f"{node.name}.rows")  # (N, blocks, block) -> (N, blocks * block)
    replacement = [lookup, flat]
    if blocks * block_size != width:  # the last block padded past the table's width: cut back to it
        starts, ends, axes = (numpy_helper.from_array(np.array([v], np.int64), f"{node.name}.{n}") for n, v in (("start", 0), ("end", width), ("axis", 1)))
        graph.initializer.extend([starts, ends, axes])
        replacement.append(onnx.helper.make_node("Slice", [flat.output[0], starts.name, ends.name, axes.name], [node.output[0]], name=f"{node.name}.cut"))
    position = list(graph.node).index(node)
    graph.node.remove(node)
    for offset, new in enumerate(replacement):
        graph.node.insert(position + offset, new)


def block_quantize(table: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A (V, C) float table in symmetric blocks of block_size along C, as GatherBlockQuantized reads them: the
    (V, blocks, block_size * bits / 8) uint8 values (the signed value plus 2^(bits - 1), two to a byte for 4 bits, the
    low nibble first; the last block padded with zeros) and the (V, blocks, 1) float32 scales (a block's largest |value|
    over 2^(bits - 1) - 1)."""
    vocab, width = table.shape
    blocks = -(-width // block_size)
    padded = np.zeros((vocab, blocks * block_size), np.float32)
    padded[:, :width] = table
    x = padded.reshape(vocab, blocks, block_size)  # (V, blocks, block)
    largest = 2 ** (bits - 1) - 1
    scales = np.abs(x).max(-1, keepdims=True) / largest  # (V, blocks, 1)
    safe = np.where(scales > 0, scales, 1.0)
    values = (np.clip(np.rint(x / safe), -largest, largest) + 2 ** (bits - 1)).astype(np.uint8)  # (V, blocks, block)
    if bits == 4:
        values = values[..., 0::2] | (values[..., 1::2] << 4)  # (V, blocks, block / 2)
    return np.ascontiguousarray(values), scales.astype(np.float32)


def quantize_untied_tables(model: onnx.ModelProto, bits: int, block_size: int, plan: WeightPlan | None = None) -> int:
    """Replace each Gather on a float (vocabulary, width) table (an untied model's token embedding; a tied one is
    share_tied_table's) with a GatherBlockQuantized of its own bits-bit blocks, and drop the float table. The vocabulary
    is the logits output's last axis: a position table (GPT-2's wpe) is not one. Returns how many tables."""
    graph = model.graph
    logits = next(o for o in graph.output if o.name == LOGITS)
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    initializers = {init.name: init for init in graph.initializer}
    quantized = 0
    for node in list(graph.node):
        table = initializers.get(node.input[0]) if node.op_type == "Gather" else None
        if table is None or len(table.dims) != 2 or table.dims[0] != vocab or table.data_type != onnx.TensorProto.FLOAT:
            continue
        if plan is not None and is_pending(table):
            data, scales = _pending_table_blocks(plan, table, f"{table.name}_Q{bits}.lookup", f"{node.name}.scales", bits, block_size)
        else:
            values, scales = block_quantize(numpy_helper.to_array(table), bits, block_size)
            data = numpy_helper.from_array(values, f"{table.name}_Q{bits}.lookup")
        graph.initializer.append(data)
        _gather_blocks(graph, node, data.name, scales, bits, block_size, table.dims[1])
        graph.initializer.remove(table)
        quantized += 1
    return quantized


class _Quantized:
    """Two pending initializers made by one pass over a weight's blocks of rows (the blocks, then their scales, as the
    graph lists and the writer writes them): the first's producer keeps each block's scales for the second, which runs
    the pass itself if asked first."""

    def __init__(self, passes):
        self.passes = passes  # () -> iterator of (values block, scales block)
        self.kept: list[np.ndarray] | None = None

    def values(self):
        kept = []
        for values, scales in self.passes():
            kept.append(scales)
            yield values
        self.kept = kept

    def scales(self):
        if self.kept is None:
            for _ in self.values():
                pass
        kept, self.kept = self.kept, None
        yield from kept


def _pending_table_blocks(plan: WeightPlan, table: onnx.TensorProto, data_name: str, scales_name: str, bits: int,
                          block_size: int) -> tuple[onnx.TensorProto, onnx.TensorProto]:
    """block_quantize of a pending (V, C) table, a block of rows at a time: its pending values and scales."""
    vocab, width = table.dims
    blocks = -(-width // block_size)

    def passes():
        for start, stop in row_blocks(vocab, width * 4):
            yield block_quantize(plan.rows(table.name, start, stop), bits, block_size)

    quantized = _Quantized(passes)
    data = plan.add(data_name, np.uint8, (vocab, blocks, block_size * bits // 8), quantized.values)
    return data, plan.add(scales_name, np.float32, (vocab, blocks, 1), quantized.scales)


def _nbits_quantize(model: onnx.ModelProto, plan: WeightPlan, bits: int, block_size: int, exclude: list[str]) -> None:
    """What onnxruntime's MatMulNBitsQuantizer (DEFAULT, QOperator, symmetric) makes of model, node for node and byte for
    byte, its weights pending: each quantized by the same kernel a block of output columns at a time (a column's blocks
    depend on that column alone), from the rows of the weight it transposes, so no weight is held whole."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    wrapped = ONNXModel(model)
    wrapped.set_opset_import(MICROSOFT, 1)
    _nbits_graph([model.graph], plan, bits, block_size, set(exclude))
    wrapped.clean_initializers()


def _nbits_graph(stack: list[onnx.GraphProto], plan: WeightPlan, bits: int, block_size: int, exclude: set[str]) -> onnx.GraphProto:
    from onnxruntime.quantization.quant_utils import attribute_to_kwarg

    graph, rewritten = stack[-1], []
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            kwargs = {}
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    kwargs[attr.name] = _nbits_graph([*stack, attr.g], plan, bits, block_size, exclude)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    kwargs[attr.name] = [_nbits_graph([*stack, g], plan, bits, block_size, exclude) for g in attr.graphs]
                else:
                    kwargs.update(attribute_to_kwarg(attr))
            node = onnx.helper.make_node(node.op_type, node.input, node.output, name=node.name, **kwargs)  # as the quantizer rebuilds it
        quantizable = node.op_type == "MatMul" and node.name not in exclude
        rewritten.extend(_nbits_matmul(node, stack, plan, bits, block_size) if quantizable else [node])
    graph.ClearField("node")
    graph.node.extend(rewritten)
    return graph


def _nbits_matmul(node: onnx.NodeProto, stack: list[onnx.GraphProto], plan: WeightPlan, bits: int, block_size: int) -> list[onnx.NodeProto]:
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    found = next(((t, g) for g in reversed(stack) for t in g.initializer if t.name == node.input[1]), None)
    if found is None or len(found[0].dims) != 2:
        return [node]
    weight, owner = found
    rows, cols = weight.dims  # (K, N)
    pack = 8 // bits
    blocks, blob = -(-rows // block_size), (block_size + pack - 1) // pack
    kernel = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    inline = None if is_pending(weight) else numpy_helper.to_array(weight)  # (K, N): a small graph's weight in the graph

    def passes():
        for start, stop in row_blocks(cols, rows * 4):  # output columns: rows of the (N, K) weight this one transposes
            columns = plan.columns(weight.name, start, stop) if inline is None else inline[:, start:stop]
            columns = np.pad(np.ascontiguousarray(columns, np.float32), ((0, blocks * block_size - rows), (0, 0)))  # (K padded, n)
            packed = np.zeros((stop - start, blocks, blob), np.uint8)
            scales = np.zeros((stop - start, blocks), np.float32)
            kernel(packed, columns, scales, np.zeros((stop - start, (blocks + pack - 1) // pack), np.uint8), block_size, stop - start, rows, True)
            yield packed, scales

    quantized = _Quantized(passes)
    owner.initializer.extend([plan.add(f"{weight.name}_Q{bits}", np.uint8, (cols, blocks, blob), quantized.values),
                              plan.add(f"{weight.name}_scales", np.float32, (cols, blocks), quantized.scales)])
    for value in owner.input:
        if value.name == weight.name:
            owner.input.remove(value)
            break
    return [onnx.helper.make_node("MatMulNBits", [node.input[0], f"{weight.name}_Q{bits}", f"{weight.name}_scales"], [node.output[0]],
                                  name=f"{node.name}_Q{bits}" if node.name else "", domain=MICROSOFT, K=rows, N=cols, bits=bits,
                                  block_size=block_size, accuracy_level=ACCURACY_LEVEL or None)]


def weight_matmuls(model: onnx.ModelProto) -> int:
    initializers = {init.name for init in model.graph.initializer}
    return sum(1 for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers)


def named_weight_matmuls(model: onnx.ModelProto, part: str) -> list[str]:
    """The names of the weight MatMuls whose weight's name holds `part`: ATTENTION_WEIGHT finds the ones that project
    attention's Q/K/V or mix its heads (W_O), HEAD_WEIGHT an untied LM head's (a tied head's weight is the embedding's)."""
    initializers = {init.name for init in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers and part in n.input[1]]


def quantize_model(model: onnx.ModelProto, scheme: str, block_size: int | None = None, plan: WeightPlan | None = None,
                   attention_bits: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """The quantized graph and what the manifest records about it; block_size overrides the scheme's (BLOCKS) for a
    MatMulNBits scheme (bench/quantize_blocks.py compares them). With a plan, the graph's pending weights stay pending:
    what they are quantized to is the plan's, produced as save_graph writes it (int8-dynamic, quantized by
    onnxruntime's file-based quantizer, takes the weights into memory first). attention_bits: an int4 scheme's attention
    projections' (io_contract.ATTENTION_BITS; 8 unless 4 is given)."""
    if plan is not None and scheme not in BLOCKS:
        materialize(model, plan)
        plan = None
    fold_weight_transposes(model, plan)
    gemms_to_matmuls(model, plan)
    count = weight_matmuls(model)
    if count == 0:
        raise QuantizeError("the graph has no weight MatMul to quantize")
    fused = fuse_operators(model)  # again: the bias Adds the Gemms left fold into the fused kernels before MatMul becomes MatMulNBits
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    if scheme in BLOCKS:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        bits, default_block = BLOCKS[scheme]
        block_size = block_size or default_block
        attention = named_weight_matmuls(model, ATTENTION_WEIGHT) if scheme in ATTENTION_IN_8_BITS and attention_bits != 4 else []
        head = named_weight_matmuls(model, HEAD_WEIGHT) if scheme in VOCABULARY_IN_8_BITS else []
        if "" in attention + head:
            raise QuantizeError("an attention projection's or the LM head's MatMul has no name to keep it in 8 bits by")
        def nbits(graph: onnx.ModelProto, bits: int, block_size: int, exclude: list[str]) -> onnx.ModelProto:
            if plan is not None:
                _nbits_quantize(graph, plan, bits, block_size, exclude)
                return graph
            quantizer = MatMulNBitsQuantizer(graph, bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=ACCURACY_LEVEL,
                                             nodes_to_exclude=exclude)
            quantizer.process()
            return quantizer.model.model

        quantized = nbits(model, bits, block_size, attention + head)
        facts = {"scheme": scheme, "op": "com.microsoft.MatMulNBits", "bits": bits, "block_size": block_size, "symmetric": True,
                 "accuracy_level": ACCURACY_LEVEL}
        wide_bits, wide_block = BLOCKS["int8"]
        if attention + head:
            quantized = nbits(quantized, wide_bits, wide_block, [])  # the weight MatMuls the first pass left: attention's, the head's
        if attention:
            facts |= {"attention_bits": wide_bits, "attention_block_size": wide_block, "attention_matmuls": len(attention)}
        elif scheme in ATTENTION_IN_8_BITS:  # asked for 4: attention's projections went with the rest
            facts |= {"attention_bits": bits}
        if head:
            facts |= {"head_bits": wide_bits, "head_block_size": wide_block}
        table_bits, table_block = (wide_bits, wide_block) if scheme in VOCABULARY_IN_8_BITS else (bits, block_size)
        facts |= {"shared_embedding": share_tied_table(quantized, plan) > 0,
                  "quantized_embedding": quantize_untied_tables(quantized, table_bits, table_block, plan) > 0}
        if facts["quantized_embedding"]:
            facts |= {"embedding_bits": table_bits, "embedding_block_size": table_block}
    elif scheme == "int8-dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.WARNING)  # it logs a line per tensor at INFO on the root logger
        try:
            with tempfile.TemporaryDirectory() as tmp:  # quantize_dynamic works on files
                source, target = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
                onnx.save_model(model, str(source), save_as_external_data=True, location="in.onnx.data")
                quantize_dynamic(source, target, op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8,
                                 use_external_data_format=True)
                quantized = onnx.load(str(target))
        finally:
            root.setLevel(level)
        facts = {"scheme": scheme, "op": "MatMulInteger", "bits": 8, "per_channel": True, "symmetric": True}
    else:
        raise QuantizeError(f"unknown quantization {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    left = weight_matmuls(quantized)
    if left:
        raise QuantizeError(f"{left} of {count} weight MatMuls were left in float32")
    return quantized, {**facts, "weight_matmuls": count, "fused_operators": fused}
