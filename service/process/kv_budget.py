"""The K/V cache's memory budget (serve --kv-cache-memory): how many bytes the K/V of the sequences in rows and of the
prompt cache may take together, and its default, a share of the memory the server may use.

On the CPU provider the pool's memory is committed as tokens are written (runtime/pool.py), so without a bound a
long-context model's rows could outgrow the container mid-stream and be killed; the batch's rows (kv_rows.py) admit a
sequence only when the most it can hold fits the budget, and the validator refuses one that never could. Under CUDA
the pool is allocated whole at start, which is its own bound: no budget applies there.
"""

from __future__ import annotations

import re
from decimal import Decimal

from kvserve.runtime import memory_limit

# The default budget: this share of the memory the server may use (the container's limit where one is set, else the
# machine's); the rest is the weights, ONNX Runtime's buffers and the process itself.
DEFAULT_SHARE = 0.5
# The smallest budget a server starts with, in tokens of its model's K/V: its warm-up's sequences must fit, and a
# budget below a short prompt's would refuse every request.
MIN_BUDGET_TOKENS = 64
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
MAX_SIZE = 2**63 - 1  # bytes: past this no machine addresses memory
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from '8589934592', '8G' / '8GB' (powers of 1000) or '8Gi' / '8GiB' (of 1024); ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: bytes, or a number with K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti")
    unit = (match.group(2) or "").lower().removesuffix("b")
    value = Decimal(match.group(1)) * _UNITS[unit]  # exact, where a float of 400 nines is inf
    if value > MAX_SIZE:  # compared before int(): no digit limit or overflow can be reached
        raise ValueError(f"{text[:40]!r} is past the largest size, {MAX_SIZE} bytes (what a 64-bit machine addresses)")
    return int(value)


def default_budget() -> int:
    return int(DEFAULT_SHARE * memory_limit())
