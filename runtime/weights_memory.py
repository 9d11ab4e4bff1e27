"""The graph file's pages a session no longer reads, handed back to the system once it is open.

ONNX Runtime maps an artifact's external weights file (model.onnx.data) into memory and, on the CPU provider, copies
the matrices its kernels repack (MatMulNBits' blocks) into memory of its own; the file's pages it read while repacking
stay mapped, and counted in the server's resident memory, though no step reads them again (qwen3-0.6b int8: 160 MB
beside 620 MB of repacked weights; bench/kv_memory.py). madvise(MADV_PAGEOUT) asks Linux to reclaim them: clean file
pages are dropped (the file still holds their bytes), and a page a step does read (a norm's weights, the rows a
shared embedding table gathers) comes back on first use. It only ever advises: nothing is discarded that was written,
and where the kernel has no MADV_PAGEOUT (before Linux 5.4) or the platform no madvise, nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages (clean file pages are dropped; their contents stay in the file)


@functools.cache
def _madvise():
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def release_file_pages(path: Path) -> int:
    """Advise Linux to reclaim this process's mapped pages of the file at path; returns the bytes of mapping advised."""
    madvise = _madvise()
    if madvise is None or not path.exists():
        return 0
    target, advised = str(path.resolve()), 0
    with open("/proc/self/maps") as maps:
        ranges = [line.split()[0] for line in maps if line.rstrip("\n").endswith(" " + target)]
    for span in ranges:
        low, high = (int(bound, 16) for bound in span.split("-"))
        if madvise(low, high - low, MADV_PAGEOUT) == 0:
            advised += high - low
        else:
            log.debug("madvise(MADV_PAGEOUT) on %s: errno %d", target, ctypes.get_errno())
            break
    return advised
