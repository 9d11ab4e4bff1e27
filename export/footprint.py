"""What one decode step of an exported graph must read from memory: the floor its time is held to.

Every initializer a step computes with whole (MatMul and MatMulNBits weights with their scales and zero points,
norms, biases, a tied LM head's table) is read once a step whatever the batch; a table only looked up by Gather
(the position embedding, an untied token embedding, in float or in 8- or 4-bit blocks) is read a row per token; and each row reads the K/V of the
columns it attends over. Sizes come from the graph's declared shapes and types, so external data is never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper


@dataclass(frozen=True)
class StepFootprint:
    whole_bytes: int  # initializers read whole every step
    lookup_table_bytes: int  # initializers only gathered from (not read whole)
    lookup_row_bytes: int  # one row of each of those tables, summed: what one token reads of them
    kv_column_bytes: int  # K and V of one cache column, every layer

    def decode_bytes(self, rows: int, width: int) -> int:
        """Bytes a decode step of rows rows, each attending over width columns, reads at least."""
        return self.whole_bytes + rows * (self.lookup_row_bytes + width * self.kv_column_bytes)


def _nbytes(tensor: onnx.TensorProto) -> int:
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(dtype).itemsize


def _axis(node: onnx.NodeProto) -> int:
    return next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 0)


def _gathers_rows(node: onnx.NodeProto, position: int) -> bool:
    """Whether node reads its input at position a row per index: a Gather's table on axis 0, or a GatherBlockQuantized's
    blocks and their scales (an untied embedding in 8 or 4 bits: export/quantize.py)."""
    if node.op_type == "Gather":
        return position == 0 and _axis(node) == 0
    if node.op_type == "GatherBlockQuantized":
        return position in (0, 2) and next((a.i for a in node.attribute if a.name == "gather_axis"), 0) == 0
    return False


def step_footprint(model_path: Path, kv_column_bytes: int) -> StepFootprint:
    """The footprint of the graph at model_path (its initializers, not their data); kv_column_bytes: 2 * layers *
    K/V heads * head size * the cache's element size (the artifact's config and dtype say)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, position))
    whole = table = row = 0
    for tensor in graph.initializer:
        size = _nbytes(tensor)
        uses = consumers.get(tensor.name, [])
        gathered = all(_gathers_rows(node, position) for node, position in uses)
        if uses and gathered and len(tensor.dims) >= 2:
            table += size
            row += size // tensor.dims[0]
        else:
            whole += size
    return StepFootprint(whole, table, row, kv_column_bytes)
