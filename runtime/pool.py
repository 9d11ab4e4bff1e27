"""The slots layout's KV cache (export's contract: contract/io_contract.py) and a count of what moves through the host.

One allocation per layer's K and V, (rows, H_kv, capacity, d_k), on the session's device, made and touched once:
memory first touched mid-stream costs page faults that stall a step (a fresh 1.2 GB gpt2 pool took 1.6 s to fill
on the development VM). A step binds the pool's first rows by address as both past and present (step.py), so
ONNX Runtime writes each new token's K/V into its row. The pool copies a row only when asked (move_row: a sequence
changes row), on the device where it lives; under CUDA that copy is staged through the host and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from kvserve.model.config import DecoderConfig

if TYPE_CHECKING:
    from .step import DecoderRuntime


@dataclass(frozen=True)
class Sampled:
    """What a slots step returns for the K tokens it samples from, in host memory."""

    logits: np.ndarray | None  # (K, V) float32; None when the step was asked for greedy tokens alone
    greedy_tokens: np.ndarray  # (K,) int64: each row's argmax


def pool_capacity(config: DecoderConfig) -> int:
    """Columns of a pool row: a whole context, then the scratch column (where a row with nothing to decode writes)."""
    return config.n_ctx + 1


@dataclass
class KvTraffic:
    """What the runtime moved. host_bytes: K/V through host memory (a row move staged through the host under CUDA, a
    row read back for a check); row_moves: rows of a SlotPool moved to another row; logits_bytes: slots steps' logits handed to the
    host for sampling (a copy from the device under CUDA)."""

    host_bytes: int = 0
    row_moves: int = 0
    logits_bytes: int = 0


class SlotPool:
    """The slots layout's cache: per layer K and V, each (rows, H, capacity, d_k), on the session's device.
    Rows are the batch's slots; a step binds rows [0, B) by address. On the CPU provider the memory is
    numpy's (the device is the host), zeroed here so every page is touched before any step runs; under
    CUDA it is device memory, read back only to move a row (kv_slots never does under CUDA)."""

    def __init__(self, runtime: DecoderRuntime, rows: int, n_kv_head: int, d_head: int, capacity: int):
        self.runtime, self.rows, self.capacity = runtime, rows, capacity
        self.shape = (rows, n_kv_head, capacity, d_head)  # (S, H_kv, C, d_k)
        self.row_bytes = n_kv_head * capacity * d_head * np.dtype(runtime.kv_dtype).itemsize  # one layer's K of one row
        if runtime.device == "cpu":
            self.arrays = [np.empty(self.shape, runtime.kv_dtype) for _ in range(2 * runtime.n_layer)]
            for array in self.arrays:
                array.fill(0)  # touch every page now: a first touch mid-step is a page fault the step waits for
            self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]  # the same memory
        else:
            self.arrays = None
            zeros = np.zeros(self.shape, runtime.kv_dtype)  # rows read padding columns: they must hold numbers
            self.values = [ort.OrtValue.ortvalue_from_numpy(zeros, "cuda", 0) for _ in range(2 * runtime.n_layer)]

    def _host_views(self) -> list[np.ndarray]:
        """The pool as numpy arrays: the memory itself on CPU; a copy from the GPU otherwise (counted)."""
        if self.arrays is not None:
            return self.arrays
        self.runtime.traffic.host_bytes += sum(v.numpy().nbytes for v in self.values)
        return [v.numpy() for v in self.values]

    def _write_back(self, arrays: list[np.ndarray]) -> None:
        if self.arrays is None:
            for value, array in zip(self.values, arrays):
                value.update_inplace(np.ascontiguousarray(array))
            self.runtime.traffic.host_bytes += sum(a.nbytes for a in arrays)

    def move_row(self, source: int, destination: int, columns: int) -> None:
        """Copy the first `columns` columns of row source into row destination (a sequence changes slot)."""
        arrays = self._host_views()
        for array in arrays:
            array[destination, :, :columns] = array[source, :, :columns]
        self._write_back(arrays)
        self.runtime.traffic.row_moves += 1

    def row_to_host(self, row: int, columns: int) -> list[np.ndarray]:
        """One row's first columns, per layer K then V, each (H, columns, d_k): for parity checks and tests."""
        if self.arrays is not None:
            return [a[row, :, :columns].copy() for a in self.arrays]
        return [v.numpy()[row, :, :columns] for v in self.values]
