"""Initializers whose bytes are written when the graph is saved, not held in it.

The traced graph's weights never enter the ModelProto: each is a pending initializer (its name, dtype and dims, and an
external-data location of PENDING) beside a producer in a WeightPlan that yields its bytes a block of rows at a time
from the weight source (model/weights.py). Graph rewrites (quantization, transposes) register producers derived from
others. save_graph (write_external) then writes every initializer to the external data file in the order and layout onnx.save_model
gives it (one file, each tensor where the last ended, small ones kept inline), producing each as it is reached: the
export holds one block of one weight at a time, whatever the model's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kvserve.model.weights import WeightSource, row_blocks

PENDING = "kvserve:pending"  # the external-data location of an initializer whose bytes the plan produces
# onnx.save_model moves an initializer to the external file when sys.getsizeof(raw_data) reaches its size_threshold
# (1024 here): a bytes object's size is its length plus this header.
BYTES_OBJECT_HEADER = 33
INLINE_BELOW = 1024

Chunks = Callable[[], Iterator[np.ndarray]]


class WeightPlan:
    """name -> how the pending initializer of that name is produced."""

    def __init__(self, source: WeightSource):
        self.source = source
        self.producers: dict[str, tuple[np.dtype, tuple[int, ...], Chunks]] = {}
        self.keys: dict[str, tuple[str, np.dtype]] = {}  # initializer -> the source parameter it is, and its dtype
        self.transposes: dict[str, str] = {}  # initializer -> the initializer it is the transpose of

    def add(self, name: str, dtype: np.dtype, shape: tuple[int, ...], chunks: Chunks) -> TensorProto:
        """Register name's producer (chunks: a callable yielding its values in C order, a block at a time); returns the
        pending initializer to put in the graph."""
        dtype = np.dtype(dtype)
        self.producers[name] = (dtype, tuple(shape), chunks)
        return pending_initializer(name, dtype, shape)

    def parameter(self, name: str, key: str, dtype: np.dtype) -> TensorProto:
        """The source's parameter key, cast to dtype, as the initializer name."""
        shape = self.source.shape(key)
        self.keys[name] = (key, np.dtype(dtype))
        blocks = list(row_blocks(shape[0], 4 * math.prod(shape[1:])))
        return self.add(name, dtype, shape, lambda: (self.rows(name, start, stop) for start, stop in blocks))

    def transposed(self, name: str, of: str) -> TensorProto:
        """name: the 2-D pending initializer of, transposed. Its rows are of's columns: whoever can use of's rows instead
        (the quantizer's columns) asks columns(); written as it is, it is produced whole."""
        dtype, shape, _ = self.producers[of]
        self.transposes[name] = of
        return self.add(name, dtype, shape[::-1], lambda: iter([self.array(of).T]))

    def alias(self, name: str, of: str) -> TensorProto:
        """name: the same values as of, under another name."""
        dtype, shape, chunks = self.producers[of]
        if of in self.transposes:
            self.transposes[name] = self.transposes[of]
        if of in self.keys:
            self.keys[name] = self.keys[of]
        return self.add(name, dtype, shape, chunks)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of the pending initializer name."""
        if name in self.keys:
            key, dtype = self.keys[name]
            return self.source.rows(key, start, stop).numpy().astype(dtype, copy=False)
        return self.array(name)[start:stop]

    def columns(self, name: str, start: int, stop: int) -> np.ndarray:
        """Columns start..stop of the 2-D pending initializer name, (rows, stop - start), contiguous: of a transpose, the
        rows of what it transposes, read as stored."""
        if name in self.transposes:
            return np.ascontiguousarray(self.rows(self.transposes[name], start, stop).T)
        return np.ascontiguousarray(self.array(name)[:, start:stop])

    def nbytes(self, name: str) -> int:
        dtype, shape, _ = self.producers[name]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def chunks(self, name: str) -> Iterator[np.ndarray]:
        return self.producers[name][2]()

    def array(self, name: str) -> np.ndarray:
        """The whole initializer in memory (small ones, and tests)."""
        dtype, shape, chunks = self.producers[name]
        parts = [np.ascontiguousarray(c).reshape(-1) for c in chunks()]
        return (np.concatenate(parts) if parts else np.empty(0, dtype)).astype(dtype, copy=False).reshape(shape)


def pending_initializer(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> TensorProto:
    tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=PENDING)
    return tensor


def is_pending(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL and any(e.key == "location" and e.value == PENDING for e in tensor.external_data)


def initializers(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every initializer, the branches' included, in the order onnx's external-data writer visits them."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from initializers(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from initializers(subgraph)


def weight_bytes(model: onnx.ModelProto, plan: WeightPlan | None) -> int:
    """The bytes of every initializer, pending ones included. From the raw bytes, not ByteSize(): protobuf refuses to
    size a message past 2 GB."""
    return sum(plan.nbytes(t.name) if plan is not None and is_pending(t) else len(t.raw_data) or t.ByteSize()
               for t in initializers(model.graph))


def materialize(model: onnx.ModelProto, plan: WeightPlan) -> onnx.ModelProto:
    """Every pending initializer filled in with its bytes, in memory (small graphs, and what works on whole protos)."""
    for tensor in initializers(model.graph):
        if is_pending(tensor):
            tensor.raw_data = plan.array(tensor.name).tobytes()
            tensor.ClearField("data_location")
            del tensor.external_data[:]
    return model


def _set_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def write_external(model: onnx.ModelProto, plan: WeightPlan | None, data_path: Path) -> None:
    """Write every pending initializer, and every inline one onnx would move out, to data_path, one after another as
    onnx.save_model lays them; the graph is left pointing at them."""
    with open(data_path, "wb") as file:
        for tensor in initializers(model.graph):
            pending = plan is not None and is_pending(tensor)
            size = plan.nbytes(tensor.name) if pending else len(tensor.raw_data)
            if size + BYTES_OBJECT_HEADER < INLINE_BELOW:  # small: inline, where onnx.save_model leaves it
                if pending:
                    tensor.raw_data = plan.array(tensor.name).tobytes()
                    tensor.ClearField("data_location")
                    del tensor.external_data[:]
                continue
            offset = file.tell()
            if pending:
                dtype = plan.producers[tensor.name][0]
                for chunk in plan.chunks(tensor.name):
                    file.write(np.ascontiguousarray(chunk, dtype=dtype).data)
            else:
                file.write(tensor.raw_data)
                tensor.ClearField("raw_data")
            if file.tell() - offset != size:
                raise RuntimeError(f"{tensor.name}: produced {file.tell() - offset} bytes, expected {size}")
            _set_external(tensor, data_path.name, offset, size)
