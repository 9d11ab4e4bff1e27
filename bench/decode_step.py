"""One ONNX decode step at a chosen past length, shared by the benchmarks that time or profile it. No torch."""

from __future__ import annotations

import numpy as np

from kvserve.service.runtime import DecoderRuntime


def onnx_step(runtime: DecoderRuntime, config, past_len: int):
    """A callable running one decode step (B=1, T=1) over a past of past_len positions. Every call starts from
    the same past; an inplace buffer is rewritten at the same column each time, which changes nothing timed."""
    rng = np.random.default_rng(0)
    shape = (1, config.n_head, past_len, config.d_head)  # (B, H, P, d_k)
    past = runtime.to_device([rng.standard_normal(shape).astype(runtime.kv_dtype) for _ in range(2 * config.n_layer)])
    mask = np.ones((1, past_len + 1), dtype=np.int64)
    pos = np.array([[past_len]], dtype=np.int64)
    ids = np.array([[42]], dtype=np.int64)
    return lambda: runtime.run(ids, mask, pos, past)
