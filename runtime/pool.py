"""The slots layout's KV cache (export's contract: contract/io_contract.py) and a count of what moves through the host.

One allocation per layer's K and V, (rows, H_kv, capacity, d_k), on the session's device (a ring layer's (rows, H_kv,
R + 1, d_k): its window and a block, contract/io_contract.py). On the CPU provider each is
an anonymous mapping reserved for a whole context but committed page by page as tokens are written, so the memory a
pool holds follows the tokens its rows hold (a row's K/V of one head is contiguous, left-aligned, so its pages fill
from the front), and a row that is emptied gives its pages back (discard). Nothing is touched when the pool is made:
a 16-row gpt2 pool of whole contexts is 1.2 GB of address space, which took 1.6 s to fill on the development VM and
held that memory from the start; a step instead pays the page faults of the columns it writes (a 4 KiB page holds
16 columns of one gpt2 head in float32; bench/kv_memory.py measures both). Under CUDA the pool is device memory,
allocated whole. A step binds the pool's first rows by address as both past and present (step.py), so
ONNX Runtime writes each new token's K/V into its row. The pool copies K/V between rows only when asked (a sequence
changes row, or takes a prompt prefix another row holds), on the device where it lives, never through the host.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from kvserve.contract.config import DecoderConfig

log = logging.getLogger(__name__)

CUDA_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind
HOST_SPARE_BYTES = 1 << 20  # what a CPU pool's exchange of two rows holds aside at once (exchange_rows)
# Linux's MAP_NORESERVE (Python's mmap names it from 3.13): a whole context of address space is reserved without
# counting against the overcommit heuristic, which refuses one mapping larger than the machine's memory.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


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


def reserve(shape: tuple[int, ...], dtype) -> tuple[mmap.mmap, np.ndarray]:
    """A zeroed array over an anonymous mapping of its own, committed as it is written."""
    count = int(np.prod(shape))
    memory = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return memory, np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


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
    """The slots layout's cache: per layer K and V, each (rows, H, capacity, d_k), on the session's device; a ring
    layer's (rows, H, R + 1, d_k) (contract/io_contract.py: position p in column p mod R, the scratch column last).
    Rows are the batch's slots; a step binds rows [0, B) by address. On the CPU provider the memory is the host's,
    reserved and committed as written (the module's docstring); under CUDA it is device memory, never read back on
    the serving path: a row moves on the device (copy_columns)."""

    def __init__(self, rows: int, n_kv_head: int, d_head: int, capacity: int, n_layer: int, kv_dtype, device: str,
                 traffic: KvTraffic, rings: dict[int, int] | None = None, scratch_position: int | None = None):
        """device: "cpu" or "cuda", where the session runs; traffic: the runtime's counters, which this pool adds to;
        rings: {layer: columns} of the graph's ring layers (their ring and scratch column); scratch_position: where a
        ring graph's scratch tokens run (io_contract.SCRATCH_POSITION; needed with rings)."""
        rings = rings or {}
        if rings and scratch_position is None:
            raise ValueError("a pool with ring layers needs the graph's scratch position")
        self.rows, self.capacity, self.kv_dtype, self.traffic = rows, capacity, kv_dtype, traffic
        self.ring = next(iter(rings.values())) - 1 if rings else None  # positions a ring row holds
        # the position a row with nothing to decode runs a scratch token at (every layer writes it where no token is read)
        self.scratch = scratch_position if rings else capacity - 1
        self.shape = (rows, n_kv_head, capacity, d_head)  # (S, H_kv, C, d_k): a whole-context layer's
        self.column_bytes = n_kv_head * d_head * np.dtype(kv_dtype).itemsize  # one column of one row, every head
        # per value (each layer's K then V): its columns, and whether it is a ring
        self.columns = [rings.get(layer, capacity) for layer in range(n_layer) for _ in (0, 1)]
        self.rings = [layer in rings for layer in range(n_layer) for _ in (0, 1)]
        self.row_bytes = n_kv_head * capacity * d_head * np.dtype(kv_dtype).itemsize  # one whole-context layer's K of one row
        self._spare = None  # under CUDA, one row of one layer that exchange_rows moves a row's K/V through
        self._host_spare = None  # on the CPU provider, HOST_SPARE_BYTES that exchange_rows moves rows through, piece by piece
        shapes = [(rows, n_kv_head, columns, d_head) for columns in self.columns]
        if device == "cpu":
            self._mappings, self.arrays = zip(*(reserve(shape, kv_dtype) for shape in shapes))
            self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]  # the same memory
        else:
            self.arrays = None
            # rows read padding columns: they must hold numbers
            self.values = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, kv_dtype), "cuda", 0) for shape in shapes]

    def value_shape(self, index: int, rows: int) -> tuple[int, int, int, int]:
        """(rows, H_kv, columns, d_k): how value index (a layer's K or V) is bound for rows consecutive rows."""
        return (rows, self.shape[1], self.columns[index], self.shape[3])

    def value_row_bytes(self, index: int) -> int:
        """Bytes of one row of value index."""
        return self.columns[index] * self.column_bytes

    def held_columns(self, index: int, tokens: int) -> int:
        """Columns of value index that hold a row's first `tokens` positions: a ring's at most its ring."""
        return min(tokens, self.ring) if self.rings[index] else tokens

    def discard(self, row: int, keep_columns: int = 0) -> None:
        """Row's K/V past its first keep_columns positions is no longer wanted (0: none of it is): those pages go back to
        the system and read as zeros (CPU provider; under CUDA the memory stays allocated and the row is overwritten
        when next used). Pages shared with a neighbouring row, or with a kept part of the row, are kept. A row that
        takes another's contents is copied into first and trimmed after (copy_columns): a copy into pages given back
        faults every page in again, 4.8-6.5 ms for a 96-token gpt2 row (7.1 MB) against 0.3-0.5 ms into pages still
        held (bench/row_moves.py, 2-core AMD EPYC Zen 4)."""
        if self.arrays is None:
            return
        page = mmap.PAGESIZE
        heads, value_bytes = self.shape[1], self.column_bytes // self.shape[1]
        for index, memory in enumerate(self._mappings):
            row_bytes, columns = self.value_row_bytes(index), self.columns[index]
            base = row * row_bytes
            kept = self.held_columns(index, keep_columns)
            if kept >= columns:
                continue
            if kept <= 0:
                spans = [(base, base + row_bytes)]
            else:  # each head's columns are a block of its own: the tail of every block
                head_bytes = columns * value_bytes
                spans = [(base + h * head_bytes + kept * value_bytes, base + (h + 1) * head_bytes) for h in range(heads)]
            for first, last in spans:
                start, end = -(-first // page) * page, last // page * page
                if end > start:
                    memory.madvise(mmap.MADV_DONTNEED, start, end - start)

    def pitched_copies(self, source: int, destination: int, columns: int) -> list[tuple[int, int, int, int, int]]:
        """A row's first `columns` positions from row source onto row destination as 2-D copies, one per layer's K and
        V: (destination address, source address, pitch, width, height) in bytes, as cudaMemcpy2D takes them: a row is H
        blocks of its columns x d_k values (one a head), of which each copy takes the first held_columns x d_k."""
        heads, value_bytes = self.shape[1], self.column_bytes // self.shape[1]
        copies = []
        for index, value in enumerate(self.values):
            row_bytes = self.value_row_bytes(index)
            pitch, width = self.columns[index] * value_bytes, self.held_columns(index, columns) * value_bytes
            copies.append((value.data_ptr() + destination * row_bytes, value.data_ptr() + source * row_bytes, pitch, width, heads))
        return copies

    @property
    def copies_rows(self) -> bool:
        """Whether copy_columns can run here (always on the CPU provider; under CUDA with the CUDA runtime found)."""
        return self.arrays is not None or device_copy_2d() is not None

    def _moved_bytes(self, columns: int) -> int:
        """Bytes a copy of a row's first `columns` positions moves, every value."""
        return sum(self.held_columns(index, columns) for index in range(len(self.values))) * self.column_bytes

    def copy_columns(self, source: int, destination: int, columns: int) -> None:
        """Row destination's first `columns` positions become row source's (a sequence changes row, or a new one takes a
        prefix another row holds), on the device where the pool lives: never through the host (device_copies). A ring
        layer's first min(columns, R) columns move: a whole ring once the row has wrapped (kv_rows.py says when a
        wrapped row's prefix may be taken)."""
        if columns <= 0 or source == destination:
            return
        if self.arrays is not None:
            for index, array in enumerate(self.arrays):
                held = self.held_columns(index, columns)
                array[destination, :, :held] = array[source, :, :held]  # (H, held, d_k)
        else:
            copy_2d = device_copy_2d()
            if copy_2d is None:
                raise RuntimeError("no CUDA runtime to copy K/V between rows (copies_rows is False)")
            for copy in self.pitched_copies(source, destination, columns):
                copy_2d(*copy)
        traffic = self.traffic
        traffic.device_copies += 1
        traffic.device_copy_bytes += self._moved_bytes(columns)

    def exchange_rows(self, a: int, b: int, a_columns: int, b_columns: int) -> None:
        """Rows a and b trade contents: b takes a's first a_columns positions and a takes b's first b_columns (rows are
        moved to keep the computed ones dense), through a spare: on the CPU provider HOST_SPARE_BYTES kept for good, the
        shorter side's columns through it a piece at a time (a spare made for each exchange is fresh memory once it is
        large, faulted in page by page: two 1,024-token gpt2 rows exchanged in 14-20 ms that way against 10-14,
        bench/row_moves.py); under CUDA one row of one whole-context layer, kept on the device (cudaMemcpy2D, never
        through the host)."""
        if a == b:
            return
        if b_columns < a_columns:  # the shorter side goes through the spare: it is copied twice
            a, b, a_columns, b_columns = b, a, b_columns, a_columns
        if self.arrays is not None:
            heads, d_head = self.shape[1], self.shape[3]
            if self._host_spare is None:
                self._host_spare = np.empty(HOST_SPARE_BYTES // np.dtype(self.kv_dtype).itemsize, self.kv_dtype)
            step = max(1, self._host_spare.size // (heads * d_head))  # columns of every head the spare holds at once
            for index, array in enumerate(self.arrays):
                held_a, held_b = self.held_columns(index, a_columns), self.held_columns(index, b_columns)
                for start in range(0, held_a, step):
                    end = min(start + step, held_a)
                    spare = self._host_spare[: heads * (end - start) * d_head].reshape(heads, end - start, d_head)  # (H, n, d_k)
                    np.copyto(spare, array[a, :, start:end])
                    array[a, :, start:end] = array[b, :, start:end]
                    array[b, :, start:end] = spare
                array[a, :, held_a:held_b] = array[b, :, held_a:held_b]  # (H, held_b - held_a, d_k): b's longer part
        else:
            copy_2d = device_copy_2d()
            if copy_2d is None:
                raise RuntimeError("no CUDA runtime to exchange K/V rows (copies_rows is False)")
            if self._spare is None:
                self._spare = ort.OrtValue.ortvalue_from_shape_and_type(self.shape[1:], self.kv_dtype, "cuda", 0)  # (H, C, d_k)
            spare = self._spare.data_ptr()  # a row's width or more: any value's row fits at its own pitch
            heads, value_bytes = self.shape[1], self.column_bytes // self.shape[1]
            for index, value in enumerate(self.values):
                row_bytes = self.value_row_bytes(index)
                pitch = self.columns[index] * value_bytes
                a_width, b_width = (self.held_columns(index, n) * value_bytes for n in (a_columns, b_columns))
                row_a, row_b = value.data_ptr() + a * row_bytes, value.data_ptr() + b * row_bytes
                copy_2d(spare, row_a, pitch, a_width, heads)
                copy_2d(row_a, row_b, pitch, b_width, heads)
                copy_2d(row_b, spare, pitch, a_width, heads)
        traffic = self.traffic
        traffic.device_copies += 1
        traffic.device_copy_bytes += 2 * self._moved_bytes(a_columns) + self._moved_bytes(b_columns)

    def row_to_host(self, row: int, columns: int) -> list[np.ndarray]:
        """One row's first `columns` positions, per layer K then V, each (H, columns, d_k) in position order: a ring
        layer's last min(columns, R) of them (what it holds). For parity checks and tests."""
        if self.arrays is not None:
            arrays = [a[row] for a in self.arrays]
        else:
            self.traffic.host_bytes += sum(v.tensor_size_in_bytes() for v in self.values)  # the whole pool comes back
            arrays = [v.numpy()[row] for v in self.values]
        held = []
        for index, array in enumerate(arrays):
            if self.rings[index]:
                positions = np.arange(max(0, columns - self.ring), columns)
                held.append(array[:, positions % self.ring].copy())  # (H, min(columns, R), d_k)
            else:
                held.append(array[:, :columns].copy())  # (H, columns, d_k)
        return held

    def read_row(self, row: int, columns: int, kv_scales: tuple[np.ndarray, np.ndarray] | None = None) -> list[np.ndarray]:
        """row_to_host's arrays as attention reads them, in float32: a float16 pool's widened, an int8 pool's times its
        scales (kv_scales: K's and V's, each (L, H_kv, d_k); export's --kv-dtype int8)."""
        arrays = self.row_to_host(row, columns)
        if kv_scales is None:
            return [a.astype(np.float32, copy=False) for a in arrays]
        scales = [scale for layer in zip(*kv_scales) for scale in layer]  # per layer K then V, each (H_kv, d_k)
        return [a.astype(np.float32) * scale[:, None, :] for a, scale in zip(arrays, scales)]
