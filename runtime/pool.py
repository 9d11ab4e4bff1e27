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
ONNX Runtime writes each new token's K/V into its row. The pool moves K/V between rows only when asked (a sequence
changes row, or takes a prompt prefix another row holds), on the device where it lives, never through the host. On the
CPU provider each whole-context row is padded to whole pages (remap_columns: gpt2's 1,025 columns to 1,028; the
columns past the context are never written, read or committed), so a long row that changes place trades pages with
the row it goes to (mremap, page_remap) instead of being copied: a copy into pages its destination never held faults
every one in, on the step thread every stream waits on. A short row (REMAP_MIN_COLUMNS) is still copied.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from kvserve.contract.config import DecoderConfig

log = logging.getLogger(__name__)

CUDA_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind
# mremap's MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP: the pages go to the address given, the old span stays mapped
MREMAP_MOVE = 1 | 2 | 4
# A move or an exchange remaps rows only where one side holds at least this many columns: a shorter row is copied,
# into pages mostly held. In a serving process 72 remaps (gpt2's 24 values, 3 each) cost more than copying a short row:
# 16 staggered streams' step thread spent a p99 of 11.6-14.4 ms between model calls with every move remapped against
# 4.0-4.4 copied (bench/tail_anatomy.py, rows of ~96 tokens, 2-core AMD EPYC Zen 4), where bench/row_moves.py alone
# times them alike; an 875-column row remapped costs 1.3-2.0 ms against 32-34 copied into a short row's place.
REMAP_MIN_COLUMNS = 256
HOST_SPARE_BYTES = 1 << 20  # what a CPU pool's exchange of two rows holds aside at once (exchange_rows)
# Linux's MAP_NORESERVE (Python's mmap names it from 3.13): a whole context of address space is reserved without
# counting against the overcommit heuristic, which refuses one mapping larger than the machine's memory.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


@dataclass(frozen=True)
class DeviceCopies:
    """Copies between K/V rows on the GPU, from the CUDA runtime that ONNX Runtime's CUDA provider has loaded.
    copy_2d(destination, source, pitch, width, height): cudaMemcpy2D, device to device. CUDA returns from such a copy
    before it is done (a device-to-device cudaMemcpy does no host-side synchronization), on the legacy default stream,
    which ONNX Runtime's stream (created non-blocking) never waits for: so a pool's copies end with wait() before it
    returns, or the next step could read a row half copied (ONNX Runtime's own device copies synchronize likewise).
    The copy itself starts after the last step's writes: a step's run has synchronized its stream when it returns."""

    copy_2d: Callable[[int, int, int, int, int], None]
    wait: Callable[[], None]


@functools.cache
def device_copies() -> DeviceCopies | None:
    """The CUDA runtime's row copies (DeviceCopies), found by its soname; None where none can be loaded."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            cudart = ctypes.CDLL(name)
            memcpy_2d, synchronize = cudart.cudaMemcpy2D, cudart.cudaStreamSynchronize
            break
        except (OSError, AttributeError):
            continue
    else:
        log.warning("no CUDA runtime library (libcudart) to copy K/V between rows on the GPU: prompts are not copied "
                    "from rows in use")
        return None
    memcpy_2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    memcpy_2d.restype = ctypes.c_int
    synchronize.argtypes = [ctypes.c_void_p]
    synchronize.restype = ctypes.c_int

    def copy_2d(destination: int, source: int, pitch: int, width: int, height: int) -> None:
        error = memcpy_2d(destination, pitch, source, pitch, width, height, CUDA_MEMCPY_DEVICE_TO_DEVICE)
        if error:
            raise RuntimeError(f"cudaMemcpy2D between K/V rows failed: CUDA error {error}")

    def wait() -> None:
        error = synchronize(None)  # the legacy default stream, which the copies went to
        if error:
            raise RuntimeError(f"waiting for the copies between K/V rows failed: CUDA error {error}")

    return DeviceCopies(copy_2d, wait)


def settle_uploads(device: str) -> None:
    """Wait until what the host wrote into device buffers has landed, before a step reads them: OrtValue.update_inplace
    and ortvalue_from_numpy copy with cudaMemcpy from pageable memory, which CUDA may return from before the DMA to the
    device is done, on the legacy default stream that ONNX Runtime's stream does not wait for (as with DeviceCopies).
    Nothing to wait for on the CPU, or where no CUDA runtime loads (then no CUDA session runs either)."""
    if device != "cpu" and (copies := device_copies()) is not None:
        copies.wait()


@functools.cache
def page_remap() -> Callable[[int, int, int], None] | None:
    """move(source, destination, length): a span of whole pages moved to another address by remapping them, no byte
    copied, the source left mapped and reading as zeros (Linux's mremap with MREMAP_DONTUNMAP, since 5.7); None where
    the C library or the kernel has no such call (tried once on a mapping of its own)."""
    try:
        mremap = ctypes.CDLL(None, use_errno=True).mremap
    except (OSError, AttributeError):
        return None
    mremap.restype = ctypes.c_void_p
    mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def move(source: int, destination: int, length: int) -> None:
        if mremap(source, length, length, MREMAP_MOVE, destination) != destination:
            error = ctypes.get_errno()
            raise OSError(error, f"mremap of {length} bytes between K/V rows failed: {os.strerror(error)}")

    page = mmap.PAGESIZE
    trial = mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(trial, np.uint8)
    try:
        view[0] = 1
        move(view.ctypes.data, view.ctypes.data + page, page)
        works = view[page] == 1 and view[0] == 0
    except OSError:
        works = False
    del view
    trial.close()
    return move if works else None


def remap_max_spans() -> int:
    """The most rows x values a pool may remap: a remapped row can become a mapping of its own, and Linux allows a
    process vm.max_map_count of them (65,530 by default), so half of that, the rest left to everything else."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read()) // 2
    except (OSError, ValueError):
        return 65530 // 2


def remap_columns(columns: int, column_bytes: int) -> int:
    """The fewest columns, at least `columns`, whose row (column_bytes each) is whole pages: such rows move by
    remapping."""
    multiple = mmap.PAGESIZE // math.gcd(column_bytes, mmap.PAGESIZE)
    return -(-columns // multiple) * multiple


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
    none); device_copies: moves and copies of K/V between rows of a SlotPool where it lives (a sequence changing row, a
    prompt prefix taken from another row), device_copy_bytes the bytes they copied, remapped_bytes the bytes they moved
    by remapping pages instead (no byte copied); logits_bytes: slots steps' logits handed to the host for sampling (a
    copy from the device under CUDA)."""

    host_bytes: int = 0
    device_copies: int = 0
    device_copy_bytes: int = 0
    remapped_bytes: int = 0
    logits_bytes: int = 0


class SlotPool:
    """The slots layout's cache: per layer K and V, each (rows, H, capacity, d_k), on the session's device; a ring
    layer's (rows, H, R + 1, d_k) (contract/io_contract.py: position p in column p mod R, the scratch column last).
    Rows are the batch's slots; a step binds rows [0, B) by address. On the CPU provider the memory is the host's,
    reserved and committed as written (the module's docstring); under CUDA it is device memory, never read back on
    the serving path: a row moves on the device (copy_columns)."""

    def __init__(self, rows: int, n_kv_head: int, d_head: int, capacity: int, n_layer: int, kv_dtype, device: str,
                 traffic: KvTraffic, rings: dict[int, int] | None = None, scratch_position: int | None = None,
                 remap_rows: bool = True):
        """device: "cpu" or "cuda", where the session runs; traffic: the runtime's counters, which this pool adds to;
        rings: {layer: columns} of the graph's ring layers (their ring and scratch column); scratch_position: where a
        ring graph's scratch tokens run (io_contract.SCRATCH_POSITION; needed with rings); remap_rows: on the CPU provider,
        rows move by remapping their pages where the system can (page_remap), False: always by copying."""
        rings = rings or {}
        if rings and scratch_position is None:
            raise ValueError("a pool with ring layers needs the graph's scratch position")
        self.rows, self.capacity, self.kv_dtype, self.traffic = rows, capacity, kv_dtype, traffic
        self.ring = next(iter(rings.values())) - 1 if rings else None  # positions a ring row holds
        # the position a row with nothing to decode runs a scratch token at (every layer writes it where no token is read)
        self.scratch = scratch_position if rings else capacity - 1
        self.column_bytes = n_kv_head * d_head * np.dtype(kv_dtype).itemsize  # one column of one row, every head
        remaps = device == "cpu" and remap_rows and rows * 2 * n_layer <= remap_max_spans()
        self._remap = page_remap() if remaps else None
        # A whole-context row is padded to whole pages where rows move by remapping: the columns from capacity on are
        # never written or read (the scratch column stays capacity - 1), and their pages are never committed.
        width = remap_columns(capacity, self.column_bytes) if self._remap else capacity
        self.shape = (rows, n_kv_head, width, d_head)  # (S, H_kv, C, d_k): a whole-context layer's, as steps bind it
        # per value (each layer's K then V): its columns, and whether it is a ring
        self.columns = [rings.get(layer, width) for layer in range(n_layer) for _ in (0, 1)]
        self.rings = [layer in rings for layer in range(n_layer) for _ in (0, 1)]
        self.row_bytes = n_kv_head * width * d_head * np.dtype(kv_dtype).itemsize  # one whole-context layer's K of one row
        # per value: whether its rows are whole pages, so move by remapping (a ring's R + 1 columns seldom are)
        self._remaps = [self._remap is not None and self.value_row_bytes(i) % mmap.PAGESIZE == 0 for i in range(len(self.columns))]
        self._remap_spare = None  # a span of the longest such row that remapped rows pass through
        self.remap_min_columns = REMAP_MIN_COLUMNS  # rows holding fewer are copied
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
        for index in range(len(self._mappings)):
            self._give_back(index, row, keep_columns)

    def _give_back(self, index: int, row: int, keep_columns: int) -> None:
        """discard for value index alone."""
        page = mmap.PAGESIZE
        heads, value_bytes = self.shape[1], self.column_bytes // self.shape[1]
        row_bytes, columns = self.value_row_bytes(index), self.columns[index]
        base = row * row_bytes
        kept = self.held_columns(index, keep_columns)
        if kept >= columns:
            return
        if kept <= 0:
            spans = [(base, base + row_bytes)]
        else:  # each head's columns are a block of its own: the tail of every block
            head_bytes = columns * value_bytes
            spans = [(base + h * head_bytes + kept * value_bytes, base + (h + 1) * head_bytes) for h in range(heads)]
        for first, last in spans:
            start, end = -(-first // page) * page, last // page * page
            if end > start:
                self._mappings[index].madvise(mmap.MADV_DONTNEED, start, end - start)

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
        return self.arrays is not None or device_copies() is not None

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
            for index in range(len(self.arrays)):
                self._copy_value(index, source, destination, columns)
        else:
            device = device_copies()
            if device is None:
                raise RuntimeError("no CUDA runtime to copy K/V between rows (copies_rows is False)")
            for copy in self.pitched_copies(source, destination, columns):
                device.copy_2d(*copy)
            device.wait()
        traffic = self.traffic
        traffic.device_copies += 1
        traffic.device_copy_bytes += self._moved_bytes(columns)

    def _remaps_value(self, index: int, columns: int) -> bool:
        """Whether a move of value index's rows whose longer side holds `columns` goes by remapping (REMAP_MIN_COLUMNS)."""
        return self._remaps[index] and columns >= self.remap_min_columns

    def _remapped(self, index: int, source: int, destination: int, swap: bool) -> bool:
        """Value index's row source's pages go to row destination, no byte copied: its old pages to source (swap,
        through the remap spare), else freed, source then reading as zeros. False where the first remap failed (nothing
        moved: remapping is then off for good and rows are copied)."""
        row_bytes, base = self.value_row_bytes(index), self.arrays[index].ctypes.data
        first, second = base + source * row_bytes, base + destination * row_bytes
        if swap and self._remap_spare is None:
            longest = max(self.value_row_bytes(i) for i, remaps in enumerate(self._remaps) if remaps)
            self._remap_spare = reserve((longest,), np.uint8)
        try:
            if swap:
                spare = self._remap_spare[1].ctypes.data
                self._remap(second, spare, row_bytes)
            else:
                self._remap(first, second, row_bytes)
        except OSError as error:  # the mappings' count at its limit, say: copies still work
            log.warning("K/V rows are copied from now on: %s", error)
            self._remaps = [False] * len(self._remaps)
            return False
        if swap:
            self._remap(first, second, row_bytes)
            self._remap(spare, first, row_bytes)
        self.traffic.remapped_bytes += (1 + swap) * row_bytes
        return True

    def move_row(self, source: int, destination: int, columns: int, destination_columns: int | None = None,
                 trade: bool = False) -> int | None:
        """Row destination takes row source's first `columns` positions, wanted there alone from now on (a sequence
        changes row, a cached row makes way for one); what destination held is dead. Where a value's rows are whole pages
        (remap_columns) and columns reaches remap_min_columns, source's pages become destination's, no byte copied: a
        copy writes into the destination's pages, and those it never held fault in (bench/row_moves.py). Destination's
        old pages are then freed, source reading as zeros, or with trade they go to source, for a sequence about to
        write there to write over rather than fault in. Else the columns are copied and the destination's pages past
        them given back (destination_columns: the columns it held; None: unknown). Returns how many first columns of
        source still hold K/V, none of it wanted, for the caller to give back or write over (None: unknown)."""
        if self.arrays is None:  # under CUDA: the columns copied on the device, whose memory is never given back
            self.copy_columns(source, destination, columns)
            return columns
        left, copied = 0, 0  # copied: bytes
        for index in range(len(self.values)):
            if self._remaps_value(index, columns) and self._remapped(index, source, destination, swap=trade):
                if trade:
                    left = None if destination_columns is None or left is None else max(left, destination_columns)
                continue
            self._copy_value(index, source, destination, columns)
            copied += self.held_columns(index, columns) * self.column_bytes
            left = None if left is None else max(left, columns)
        if copied and (destination_columns is None or destination_columns > columns):
            self.discard(destination, columns)  # a remapped value's pages past them are source's dead ones: they go too
        self.traffic.device_copies += 1
        self.traffic.device_copy_bytes += copied
        return left

    def _copy_value(self, index: int, source: int, destination: int, columns: int) -> None:
        held = self.held_columns(index, columns)
        array = self.arrays[index]
        array[destination, :, :held] = array[source, :, :held]  # (H, held, d_k)

    def exchange_rows(self, a: int, b: int, a_columns: int, b_columns: int) -> None:
        """Rows a and b trade contents: b takes a's first a_columns positions and a takes b's first b_columns (rows are
        moved to keep the computed ones dense). On the CPU provider a value whose rows are whole pages trades them
        (remapped, no byte copied: move_row) when the longer side reaches remap_min_columns; the others go through a
        spare, HOST_SPARE_BYTES kept for good, the shorter side's columns through it a piece at a time (a spare made
        for each exchange is fresh memory once it is large, faulted in page by page: two 1,024-token gpt2 rows
        exchanged in 14-20 ms that way against 10-14, bench/row_moves.py); under CUDA one row of one whole-context
        layer, kept on the device (cudaMemcpy2D, never through the host)."""
        if a == b:
            return
        if b_columns < a_columns:  # the shorter side goes through the spare: it is copied twice
            a, b, a_columns, b_columns = b, a, b_columns, a_columns
        copied = range(len(self.values))  # the values copied, each a_columns twice and b_columns once
        if self.arrays is not None:
            heads, d_head = self.shape[1], self.shape[3]
            copied = []
            for index, array in enumerate(self.arrays):
                if self._remaps_value(index, b_columns) and self._remapped(index, a, b, swap=True):  # b the longer side
                    continue
                copied.append(index)
                if self._host_spare is None:
                    self._host_spare = np.empty(HOST_SPARE_BYTES // np.dtype(self.kv_dtype).itemsize, self.kv_dtype)
                step = max(1, self._host_spare.size // (heads * d_head))  # columns of every head the spare holds at once
                held_a, held_b = self.held_columns(index, a_columns), self.held_columns(index, b_columns)
                for start in range(0, held_a, step):
                    end = min(start + step, held_a)
                    spare = self._host_spare[: heads * (end - start) * d_head].reshape(heads, end - start, d_head)  # (H, n, d_k)
                    np.copyto(spare, array[a, :, start:end])
                    array[a, :, start:end] = array[b, :, start:end]
                    array[b, :, start:end] = spare
                array[a, :, held_a:held_b] = array[b, :, held_a:held_b]  # (H, held_b - held_a, d_k): b's longer part
        else:
            device = device_copies()
            if device is None:
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
                device.copy_2d(spare, row_a, pitch, a_width, heads)
                device.copy_2d(row_a, row_b, pitch, b_width, heads)
                device.copy_2d(row_b, spare, pitch, a_width, heads)
            device.wait()
        traffic = self.traffic
        traffic.device_copies += 1
        copied_columns = sum(2 * self.held_columns(i, a_columns) + self.held_columns(i, b_columns) for i in copied)
        traffic.device_copy_bytes += copied_columns * self.column_bytes

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
