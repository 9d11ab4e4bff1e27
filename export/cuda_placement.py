"""Where ONNX Runtime's CUDA provider would run a graph's shape arithmetic, read from the graph alone (no GPU needed),
and whether a step of it can be captured as a CUDA graph.

ONNX Runtime captures a session's steps only when every compute node runs on the CUDA provider and no Memcpy node
was inserted (inference_session.cc). Nodes reading shapes are the exception it allows: Shape's output lives in host
memory, and ONNX Runtime moves a node whose inputs are all such host tensors, constants or graph inputs onto the CPU
("the CPU execution path is deemed faster", fallback_cpu_capability.cc), so a chain of shape arithmetic runs on the
CPU. That is harmless while the chain ends at an input a CUDA kernel reads from host memory (a Reshape's shape, an
Expand's shape, a Slice's bounds): ONNX Runtime hands it over without a copy, and a replayed graph needs no such
value again at its captured shape. It is fatal when the chain reaches a CUDA kernel's data (an arange used as
indices, zeros made to a tensor's shape): a Memcpy is inserted and capture is refused.

capture_blockers simulates that placement on the graph's nodes and names every host-to-device edge it would need, and
every device tensor a kernel wants in host memory (GroupQueryAttention's total length computed on the device);
it also names operators whose CUDA kernels read their inputs back to the host themselves (Range copies start,
limit and delta off the device) and control flow (the fused graph's If over an empty chunk), which a capture cannot
hold either. Checked on the exported graph: ONNX Runtime's own optimizations only fold shape arithmetic further.

empty_reductions reads what a graph's run on the CPU provider handed each reduction (ONNX Runtime's profile of it) and
names those the CUDA kernels would refuse: a reduction of an empty tensor, which a step without a prompt chunk makes
of every chunk tensor. scatter_probe and repeated_writes do the same for the K/V scatters: a step that writes a cell
twice is the CPU's last write there, and any of them on CUDA.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

# Outputs the CUDA provider's kernels leave in host memory.
HOST_OUTPUTS = {"Shape": {0}, "Size": {0}}
# Inputs the CUDA provider's kernels read from host memory (their KernelDefBuilder's InputMemoryType(OrtMemTypeCPUInput)).
HOST_INPUTS = {
    "Reshape": {1}, "Expand": {1}, "ConstantOfShape": {0}, "Slice": {1, 2, 3, 4}, "Split": {1}, "Squeeze": {1},
    "Unsqueeze": {1}, "Tile": {1}, "TopK": {1}, "CumSum": {1}, "ReduceSum": {1}, "ReduceMax": {1}, "ReduceMin": {1},
    "ReduceMean": {1}, "Pad": {1, 2, 3}, "Clip": {1, 2}, "OneHot": {1}, "Resize": {1, 2, 3}, "If": {0}, "Loop": {0, 1},
    "GroupQueryAttention": {6},  # total_sequence_length
}
# CUDA kernels that copy an input to the host inside the step (a synchronising copy no capture holds).
READS_BACK = {"Range", "NonZero"}
# Control flow: ONNX Runtime refuses to capture a graph holding any (inference_session.cc).
CONTROL_FLOW = {"If", "Loop", "Scan"}
# ONNX Runtime never moves a node with inputs of these types to the CPU (fallback_cpu_capability.cc).
DEVICE_ONLY_TYPES = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _value_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {}
    for info in list(graph.value_info) + list(graph.input) + list(graph.output):
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    for tensor in graph.initializer:
        types[tensor.name] = tensor.data_type
    return types


def capture_blockers(model: onnx.ModelProto) -> list[str]:
    """Why ONNX Runtime would refuse to capture model's steps as CUDA graphs, one line per cause (empty: none found):
    each node moved to the CPU whose output a CUDA kernel reads as data (a Memcpy), and each kernel that reads its
    inputs back to the host."""
    graph = onnx.shape_inference.infer_shapes(model, data_prop=False).graph
    types = _value_types(graph)
    constants = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    graph_inputs = {i.name for i in graph.input}
    host: set[str] = set()  # tensors in host memory
    problems = []
    for node in graph.node:  # exported graphs are topologically sorted
        if node.op_type in CONTROL_FLOW:
            problems.append(f"{node.op_type} {node.name}: control flow, which CUDA graphs cannot hold")
        if node.op_type in READS_BACK:
            problems.append(f"{node.op_type} {node.name}: its CUDA kernel copies its inputs to the host")
        reads_host = [i for i, name in enumerate(node.input) if name in host]
        for i in HOST_INPUTS.get(node.op_type, set()) - set(reads_host):
            name = node.input[i] if i < len(node.input) else ""
            if name and name not in constants and name not in graph_inputs:
                problems.append(f"{node.op_type} {node.name}: reads device tensor {name} from host memory (a Memcpy to the host)")
        if node.op_type in HOST_OUTPUTS:
            host.update(node.output[i] for i in HOST_OUTPUTS[node.op_type] if i < len(node.output))
            continue
        if not reads_host:
            continue
        host_inputs = HOST_INPUTS.get(node.op_type, set())
        movable = all(
            (name in host and i not in host_inputs) or name in constants or name in graph_inputs or name == ""
            for i, name in enumerate(node.input)
        ) and not any(types.get(name) in DEVICE_ONLY_TYPES for name in node.input)
        if movable and not all(i in host_inputs for i in reads_host):  # moved to the CPU: its outputs are host tensors
            host.update(node.output)
            fed = [name for name in node.input if name in graph_inputs]
            if fed:
                problems.append(f"{node.op_type} {node.name}: moved to the CPU with graph input {fed[0]} (a copy to the host)")
            continue
        for i in reads_host:
            if i not in host_inputs:
                problems.append(f"{node.op_type} {node.name}: reads host tensor {node.input[i]} as data (a Memcpy to the device)")
    return problems


# Reductions whose CUDA kernels refuse a zero-length axis unless keepdims is set ("Can't reduce on dim with value of 0",
# reduction_ops.cc in onnxruntime-gpu 1.31), and with it answer an empty tensor where the CPU kernels answer the
# reduction's identity (a sum of nothing is 0 on the CPU, a failed step on the GPU).
EMPTY_REFUSED = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                 "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"}


def empty_reductions(profile: list[dict]) -> list[str]:
    """The reductions a run made values from nothing in (an empty input, an output that is not), read from ONNX
    Runtime's profile of it on any provider (each node's input and output shapes): what the CPU provider computes and
    the CUDA provider refuses or leaves empty. One line per node, however many runs. (A reduction of an empty input to
    an empty output is not named: both providers give nothing, though CUDA refuses it where a reduced axis is the
    empty one and keepdims is 0.)"""
    found = {}
    for event in profile:
        args = event.get("args", {})
        if event.get("cat") != "Node" or args.get("op_name") not in EMPTY_REFUSED or not args.get("input_type_shape"):
            continue
        (read,) = args["input_type_shape"][0].values()  # the data input: {element type: dims}
        (made,) = args["output_type_shape"][0].values()
        if 0 in read and 0 not in made:
            node = event["name"].removesuffix("_kernel_time")
            found.setdefault(node, f"{args['op_name']} {node}: reduces an empty input {read} to {made or 'a scalar'}, which the CUDA provider refuses")
    return list(found.values())


def scatter_probe(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[tuple[str, str, str]]]:
    """model with each ScatterND's indices and its data's shape as outputs too, so a run shows where each step writes:
    (the probe, [(node name, its indices' output, its data shape's output)]). The model is changed in place."""
    probes = []
    for node in [n for n in model.graph.node if n.op_type == "ScatterND"]:
        shape = f"{node.name}_probe_data_shape"
        model.graph.node.append(helper.make_node("Shape", [node.input[0]], [shape], name=f"{node.name}_probe_shape"))
        model.graph.output.extend([helper.make_tensor_value_info(node.input[1], TensorProto.INT64, None),
                                   helper.make_tensor_value_info(shape, TensorProto.INT64, None)])
        probes.append((node.name, node.input[1], shape))
    return model, probes


def repeated_writes(node: str, indices: np.ndarray, data_shape) -> str | None:
    """Where one ScatterND writes a cell more than once (indices (..., k) into data of data_shape), outside the last
    column of a K/V pool (dimension 2 of (rows, heads, columns, d_k), the scratch column, which nothing reads): the CPU
    provider keeps the last write and the CUDA provider any of them ("ScatterND with reduction=='none' only guarantees
    to be correct if indices are not duplicated", its kernel says). None where every such cell is written once."""
    cells = indices.reshape(-1, indices.shape[-1])  # (M, k)
    if len(cells) < 2:
        return None
    unique, counts = np.unique(cells, axis=0, return_counts=True)
    repeated = unique[counts > 1]
    if cells.shape[1] >= 3:
        repeated = repeated[repeated[:, 2] != data_shape[2] - 1]
    if not len(repeated):
        return None
    return (f"ScatterND {node}: writes {len(repeated)} cell(s) of data {[int(d) for d in data_shape]} more than once, e.g. "
            f"{repeated[0].tolist()}, whose value the CUDA provider leaves to chance")
