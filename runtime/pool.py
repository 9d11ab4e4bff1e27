"""The slots layout's KV cache (export's contract: contract/io_contract.py) and a count of what moves through the host.

One allocation per layer's K and V, (rows, H_kv, capacity, d_k), on the session's device, made and touched once:
memory first touched mid-stream costs page faults that stall a step (a fresh 1.2 GB gpt2 pool took 1.6 s to fill
on the development VM). A step binds the pool's first rows by address as both past and present (step.py), so
ONNX Runtime writes each new token's K/V into its row. The pool copies K/V between rows only when asked (a sequence
changes row, or takes a prompt prefix another row holds), on the device where it lives, never through the host.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from kvserve.contract.config import DecoderConfig

log = logging.getLogger(__name__)

CUDA_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind


@functools.cache
def device_copy_2d() -> Callable[[int, int, int, int, int], None] | None:
    """cudaMemcpy2D(destination, pitch, source, pitch, width, height), device to device, from the CUDA runtime that ONNX
    Runtime's CUDA provider has loaded (found by its soname); None where none can be loaded. Synchronous: it is done
    before the next step is launched, and a step has finished before the copy starts (a step returns its outputs)."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            memcpy_2d = ctypes.CDLL(name).cudaMemcpy2D
            break
        except (OSError, AttributeError):
            continue
    else:
        log.warning("no CUDA runtime library (libcudart) to copy K/V between rows on the GPU: prompts are not copied "
                    "from rows in use")
        return None
    memcpy_2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    memcpy_2d.restype = ctypes.c_int

    def copy(destination: int, source: int, pitch: int, width: int, height: int) -> None:
        error = memcpy_2d(destination, pitch, source, pitch, width, height, CUDA_MEMCPY_DEVICE_TO_DEVICE)
        if error:
            raise RuntimeError(f"cudaMemcpy2D between K/V rows failed: CUDA error {error}")

    return copy


def pool_capacity(config: DecoderConfig) -> int:
    """Columns of a pool row: a whole context, then the scratch column (where a row with nothing to decode writes)."""
    return config.n_ctx + 1


@dataclass
class KvTraffic:
    """What the runtime moved. host_bytes: K/V through host memory (a row read back for a check; the serving path moves
    none); device_copies and device_copy_bytes: K/V copied between rows of a SlotPool where it lives (a sequence changing
    row, a prompt prefix taken from another row); logits_bytes: slots steps' logits handed to the host for sampling (a
    copy from the device under CUDA)."""

    host_bytes: int = 0
    device_copies: int = 0
    device_copy_bytes: int = 0
    logits_bytes: int = 0


class SlotPool:
    """The slots layout's cache: per layer K and V, each (rows, H, capacity, d_k), on the session's device.
    Rows are the batch's slots; a step binds rows [0, B) by address. On the CPU provider the memory is
    numpy's (the device is the host), zeroed here so every page is touched before any step runs; under
    CUDA it is device memory, never read back on the serving path: a row moves on the device (copy_columns)."""

    def __init__(self, rows: int, n_kv_head: int, d_head: int, capacity: int, n_layer: int, kv_dtype, device: str,
                 traffic: KvTraffic):
        """device: "cpu" or "cuda", where the session runs; traffic: the runtime's counters, which this pool adds to."""
        self.rows, self.capacity, self.kv_dtype, self.traffic = rows, capacity, kv_dtype, traffic
        self.shape = (rows, n_kv_head, capacity, d_head)  # (S, H_kv, C, d_k)
        self.row_bytes = n_kv_head * capacity * d_head * np.dtype(kv_dtype).itemsize  # one layer's K of one row
        if device == "cpu":
            self.arrays = [np.empty(self.shape, kv_dtype) for _ in range(2 * n_layer)]
            for array in self.arrays:
                array.fill(0)  # touch every page now: a first touch mid-step is a page fault the step waits for
            self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]  # the same memory
        else:
            self.arrays = None
            zeros = np.zeros(self.shape, kv_dtype)  # rows read padding columns: they must hold numbers
            self.values = [ort.OrtValue.ortvalue_from_numpy(zeros, "cuda", 0) for _ in range(2 * n_layer)]
        self._spare: np.ndarray | None = None  # exchange_rows' staging row, made on first use

    def pitched_copies(self, source: int, destination: int, columns: int) -> list[tuple[int, int, int, int, int]]:
        """The first `columns` columns of row source onto row destination as 2-D copies, one per layer's K and V:
        (destination address, source address, pitch, width, height) in bytes, as cudaMemcpy2D takes them: a row is
        H blocks of capacity x d_k values (one a head), of which each copy takes the first columns x d_k."""
        _, heads, capacity, d_head = self.shape
        itemsize = np.dtype(self.kv_dtype).itemsize
        pitch, width = capacity * d_head * itemsize, columns * d_head * itemsize
        return [(value.data_ptr() + destination * self.row_bytes, value.data_ptr() + source * self.row_bytes, pitch, width, heads)
                for value in self.values]

    @property
    def copies_rows(self) -> bool:
        """Whether copy_columns can run here (always on the CPU provider; under CUDA with the CUDA runtime found)."""
        return self.arrays is not None or device_copy_2d() is not None

    def copy_columns(self, source: int, destination: int, columns: int) -> None:
        """Row destination's first `columns` columns become row source's (a sequence changes row, or a new one takes a
        prefix another row holds), on the device where the pool lives: never through the host (device_copies)."""
        if columns <= 0 or source == destination:
            return
        if self.arrays is not None:
            for array in self.arrays:
                array[destination, :, :columns] = array[source, :, :columns]  # (H, columns, d_k)
        else:
            copy_2d = device_copy_2d()
            if copy_2d is None:
                raise RuntimeError("no CUDA runtime to copy K/V between rows (copies_rows is False)")
            for copy in self.pitched_copies(source, destination, columns):
                copy_2d(*copy)
        traffic = self.traffic
        traffic.device_copies += 1
        traffic.device_copy_bytes += columns * self.row_bytes // self.capacity * len(self.values)

    def exchange_rows(self, a: int, b: int, a_columns: int, b_columns: int) -> None:
        """Rows a and b trade contents: b takes a's first a_columns columns and a takes b's first b_columns (on the CPU
        provider, where rows are moved to keep the computed ones dense; through a spare row of the same memory)."""
        if a == b:
            return
        if self.arrays is None:
            raise RuntimeError("rows are exchanged on the CPU provider only (under CUDA a freed row stays where it is)")
        if self._spare is None:
            self._spare = np.empty(self.shape[1:], self.kv_dtype)  # (H, C, d_k): one row of one layer's K or V
        if b_columns < a_columns:  # the shorter side goes through the spare row: it is copied twice
            a, b, a_columns, b_columns = b, a, b_columns, a_columns
        spare = self._spare
        for array in self.arrays:
            spare[:, :a_columns] = array[a, :, :a_columns]
            array[a, :, :b_columns] = array[b, :, :b_columns]
            array[b, :, :a_columns] = spare[:, :a_columns]
        traffic = self.traffic
        traffic.device_copies += 1
        traffic.device_copy_bytes += (2 * a_columns + b_columns) * self.row_bytes // self.capacity * len(self.values)

    def row_to_host(self, row: int, columns: int) -> list[np.ndarray]:
        """One row's first columns, per layer K then V, each (H, columns, d_k): for parity checks and tests."""
        if self.arrays is not None:
            return [a[row, :, :columns].copy() for a in self.arrays]
        self.traffic.host_bytes += sum(v.tensor_size_in_bytes() for v in self.values)  # the whole pool comes back
        return [v.numpy()[row, :, :columns] for v in self.values]
